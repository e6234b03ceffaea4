"""HvxGEMV: the IR it leaves for decode and prefill (structural equality with the kernels it adds), which matmuls it
leaves alone, the build plans that have it, the tiny Llama's decode projections all on the HVX GEMV and its prefill
ones on the HVX GEMM, and the "hvx" code order's dequantize (the embedding) against numpy, with a negative
control."""

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, te, tirx

from compiler.codegen import pipeline
from compiler.kernels import hvx_gemv
from compiler.loaders import open_checkpoint
from compiler.model_import.importer import import_model
from compiler.passes.fuse_transpose_matmul import FuseTransposeMatmul
from compiler.passes.hvx_gemv import GEMM_PREFIX, GEMV_PREFIX, QUANTIZE_PREFIX, HvxGEMV
from compiler.quantization import hvx_blocks
from compiler.quantization.dequantize_te import dequantize_te, take_dequantize_te
from compiler.quantization.group import GroupLayout, dequantize, quantize
from compiler.quantization.modules import LAYOUT_ATTR
from compiler.target.build_plan import resolve_plan
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

K, N = 96, 64
LAYOUT = GroupLayout(4, 32, True, "float16").with_code_order("hvx", N)


def _dequantize(bb, layout, stored):
    attrs = {LAYOUT_ATTR: {"bits": layout.bits, "group": layout.group, "symmetric": layout.symmetric,
                           "offset": layout.offset, "code_order": layout.code_order}}
    return bb.emit(bb.call_te(dequantize_te(layout, K, "float32"), *stored, primfunc_name_hint="dequantize",
                              primfunc_attrs=attrs))


def _params(name, rows, layout=LAYOUT):
    x = relax.Var("x", relax.TensorType([1, rows, K], "float32"))
    stored = [relax.Var(s, relax.TensorType(shape, dtype)) for s, (shape, dtype) in layout.shapes(N, K).items()]
    return x, stored


def _module(layout=LAYOUT):
    """decode(x[1, 1, K]) and prefill(x[1, seq, K]): x @ dequantize(q).T, as QuantizedLinear emits it."""
    bb = relax.BlockBuilder()
    for name, rows in (("decode", 1), ("prefill", tirx.Var("seq_len", "int64"))):
        x, stored = _params(name, rows, layout)
        with bb.function(name, [x, *stored]):
            with bb.dataflow():
                w = _dequantize(bb, layout, stored)
                out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
            bb.emit_func_output(out)
    return FuseTransposeMatmul()(bb.get())


# Q6_K's layout: 8-bit codes about 32, a float32 scale per 16 values (the "_g16" kernels, their own records)
Q6_K_LAYOUT = GroupLayout(8, 16, True, "float32", zero_code=32).with_code_order("hvx", N)


