"""IntegerDotGEMV: which matmuls it rewrites (one-row, tagged dequantize, x86 with AVX2 or AVX-512), the IR it leaves,
and the compiled decode function against numpy."""

import re

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.codegen import pipeline
from compiler.kernels import integer_dot_gemv
from compiler.loaders import open_checkpoint
from compiler.model_import.importer import import_model
from compiler.passes.fuse_transpose_matmul import FuseTransposeMatmul
from compiler.passes.integer_dot_gemv import IntegerDotGEMV
from compiler.quantization.dequantize_te import dequantize_te
from compiler.quantization.group import GroupLayout, dequantize, quantize
from compiler.quantization.modules import LAYOUT_ATTR
from compiler.target.build_plan import resolve_plan
from compiler.target.isa import cpu_isa
from tests.helpers.tiny_models import build_model, save_hf

K, N = 128, 48
LAYOUT = GroupLayout(4, 32, True, "float16")
HOST = resolve_plan("host")
ARM = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72", "mattr": ["+neon"]})  # no dotprod
SSE4 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "x86-64-v2"})  # no AVX2


def _module(tagged=True, code_order="plain"):
    """decode(x[1, 1, K]), batch_decode(x[1, batch_size, K]) and prefill(x[1, seq, K]): x @ dequantize(q).T + residual,
    as QuantizedLinear emits it, the codes in `code_order` (ARM targets store the "neon_pairs" one)."""
    bb = relax.BlockBuilder()
    layout = LAYOUT.with_code_order(code_order, N)
    attrs = ({LAYOUT_ATTR: {"bits": 4, "group": 32, "symmetric": True, "offset": 8, "code_order": layout.code_order}}
             if tagged else {})
    for name, rows in (("decode", 1), ("batch_decode", tirx.Var(integer_dot_gemv.BATCH, "int64")),
                       ("prefill", tirx.Var("seq_len", "int64"))):
        x = relax.Var("x", relax.TensorType([1, rows, K], "float32"))
        residual = relax.Var("residual", relax.TensorType([1, rows, N], "float32"))
        stored = [relax.Var(s, relax.TensorType(shape, dtype)) for s, (shape, dtype) in layout.shapes(N, K).items()]
        with bb.function(name, [x, residual, *stored]):
            with bb.dataflow():
                w = bb.emit(bb.call_te(dequantize_te(layout, K, "float32"), *stored, primfunc_name_hint="dequantize",
                                       primfunc_attrs=attrs))
                y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
                out = bb.emit_output(relax.op.add(y, residual))
            bb.emit_func_output(out)
    return bb.get()


def _rewrite(mod, plan, act_bits=16):
    return IntegerDotGEMV(act_bits, plan.gemv_family)(FuseTransposeMatmul()(mod))


def _callees(func) -> list[str]:
    return re.findall(r"R\.call_tir\((?:cls\.)?(\w+)", func.script())


def test_decode_matmul_becomes_activation_quantize_plus_integer_gemv():
    mod = _rewrite(_module(), HOST)
    for function in ("decode", "batch_decode"):
        callees = _callees(mod[function])
        assert [c.split("_int")[0] for c in callees if not c.startswith("add")] == ["quantize_activation",
                                                                                    "integer_dot_gemv"]
        # batch_decode's kernels take the symbolic row count
        assert all(c.endswith("_batch") == (function == "batch_decode") for c in callees if not c.startswith("add"))
    for gv, gemv in mod.functions_items():
        if gv.name_hint.startswith("integer_dot_gemv"):
            assert int(gemv.attrs["op_pattern"]) == 8 and gemv.attrs["tirx.is_scheduled"]  # opaque, by hand
    batched = next(f for gv, f in mod.functions_items() if gv.name_hint.startswith("integer_dot_gemv")
                   and gv.name_hint.endswith("_batch"))
    assert f'xq: T.Buffer(({integer_dot_gemv.BATCH}, {K}), "int16")' in batched.script()
    # prefill (a symbolic row count) keeps the float path for FuseDequantizeMatmul
    assert any(c.startswith("NT_matmul") for c in _callees(mod["prefill"]))
    assert any(c.startswith("dequantize") for c in _callees(mod["prefill"]))


