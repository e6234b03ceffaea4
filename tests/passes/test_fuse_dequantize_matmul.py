"""FuseDequantizeMatmul: IR in/IR out, numerics against numpy, a shared weight left alone, and a whole tiny model."""

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.codegen import pipeline
from compiler.loaders import open_checkpoint
from compiler.model_import.importer import import_model
from compiler.passes.fuse_dequantize_matmul import FuseDequantizeMatmul
from compiler.passes.fuse_transpose_matmul import FuseTransposeMatmul
from compiler.quantization.dequantize_te import dequantize_te
from compiler.quantization.group import GroupLayout, dequantize, quantize
from compiler.target.build_plan import resolve_plan
from compiler.target.targets import TARGETS_DIR
from tests.helpers.tiny_models import build_model, save_hf

K, N = 64, 24
LAYOUT = GroupLayout(4, 32, False, "float16")  # asymmetric: the q_min operand is fused too


def _quantized_linear_module(shared_weight=False):
    """main(x[1, seq, K], residual, q_weight, q_scale, q_min) = x @ dequantize(q).T + residual, as QuantizedLinear
    emits it; with shared_weight the dequantized weight is also returned, so it must stay materialized."""
    bb = relax.BlockBuilder()
    seq = tirx.Var("seq_len", "int64")
    x = relax.Var("x", relax.TensorType([1, seq, K], "float32"))
    residual = relax.Var("residual", relax.TensorType([1, seq, N], "float32"))
    stored = [relax.Var(name, relax.TensorType(shape, dtype)) for name, (shape, dtype) in LAYOUT.shapes(N, K).items()]
    with bb.function("main", [x, residual, *stored]):
        with bb.dataflow():
            w = bb.emit(bb.call_te(dequantize_te(LAYOUT, K, "float32"), *stored, primfunc_name_hint="dequantize"))
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            y = bb.emit(relax.op.add(y, residual))
            out = bb.emit_output(relax.Tuple([y, w]) if shared_weight else y)
        bb.emit_func_output(out)
    return bb.get()


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _blocks(func):
    found = []

    def walk(node):
        if node is None:
            return
        if isinstance(node, (list, tvm.ir.Array)) or type(node).__name__ == "Array":
            for item in node:
                walk(item)
            return
        if type(node).__name__ == "SBlock":
            found.append(node)
        for field in ("body", "seq", "block", "then_case", "else_case"):
            if hasattr(node, field):
                walk(getattr(node, field))

    walk(func.body)
    return found


def _has_reduction(func) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for block in _blocks(func) for iv in block.iter_vars)


def _fused(mod):
    return FuseDequantizeMatmul()(FuseTransposeMatmul()(mod))


def test_dequantize_is_fused_into_the_matmul():
    mod = _fused(_quantized_linear_module())
    funcs = _prim_funcs(mod)
    assert not [name for name in funcs if name.startswith("dequantize")]
    (name,) = [n for n in funcs if "dequantize" in n]
    assert "NT_matmul" in name and mod["main"].script().count("R.call_tir(") == 1
    fused = funcs[name]
    assert int(fused.attrs["op_pattern"]) == 4  # kOutEWiseFusable: the residual add can still join it
    assert sorted(b.name_hint for b in _blocks(fused) if b.name_hint != "root") == ["NT_matmul", "dequantize"]
    assert _has_reduction(fused)


def test_schedule_materializes_no_whole_weight():
    """The schedule inlines the dequantize (decode) or dequantizes one weight tile per thread (prefill, this
    dynamic-seq kernel): once buffers are compacted to what each loop nest touches, no [N, K] weight remains."""
    seen = {}
    plan = resolve_plan("host")
    with plan.spec.tvm_target():
        for name, step in pipeline.steps(plan):
            seen[name] = step(seen.get("last", _quantized_linear_module()))
            seen["last"] = seen[name]
    compact = tvm.transform.Sequential([
        s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation(),
    ])
    for name, func in _prim_funcs(seen["schedule"]).items():
        if "NT_matmul" in name:
            assert func.attrs["tirx.is_scheduled"]
            lowered = compact(tvm.IRModule({"main": func}))["main"]
            shapes = [[int(d) if isinstance(d, tirx.IntImm) else d for d in buf.shape]
                      for b in _blocks(lowered) for buf in b.alloc_buffers]
            assert [N, K] not in shapes  # the matmul result (before its add), a weight tile and register tiles


def test_residual_epilogue_still_fuses_and_matches_numpy():
    mod = _fused(_quantized_linear_module())
    plan = resolve_plan("host")
    with plan.spec.tvm_target():
        fused = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                          relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    names = [n for n in _prim_funcs(fused) if "NT_matmul" in n]
    assert fused["main"].script().count("R.call_tir(") == 1 and names and "add" in names[0]

    vm = relax.VirtualMachine(pipeline.build(_quantized_linear_module(), plan), tvm.cpu())
    rng = np.random.default_rng(0)
    arrays = quantize(rng.standard_normal((N, K)).astype("float32"), LAYOUT)
    w = dequantize(arrays, LAYOUT, K)
    stored = [tvm.runtime.tensor(arrays[s]) for s in LAYOUT.shapes(N, K)]
    for seq in (1, 7):  # decode (GEMV) and prefill shapes
        x = rng.standard_normal((1, seq, K)).astype("float32")
        r = rng.standard_normal((1, seq, N)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), *stored).numpy()
        np.testing.assert_allclose(got, x @ w.T + r, rtol=1e-5, atol=1e-5)