def _expected(layout=LAYOUT, name_suffix="4bit_z8", halves=False):
    """_module(layout) written by hand: each row's activations quantized, then the HVX GEMV (decode) or GEMM
    (prefill) on the stored arrays."""
    before = _module(layout)
    bb = relax.BlockBuilder(before)
    opaque = {"op_pattern": 8}
    seq = tirx.Var("seq_len", "int64")  # each kernel's own
    g16 = "_g16" if halves else ""
    bits, zero = layout.bits, layout.offset
    kernels = {
        "decode": (bb.add_func(hvx_gemv.tir_quantize_activations(K, (1, 1, K), halves).with_attrs(opaque),
                               f"{QUANTIZE_PREFIX}k{K}{g16}"),
                   bb.add_func(hvx_gemv.tir_kernel(N, K, bits, False, zero, halves, (1, 1, N)).with_attrs(opaque),
                               f"{GEMV_PREFIX}{name_suffix}_n{N}_k{K}")),
        "prefill": (bb.add_func(hvx_gemv.tir_quantize_activations(K, (1, seq, K), halves).with_attrs(opaque),
                                f"{QUANTIZE_PREFIX}k{K}{g16}_rows"),
                    bb.add_func(hvx_gemv.tir_gemm_kernel(N, K, bits, False, zero, halves,
                                                         (1, tirx.Var("seq_len", "int64"), N)).with_attrs(opaque),
                                f"{GEMM_PREFIX}{name_suffix}_n{N}_k{K}")),
    }
    for name, rows in (("decode", 1), ("prefill", tirx.Var("seq_len", "int64"))):
        quantize_kernel, product = kernels[name]
        x, stored = _params(name, rows, layout)
        with bb.function(name, [x, *stored]):
            with bb.dataflow():
                act = bb.emit(relax.call_tir(quantize_kernel, [x], [
                    relax.TensorType([1, rows, 2 * hvx_gemv.act_record(halves)], "uint8"),
                    relax.TensorType([1, rows, 2], "float32")]))
                records, factors = bb.emit(relax.TupleGetItem(act, 0)), bb.emit(relax.TupleGetItem(act, 1))
                out = bb.emit_output(relax.call_tir(product, [*stored, records, factors],
                                                    relax.TensorType([1, rows, N], "float32")))
            bb.emit_func_output(out)
    built = bb.get()  # the builder named the new functions decode1, prefill1: they replace decode, prefill
    functions = {gv: func for gv, func in built.functions_items()
                 if gv.name_hint not in ("decode", "decode1", "prefill", "prefill1")}
    for name in ("decode", "prefill"):
        functions[tvm.ir.GlobalVar(name)] = built[f"{name}1"]
    return relax.transform.DeadCodeElimination()(tvm.IRModule(functions))


def test_matmuls_become_quantize_plus_hvx_gemv_or_gemm():
    """Before/Expected: decode's matmul becomes the DSP's activation quantize and the HVX GEMV, prefill's (a
    symbolic row count) the rows' quantize and the HVX GEMM, both reading the stored arrays as they are (no
    dequantize left)."""
    after = relax.transform.DeadCodeElimination()(HvxGEMV()(_module()))
    tvm.ir.assert_structural_equal(after, _expected())


def test_a_scale_per_16_values_takes_the_g16_kernels():
    """Before/Expected for Q6_K's layout: the g16 GEMV and GEMM, after the quantize that writes the records with
    sums per half block (96 bytes a pair). Negative control: the g32 kernels' IR is not that."""
    after = relax.transform.DeadCodeElimination()(HvxGEMV()(_module(Q6_K_LAYOUT)))
    tvm.ir.assert_structural_equal(after, _expected(Q6_K_LAYOUT, "8bit_g16_z32", halves=True))
    assert not tvm_ffi.structural_equal(after, _expected(Q6_K_LAYOUT, "8bit_g16_z32", halves=False))


def test_other_code_orders_are_left_alone():
    plain = GroupLayout(4, 32, True, "float16")
    before = _module(plain)
    tvm.ir.assert_structural_equal(HvxGEMV()(before), before)


def test_plans():
    """hexagon-npu with int8 decode activations (its default) stores the hvx order and has the step; int16 keeps
    TVM's float GEMVs, as the other targets do."""
    int8, int16 = (resolve_plan("hexagon-npu", decode_activations=a) for a in ("int8", "int16"))
    assert int8.hvx_gemv and int8.code_order == "hvx" and int8.integer_decode
    assert not int16.hvx_gemv and int16.code_order == "plain" and not int16.integer_decode
    assert resolve_plan("hexagon-npu").decode_activations == "int8"
    for plan, has_step in ((int8, True), (int16, False), (resolve_plan("linux-arm64"), False)):
        assert ("hvx-gemv" in [step for step, _ in pipeline.steps(plan)]) == has_step