def test_x86_int8_prefill_runs_on_the_batched_gemv():
    """x86 with int8 activations (no integer GEMM there): prefill's matmul becomes the activation quantize (its rows
    in parallel, a kernel of its own) + batch_decode's GEMV kernel; ARM's int8 prefill is left to IntegerDotGEMM."""
    plan = resolve_plan("x86-64-v3", decode_activations="int8")
    mod = IntegerDotGEMV(8, plan.gemv_family, plan.gemv_prefill)(FuseTransposeMatmul()(_module()))
    prefill = [c for c in _callees(mod["prefill"]) if not c.startswith("add")]
    batched = [c for c in _callees(mod["batch_decode"]) if not c.startswith("add")]
    assert prefill == [batched[0] + "_parallel", batched[1]] and batched[1].endswith("_batch")
    quantize = mod.get_global_var(prefill[0])
    assert "T.parallel" in mod[quantize].script() and "T.parallel" not in mod[batched[0]].script()
    arm = resolve_plan("linux-arm64")
    assert not arm.gemv_prefill
    mod = IntegerDotGEMV(8, arm.gemv_family, arm.gemv_prefill)(FuseTransposeMatmul()(_module(code_order="neon_pairs")))
    assert any(c.startswith("NT_matmul") for c in _callees(mod["prefill"]))


@pytest.mark.parametrize("act_bits", [16, 8])
def test_activation_width_selects_the_kernels(act_bits):
    mod = _rewrite(_module(), HOST, act_bits)
    names = [gv.name_hint for gv in mod.get_global_vars() if "integer_dot" in gv.name_hint or "quantize_act" in gv.name_hint]
    assert len(names) == 4 and all(f"_a{act_bits}" in n for n in names)  # decode's and batch_decode's
    (quantize,) = [f for gv, f in mod.functions_items() if gv.name_hint.startswith("quantize_activation")
                   and not gv.name_hint.endswith("_batch")]
    assert f'xq: T.Buffer((128,), "int{act_bits}")' in quantize.script()
    with pytest.raises(ValueError, match="activation bits"):
        IntegerDotGEMV(4, "avx2")


@pytest.mark.parametrize("target,family", [("linux-arm64", "dotprod"), ("android-arm64", "i8mm")])
def test_arm_targets_get_their_family(target, family):
    """The ARM target files: decode GEMVs become the aarch64 variant of their dot-product family (sdot / usdot)."""
    mod = _rewrite(_module(), resolve_plan(target), 8)
    names = [gv.name_hint for gv in mod.get_global_vars() if gv.name_hint.startswith("integer_dot_gemv")]
    assert len(names) == 2 and all(f"_{family}_" in name for name in names)
    assert any(c.startswith("NT_matmul") for c in _callees(mod["prefill"]))


def test_code_order_follows_the_target():
    """The shards hold the codes in the order the target's GEMV reads (quantization/group.CODE_ORDERS): the ARM
    dot-product order on ARM CPUs with one, the HVX GEMV's tiles on hexagon-npu (int8 activations, its default), K
    order elsewhere; a kernel is never built for the other order."""
    names = ("host", "x86-64-v3", "linux-arm64", "android-arm64", "android-adreno", "hexagon-npu")
    orders = {name: resolve_plan(name).code_order for name in names}
    assert orders == dict.fromkeys(names, "plain") | {"linux-arm64": "neon_pairs", "android-arm64": "neon_pairs",
                                                      "hexagon-npu": "hvx"}
    # NEON without dotprod: the float GEMV
    assert integer_dot_gemv.stored_code_order(integer_dot_gemv.family(cpu_isa(ARM))) == "plain"
    for bits, order in ((8, "neon"), (4, "neon"), (4, "neon_pairs")):  # 8-bit codes, odd rows: unpaired
        assert not integer_dot_gemv.GemvShape(N, K, bits, 32, True, "float16", 8, "avx2", code_order=order).supported()
        assert integer_dot_gemv.GemvShape(N, K, bits, 32, True, "float16", 8, "dotprod", code_order=order).supported()
    assert not integer_dot_gemv.GemvShape(N, K, 8, 32, True, "float16", 8, "dotprod",
                                          code_order="neon_pairs").supported()
    assert not integer_dot_gemv.GemvShape(N - 1, K, 4, 32, True, "float16", 8, "dotprod",
                                          code_order="neon_pairs").supported()


def test_left_alone_without_the_layout_tag():
    mod = _rewrite(_module(tagged=False), HOST)
    assert not [gv for gv in mod.get_global_vars() if "integer_dot" in gv.name_hint]
    assert any(c.startswith("NT_matmul") for c in _callees(mod["decode"]))


@pytest.mark.parametrize("target", [ARM, SSE4, tvm.target.Target({"kind": "opencl", "device": "adreno"})])
def test_no_variant_for_cpus_without_an_integer_dot_product(target):
    """NEON without dotprod, x86 without AVX2, a GPU: no family, so the pipeline has no integer-dot-gemv step."""
    assert integer_dot_gemv.family(cpu_isa(target)) is None


def test_pipeline_has_the_step_where_there_is_a_variant():
    for name, has_step in (("host", HOST.integer_decode), ("linux-arm64", True),
                           ("android-arm64", True), ("android-adreno", False), ("hexagon-npu", False)):
        assert ("integer-dot-gemv" in [step for step, _ in pipeline.steps(resolve_plan(name))]) == has_step, name