def test_weight_read_elsewhere_is_left_alone():
    mod = _fused(_quantized_linear_module(shared_weight=True))
    funcs = _prim_funcs(mod)
    assert "dequantize" in funcs and "NT_matmul" in funcs
    assert not [n for n in funcs if n.startswith("fused_")]


@pytest.mark.parametrize("quant", ["q4f16_g32", "q4f16_g32_asym"])
def test_tiny_model_has_no_standalone_dequantize_kernel(tmp_path, quant):
    """Every kernel that reads packed weights also reduces over them; the only exception is the embedding gather.
    On an ARM CPU without the dot product (Cortex-A72 class): on x86 and on dotprod/i8mm ARM cores IntegerDotGEMV
    takes the decode GEMVs first (tests/passes/test_integer_dot_gemv.py)."""
    save_hf(build_model("llama_gqa"), tmp_path / "hf")
    board = (TARGETS_DIR / "linux-arm64.toml").read_text()
    for old, new in (('mcpu = "cortex-a76"', 'mcpu = "cortex-a72"'), ('mattr = ["+neon", "+dotprod"]', 'mattr = ["+neon"]')):
        assert old in board
        board = board.replace(old, new)
    (tmp_path / "neon-only.toml").write_text(board)
    # int16: the file's int8 decode activations need the dot product
    plan = resolve_plan(str(tmp_path / "neon-only.toml"), quant, decode_activations="int16")
    with open_checkpoint(tmp_path / "hf") as ckpt:
        mod = import_model(ckpt, plan, 64).mod
    seen = {}
    pipeline.run_steps(mod, plan, lambda _i, name, m: seen.__setitem__(name, m))
    kernels = _prim_funcs(seen["dead-code-elimination"])
    readers = {n: f for n, f in kernels.items()
               if any(getattr(p, "dtype", None) == "uint8" and len(p.shape) == 2 for p in f.params)}
    gathers = {n for n, f in readers.items() if f.params[0].dtype == "int32"}  # take_dequantize(ids, ...)
    assert readers and gathers == {"take_dequantize"}
    assert all(_has_reduction(f) for n, f in readers.items() if n not in gathers)
    assert not [n for n in kernels if n.startswith("dequantize")]
    # The tied lm_head (embed_tokens.project) reads the packed embedding table inside its matmul.
    calls = []
    relax.analysis.post_order_visit(seen["dead-code-elimination"]["decode"], lambda e: calls.append(e) if (
        isinstance(e, relax.Call) and e.op == tvm.ir.Op.get("relax.call_tir")) else None)
    lm_head = [c.args[0].name_hint for c in calls
               if any("embed_tokens_q_weight" in getattr(a, "name", "") for a in c.args[1].fields)]
    assert len(lm_head) == 1 and "NT_matmul" in lm_head[0]


@I.ir_module(check_well_formed=False)
class _ExpectedMain:
    """main after FuseTransposeMatmul + FuseDequantizeMatmul: one call of the fused kernel on the stored arrays (the
    kernel itself is a stand-in here: its numerics are tested above), the residual add left for FuseOps."""

    @T.prim_func(private=True)
    def fused_dequantize_NT_matmul(a: T.handle):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((1, "seq_len", 64), dtype="float32"), residual: R.Tensor((1, "seq_len", 24), dtype="float32"),
             q_weight: R.Tensor((24, 32), dtype="uint8"), q_scale: R.Tensor((24, 2), dtype="float16"),
             q_min: R.Tensor((24, 2), dtype="float16")) -> R.Tensor((1, "seq_len", 24), dtype="float32"):
        seq_len = T.int64()
        cls = _ExpectedMain
        with R.dataflow():
            lv = R.call_tir(cls.fused_dequantize_NT_matmul, (q_weight, q_scale, q_min, x),
                            out_ty=R.Tensor((1, seq_len, 24), dtype="float32"))
            gv: R.Tensor((1, seq_len, 24), dtype="float32") = R.add(lv, residual)
            R.output(gv)
        return gv


def test_ir_in_ir_out():
    mod = FuseDequantizeMatmul()(FuseTransposeMatmul()(_quantized_linear_module()))
    # map_free_vars: the callee's GlobalVar is matched by position; its name is checked on its own
    tvm.ir.assert_structural_equal(mod["main"], _ExpectedMain["main"], map_free_vars=True)
    assert sorted(gv.name_hint for gv in mod.get_global_vars()) == ["fused_dequantize_NT_matmul", "main"]