def test_tiny_llama_decode_projections_run_on_the_hvx_gemv(tmp_path):
    """The tiny Llama for hexagon-npu with int8 decode activations, through the pipeline up to hvx-gemv: every
    projection of decode (qkv, o, gate_up, down per layer; the tied lm_head) is an HVX GEMV after a quantize of its
    activations, and no NT_matmul is left in decode; prefill's and batch_decode's are HVX GEMMs (prefill's lm_head,
    on its last row, a GEMV)."""
    checkpoint = save_compilable_checkpoint(build_model("llama_gqa"), tmp_path / "hf")
    plan = resolve_plan("hexagon-npu", "q4f16_g32", decode_activations="int8", host_target="host")
    with open_checkpoint(checkpoint) as ckpt:
        mod = import_model(ckpt, plan, 32).mod
    with plan.spec.tvm_target():
        for name, step in pipeline.steps(plan):
            mod = step(mod)
            if name == "hvx-gemv":
                break
    called = re.findall(r"R\.call_tir\((?:cls\.)?(\w+)", mod["decode"].script())
    gemvs = [c for c in called if c.startswith(GEMV_PREFIX)]
    layers = 2
    assert len(gemvs) == 4 * layers + 1 and gemvs[-1].startswith(f"{GEMV_PREFIX}8bit")  # the 8-bit lm_head
    assert sum(c.startswith(QUANTIZE_PREFIX) for c in called) == len(gemvs)
    assert not [c for c in called if c.startswith("NT_matmul")]
    for name, gemms in (("prefill", 4 * layers), ("batch_decode", 4 * layers + 1)):  # batch_decode: lm_head too
        called = re.findall(r"R\.call_tir\((?:cls\.)?(\w+)", mod[name].script())
        assert sum(c.startswith(GEMM_PREFIX) for c in called) == gemms, name
        assert not [c for c in called if c.startswith("NT_matmul")], name


def _built(func_of_tensors, arrays: list[np.ndarray], out_shape) -> np.ndarray:
    inputs = [te.placeholder(a.shape, str(a.dtype)) for a in arrays]
    out = func_of_tensors(*inputs)
    built = tvm.compile(te.create_prim_func([*inputs, out]), target="llvm")
    result = tvm.runtime.tensor(np.zeros(out_shape, np.float32))
    built(*(tvm.runtime.tensor(a) for a in arrays), result)
    return result.numpy()


@pytest.mark.parametrize("layout", [GroupLayout(4, 32, True, "float16"), GroupLayout(4, 32, False, "float16"),
                                    GroupLayout(8, 32, True, "float16"), GroupLayout(4, 128, False, "float16"),
                                    GroupLayout(8, 16, True, "float32", zero_code=32),
                                    GroupLayout(8, 16, False, "float32")], ids=lambda layout: layout.describe())
def test_hvx_order_dequantize_matches_numpy(layout):
    """dequantize_te and take_dequantize_te of the hvx order (a matmul the HVX kernels leave, the tied embedding's
    lookup) give numpy's dequantize of the same codes (float16 scales within 2^4 of their row's largest keep every
    bit: exact here; float32 ones, as K-quants have, round to 16-bit fixed point: within 2^-15 of the row's
    largest weight). A flipped code byte of the stored records changes the weights (negative control)."""
    rng = np.random.default_rng(5)
    n, k = 64, 160
    hvx = layout.with_code_order("hvx", n)
    arrays = quantize(rng.standard_normal((n, k)).astype(np.float32), hvx)
    expected = dequantize(arrays, layout, k)
    stored = hvx_blocks.stored_arrays(arrays, hvx, k)
    assert {key: (a.shape, str(a.dtype)) for key, a in stored.items()} == hvx.shapes(n, k)
    weights = [stored["q_weight"], stored["q_scale"]]
    tolerance = 0 if layout.scale_dtype == "float16" else 2**-15 * np.abs(expected).max(axis=1, keepdims=True)

    def close(got, want, rows):
        assert np.all(np.abs(got - want) <= tolerance if np.isscalar(tolerance) else tolerance[rows])

    close(_built(dequantize_te(hvx, k, "float32"), weights, (n, k)), expected, slice(None))
    ids = np.array([5, 40, 63], np.int32)
    close(_built(take_dequantize_te(hvx, k, "float32"), [ids, *weights], (3, k)), expected[ids], ids)
    wrong = stored["q_weight"].copy()
    wrong[33, -1] ^= 0xFF  # a code byte of the second tile's last record
    assert np.any(_built(dequantize_te(hvx, k, "float32"), [wrong, stored["q_scale"]], (n, k)) != expected)