def test_compiled_decode_matches_numpy():
    vm = relax.VirtualMachine(pipeline.build(_module(), HOST), tvm.cpu())
    rng = np.random.default_rng(0)
    arrays = quantize(rng.standard_normal((N, K)).astype("float32"), LAYOUT)
    w = dequantize(arrays, LAYOUT, K)
    stored = [tvm.runtime.tensor(arrays[s]) for s in LAYOUT.shapes(N, K)]
    for name, rows in (("decode", 1), ("batch_decode", 6), ("prefill", 5)):
        x = rng.standard_normal((1, rows, K)).astype("float32")
        r = rng.standard_normal((1, rows, N)).astype("float32")
        got = vm[name](tvm.runtime.tensor(x), tvm.runtime.tensor(r), *stored).numpy()
        ref = x @ w.T + r
        # decode, batch_decode: int16 activations, errors ~1/65534 of the largest value per 32; prefill: float
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=(1e-5 if name == "prefill" else 2e-4) * np.abs(ref).max())
        if name == "batch_decode":  # each row as decode gives it alone
            for row in range(rows):
                alone = vm["decode"](tvm.runtime.tensor(x[:, row:row + 1]), tvm.runtime.tensor(r[:, row:row + 1]),
                                     *stored).numpy()
                np.testing.assert_array_equal(got[:, row:row + 1], alone)


def test_x86_int8_prefill_rows_are_decode_rows():
    """An x86 int8 build's prefill gives each row what decode gives it alone, bit for bit: 5 rows, and 1030 (two
    chunks of activation rows, kernels/integer_dot_gemv CHUNK_BYTES, and a tail of 2). Negative control: the int16
    build's float prefill is not its decode bit for bit."""
    rng = np.random.default_rng(1)
    arrays = quantize(rng.standard_normal((N, K)).astype("float32"), LAYOUT)
    w = dequantize(arrays, LAYOUT, K)
    stored = [tvm.runtime.tensor(arrays[s]) for s in LAYOUT.shapes(N, K)]
    assert integer_dot_gemv.CHUNK_BYTES // (4 * K) * 4 < 1030

    def prefill_and_decode_rows(vm, rows):
        x = rng.standard_normal((1, rows, K)).astype("float32")
        r = rng.standard_normal((1, rows, N)).astype("float32")
        got = vm["prefill"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), *stored).numpy()
        alone = np.concatenate([vm["decode"](tvm.runtime.tensor(x[:, i:i + 1]), tvm.runtime.tensor(r[:, i:i + 1]),
                                             *stored).numpy() for i in range(rows)], axis=1)
        ref = x @ w.T + r
        np.testing.assert_allclose(got, ref, atol=2e-2 * np.abs(ref).max())  # int8: ~1e-2 of the largest
        return got, alone

    int8, int16 = (relax.VirtualMachine(pipeline.build(_module(), resolve_plan("host", decode_activations=bits)),
                                        tvm.cpu()) for bits in ("int8", "int16"))
    for rows in (5, 1030):
        got, alone = prefill_and_decode_rows(int8, rows)
        np.testing.assert_array_equal(got, alone)
    got, alone = prefill_and_decode_rows(int16, 5)
    assert not np.array_equal(got, alone)


@pytest.mark.parametrize("quant,down_rewritten", [("q4f16_g32", False), ("q4f16_g32_asym", False), ("q8f16_g128", True)])
def test_tiny_model_decode_gemvs_are_rewritten_where_the_shape_allows(tmp_path, quant, down_rewritten):
    """Tiny Llama (hidden 64, intermediate 96, 2 layers, tied lm_head over a 256 vocabulary): qkv, o, gate_up and
    the lm_head become integer GEMVs; down_proj (K = 96) too in 8 bits, while a 4-bit step needs K / 64 whole, so
    there it keeps the fused float kernel. Prefill's only one-row matmul is its last-token lm_head."""
    save_hf(build_model("llama_gqa"), tmp_path / "hf")
    with open_checkpoint(tmp_path / "hf") as ckpt:
        mod = import_model(ckpt, resolve_plan("host", quant), 64).mod
    seen = {}
    pipeline.run_steps(mod, HOST, lambda _i, name, m: seen.__setitem__(name, m))
    lowered = seen["dead-code-elimination"]
    decode = _callees(lowered["decode"])
    gemvs = [c for c in decode if c.startswith("integer_dot_gemv")]
    assert len(gemvs) == (4 if down_rewritten else 3) * 2 + 1
    assert sum(c.endswith("_n256_k64") for c in gemvs) == 1  # the lm_head
    float_gemvs = [c for c in decode if "NT_matmul" in c]
    assert len(float_gemvs) == (0 if down_rewritten else 2) and all("dequantize" in c for c in float_gemvs)
    assert [c for c in _callees(lowered["prefill"]) if c.startswith("integer_dot_gemv")] == [gemvs[-1]]
    # batch_decode (exported where the target has an integer dot product): the same GEMVs, a row per sequence
    batched = [c for c in _callees(lowered["batch_decode"]) if c.startswith("integer_dot_gemv")]
    assert batched == [f"{c}_batch" for c in gemvs]


@I.ir_module(check_well_formed=False)
class _ExpectedDecode:
    """decode on AVX2 with int16 activations: the activation quantized per 32 values (codes, scales, sums), then
    the integer GEMV on the stored codes and scales; the residual add left for FuseOps. The kernels are stand-ins
    (their numerics: tests/kernels/test_integer_dot_gemv.py)."""

    @T.prim_func(private=True)
    def quantize_activation_int4_sym_k128_a16_l8(a: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def integer_dot_gemv_int4_g32_sym_float16_a16_avx2_n48_k128(a: T.handle):
        T.evaluate(0)

    @R.function
    def decode(x: R.Tensor((1, 1, 128), dtype="float32"), residual: R.Tensor((1, 1, 48), dtype="float32"),
               q_weight: R.Tensor((48, 64), dtype="uint8"),
               q_scale: R.Tensor((48, 4), dtype="float16")) -> R.Tensor((1, 1, 48), dtype="float32"):
        cls = _ExpectedDecode
        with R.dataflow():
            lv = R.call_tir(cls.quantize_activation_int4_sym_k128_a16_l8, (x,),
                            out_ty=[R.Tensor((128,), dtype="int16"), R.Tensor((16,), dtype="float32"),
                                    R.Tensor((16,), dtype="float32")])
            lv1: R.Tensor((128,), dtype="int16") = lv[0]
            lv2: R.Tensor((16,), dtype="float32") = lv[1]
            lv3: R.Tensor((16,), dtype="float32") = lv[2]
            lv4 = R.call_tir(cls.integer_dot_gemv_int4_g32_sym_float16_a16_avx2_n48_k128,
                             (lv1, lv2, lv3, q_weight, q_scale), out_ty=R.Tensor((1, 1, 48), dtype="float32"))
            gv: R.Tensor((1, 1, 48), dtype="float32") = R.add(lv4, residual)
            R.output(gv)
        return gv

    @T.prim_func(private=True)
    def quantize_activation_int4_sym_k128_a16_l8_batch(a: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def integer_dot_gemv_int4_g32_sym_float16_a16_avx2_n48_k128_batch(a: T.handle):
        T.evaluate(0)

    @R.function
    def batch_decode(x: R.Tensor((1, "batch_size", 128), dtype="float32"),
                     residual: R.Tensor((1, "batch_size", 48), dtype="float32"),
                     q_weight: R.Tensor((48, 64), dtype="uint8"),
                     q_scale: R.Tensor((48, 4), dtype="float16")) -> R.Tensor((1, "batch_size", 48), dtype="float32"):
        batch_size = T.int64()
        cls = _ExpectedDecode
        with R.dataflow():
            lv = R.call_tir(cls.quantize_activation_int4_sym_k128_a16_l8_batch, (x,),
                            out_ty=[R.Tensor((batch_size, 128), dtype="int16"),
                                    R.Tensor((batch_size, 16), dtype="float32"),
                                    R.Tensor((batch_size, 16), dtype="float32")])
            lv1: R.Tensor((batch_size, 128), dtype="int16") = lv[0]
            lv2: R.Tensor((batch_size, 16), dtype="float32") = lv[1]
            lv3: R.Tensor((batch_size, 16), dtype="float32") = lv[2]
            lv4 = R.call_tir(cls.integer_dot_gemv_int4_g32_sym_float16_a16_avx2_n48_k128_batch,
                             (lv1, lv2, lv3, q_weight, q_scale), out_ty=R.Tensor((1, batch_size, 48), dtype="float32"))
            gv: R.Tensor((1, batch_size, 48), dtype="float32") = R.add(lv4, residual)
            R.output(gv)
        return gv


def test_ir_in_ir_out():
    """For a fixed AVX2 target (x86-64-v3), not this machine: the IR does not depend on where the test runs."""
    mod = _rewrite(_module(), resolve_plan("x86-64-v3"))
    # map_free_vars: the callees' GlobalVars are matched by position; their names are checked on their own
    for function in ("decode", "batch_decode"):
        tvm.ir.assert_structural_equal(mod[function], _ExpectedDecode[function], map_free_vars=True)
        suffix = "_batch" if function == "batch_decode" else ""
        assert [c for c in _callees(mod[function]) if c != "add"] == [
            f"quantize_activation_int4_sym_k128_a16_l8{suffix}",
            f"integer_dot_gemv_int4_g32_sym_float16_a16_avx2_n48_k128{suffix}"]
