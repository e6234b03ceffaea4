"""ChainKernels: IR in/IR out (Before/Expected), the chains' boundaries (negative controls), the decode launches per
layer of each architecture family on every target class, and bit-identical results against the unchained build."""

import functools
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.artifacts.artifact import load_artifact
from compiler.codegen import pipeline
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.commands.estimate import ActivationPlan, scratch_bytes
from compiler.commands.inspect_ir import kernel_launches
from compiler.model_import.importer import import_model, open_model
from compiler.passes.chain_kernels import ChainKernels
from compiler.runtime.session import Session
from compiler.target.build_plan import resolve_plan
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint


@I.ir_module
class _Before:
    """norm -> projection (reads a 2-D weight) -> the KV cache's attention -> scale -> projection -> scale."""

    @T.prim_func(private=True, s_tir=True)
    def norm(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"), y: T.Buffer((1, 8), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in range(8):
            y[0, i] = x[0, i] * w[i]

    @T.prim_func(private=True, s_tir=True)
    def gemv(x: T.Buffer((1, 8), "float32"), w: T.Buffer((4, 8), "float32"), y: T.Buffer((1, 4), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for n in T.parallel(4):
            y[0, n] = T.float32(0)
            for k in range(8):
                y[0, n] = y[0, n] + w[n, k] * x[0, k]

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((1, 4), "float32"), y: T.Buffer((1, 4), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in range(4):
            y[0, i] = x[0, i] * T.float32(2)

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), kv_cache: R.Any,
               params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        cls = _Before
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            h = R.call_tir(cls.norm, (x, w_norm), out_ty=R.Tensor((1, 8), "float32"))
            y = R.call_tir(cls.gemv, (h, w_proj), out_ty=R.Tensor((1, 4), "float32"))
            a = R.call_dps_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", (kv_cache, y),
                                  out_ty=R.Tensor((1, 4), "float32"))
            s = R.call_tir(cls.scale, (a,), out_ty=R.Tensor((1, 4), "float32"))
            t = R.call_tir(cls.scale, (s,), out_ty=R.Tensor((1, 4), "float32"))
            R.output(t)
        return t


@I.ir_module
class _Expected:
    """norm + projection as one kernel whose outputs are both results; after the attention, the two scales (no weight
    read) as one kernel, the second a copy of the first with variables of its own."""

    @T.prim_func(private=True, s_tir=True)
    def gemv_chained(x: T.Buffer((1, 8), "float32"), w: T.Buffer((8,), "float32"), w_1: T.Buffer((4, 8), "float32"),
                     y: T.Buffer((1, 8), "float32"), y_1: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
        with T.sblock("root"):
            T.reads()
            T.writes()
            for i in range(8):
                y[0, i] = x[0, i] * w[i]
            for n in T.parallel(4):
                y_1[0, n] = T.float32(0)
                for k in range(8):
                    y_1[0, n] = y_1[0, n] + w_1[n, k] * y[0, k]

    @T.prim_func(private=True, s_tir=True)
    def scale_chained(x: T.Buffer((1, 4), "float32"), y: T.Buffer((1, 4), "float32"),
                      y_1: T.Buffer((1, 4), "float32")):
        T.func_attr({"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
        with T.sblock("root"):
            T.reads()
            T.writes()
            for i in range(4):
                y[0, i] = x[0, i] * T.float32(2)
            for i in range(4):
                y_1[0, i] = y[0, i] * T.float32(2)

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), kv_cache: R.Any,
               params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        cls = _Expected
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            chained = R.call_tir(cls.gemv_chained, (x, w_norm, w_proj),
                                 out_ty=[R.Tensor((1, 8), "float32"), R.Tensor((1, 4), "float32")])
            y = chained[1]
            a = R.call_dps_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", (kv_cache, y),
                                  out_ty=R.Tensor((1, 4), "float32"))
            chained1 = R.call_tir(cls.scale_chained, (a,),
                                  out_ty=[R.Tensor((1, 4), "float32"), R.Tensor((1, 4), "float32")])
            t = chained1[1]
            R.output(t)
        return t


@I.ir_module
class _PrefillBefore:
    """Prefill's sequence-long kernels, each with its own length variable: the residual add with the norm (two
    results: the sum, which the block's result reads, and the normed rows) -> projection -> scale -> the attention."""

    @T.prim_func(private=True, s_tir=True)
    def add_norm(var_a: T.handle, var_b: T.handle, w: T.Buffer((8,), "float32"), var_s: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        a = T.match_buffer(var_a, (n, 8))
        b = T.match_buffer(var_b, (n, 8))
        s = T.match_buffer(var_s, (n, 8))
        y = T.match_buffer(var_y, (n, 8))
        for r, i in T.grid(n, 8):
            s[r, i] = a[r, i] + b[r, i]
            y[r, i] = s[r, i] * w[i]

    @T.prim_func(private=True, s_tir=True)
    def gemm(var_x: T.handle, w: T.Buffer((4, 8), "float32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 8))
        y = T.match_buffer(var_y, (m, 4))
        for r in T.parallel(m):
            for c in range(4):
                y[r, c] = T.float32(0)
                for k in range(8):
                    y[r, c] = y[r, c] + w[c, k] * x[r, k]

    @T.prim_func(private=True, s_tir=True)
    def scale(var_x: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        k = T.int64()
        x = T.match_buffer(var_x, (k, 4))
        y = T.match_buffer(var_y, (k, 4))
        for r, c in T.grid(k, 4):
            y[r, c] = x[r, c] * T.float32(2)

    @R.function
    def prefill(a: R.Tensor(("seq_len", 8), "float32"), b: R.Tensor(("seq_len", 8), "float32"), kv_cache: R.Any,
                params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _PrefillBefore
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            t = R.call_tir(cls.add_norm, (a, b, w_norm),
                           out_ty=[R.Tensor((seq_len, 8), "float32"), R.Tensor((seq_len, 8), "float32")])
            s = t[0]
            h = t[1]
            y = R.call_tir(cls.gemm, (h, w_proj), out_ty=R.Tensor((seq_len, 4), "float32"))
            z = R.call_tir(cls.scale, (y,), out_ty=R.Tensor((seq_len, 4), "float32"))
            o = R.call_dps_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", (kv_cache, z),
                                  out_ty=R.Tensor((seq_len, 4), "float32"))
            gv = (s, o)
            R.output(gv)
        return gv


@I.ir_module
class _PrefillExpected:
    """One kernel in the first input's length variable; its results are the sum (read after it) and the scaled
    projection (read by the attention); the normed rows and the projection, read by the chain alone, are buffers of its
    own (the runtime's workspace, not the memory plan's)."""

    @T.prim_func(private=True, s_tir=True)
    def gemm_chained(var_a: T.handle, var_b: T.handle, w: T.Buffer((8,), "float32"),
                     w_1: T.Buffer((4, 8), "float32"), var_s: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        a = T.match_buffer(var_a, (n, 8))
        b = T.match_buffer(var_b, (n, 8))
        s = T.match_buffer(var_s, (n, 8))
        y_2 = T.match_buffer(var_y, (n, 4))
        with T.sblock("root"):
            T.reads()
            T.writes()
            y = T.sblock_alloc_buffer((n, 8))
            y_1 = T.sblock_alloc_buffer((n, 4))
            for r, i in T.grid(n, 8):
                s[r, i] = a[r, i] + b[r, i]
                y[r, i] = s[r, i] * w[i]
            for r in T.parallel(n):
                for c in range(4):
                    y_1[r, c] = T.float32(0)
                    for k in range(8):
                        y_1[r, c] = y_1[r, c] + w_1[c, k] * y[r, k]
            for r, c in T.grid(n, 4):
                y_2[r, c] = y_1[r, c] * T.float32(2)

    @R.function
    def prefill(a: R.Tensor(("seq_len", 8), "float32"), b: R.Tensor(("seq_len", 8), "float32"), kv_cache: R.Any,
                params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _PrefillExpected
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            chained = R.call_tir(cls.gemm_chained, (a, b, w_norm, w_proj),
                                 out_ty=[R.Tensor((seq_len, 8), "float32"), R.Tensor((seq_len, 4), "float32")])
            z = chained[1]  # emitted with the chained call; the sum where its tuple item was
            s = chained[0]
            o = R.call_dps_packed("vm.builtin.attention_kv_cache_attention_with_fused_qkv", (kv_cache, z),
                                  out_ty=R.Tensor((seq_len, 4), "float32"))
            gv = (s, o)
            R.output(gv)
        return gv


def _chained(mod: tvm.IRModule) -> tvm.IRModule:
    with tvm.target.Target({"kind": "llvm"}):
        return ChainKernels()(mod)


def test_chains_a_projection_with_its_prologue_and_stops_at_the_attention():
    # the kernels the chains replaced are gone from the module (not built on their own)
    tvm.ir.assert_structural_equal(_chained(_Before), _Expected)


def test_chains_prefill_keeping_what_only_the_chain_reads_inside():
    tvm.ir.assert_structural_equal(_chained(_PrefillBefore), _PrefillExpected)


@I.ir_module
class _NormedReadAfter:
    """Negative control: the normed rows are read after the chain too (a result of the function), so they stay one of
    its results: no buffer of the chained kernel's own."""

    @T.prim_func(private=True, s_tir=True)
    def norm(var_a: T.handle, w: T.Buffer((8,), "float32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        a = T.match_buffer(var_a, (n, 8))
        y = T.match_buffer(var_y, (n, 8))
        for r, i in T.grid(n, 8):
            y[r, i] = a[r, i] * w[i]

    @T.prim_func(private=True, s_tir=True)
    def gemm(var_x: T.handle, w: T.Buffer((4, 8), "float32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, 8))
        y = T.match_buffer(var_y, (m, 4))
        for r, c in T.grid(m, 4):
            y[r, c] = T.float32(0)
            for k in range(8):
                y[r, c] = y[r, c] + w[c, k] * x[r, k]

    @R.function
    def prefill(a: R.Tensor(("seq_len", 8), "float32"),
                params: R.Tuple(R.Tensor((8,), "float32"), R.Tensor((4, 8), "float32"))):
        seq_len = T.int64()
        cls = _NormedReadAfter
        with R.dataflow():
            w_norm = params[0]
            w_proj = params[1]
            h = R.call_tir(cls.norm, (a, w_norm), out_ty=R.Tensor((seq_len, 8), "float32"))
            y = R.call_tir(cls.gemm, (h, w_proj), out_ty=R.Tensor((seq_len, 4), "float32"))
            gv = (h, y)
            R.output(gv)
        return gv


def test_a_result_read_after_the_chain_stays_its_result():
    mod = _chained(_NormedReadAfter)
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernel_launches(mod, "prefill") == 1
    assert [str(b.shape) for b in kernel.params[-2:]] == ["(n, 8)", "(n, 4)"]
    assert list(kernel.body.block.alloc_buffers) == []


def test_the_estimate_counts_the_buffers_a_chain_keeps_inside():
    """Prefill's activations are the memory plan's storage and the heap scratch of its kernel that holds most."""
    kept = _chained(_PrefillBefore)["gemm_chained"]
    (none,) = [f for f in _chained(_NormedReadAfter).functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    plan = ActivationPlan({"prefill": [tvm.tirx.const(100, "int64")]},
                          {"prefill": [scratch_bytes(kept), scratch_bytes(none)]})
    # at 10 rows: the normed rows (8 floats) and the projection (4)
    assert plan.at(10) == (100 + 10 * (8 + 4) * 4, 100)


def test_launch_count_of_the_example():
    assert (kernel_launches(_Before), kernel_launches(_chained(_Before))) == (5, 3)


@I.ir_module(check_well_formed=False)
class _Apart:
    """Negative controls. reshaped: a kernel's result read by a non-kernel binding (a reshape) before the next kernel
    runs; ranks: a parameter declared with another rank than the buffer the chain would hand it (which Relax's
    well-formedness check refuses, but a hand-written kernel may declare). Neither pair may become one kernel."""

    @T.prim_func(private=True, s_tir=True)
    def scale(x: T.Buffer((1, 4), "float32"), y: T.Buffer((1, 4), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in range(4):
            y[0, i] = x[0, i] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def copy(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in range(4):
            y[i] = x[i]

    @R.function
    def reshaped(x: R.Tensor((1, 4), "float32")):
        cls = _Apart
        with R.dataflow():
            s = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((1, 4), "float32"))
            flat = R.reshape(s, (4,))
            t = R.call_tir(cls.copy, (flat,), out_ty=R.Tensor((4,), "float32"))
            R.output(t)
        return t

    @R.function
    def ranks(x: R.Tensor((1, 4), "float32")):
        cls = _Apart
        with R.dataflow():
            s = R.call_tir(cls.scale, (x,), out_ty=R.Tensor((1, 4), "float32"))
            t = R.call_tir(cls.copy, (s,), out_ty=R.Tensor((4,), "float32"))
            R.output(t)
        return t


@pytest.mark.parametrize("function", ["reshaped", "ranks"])
def test_kernels_that_cannot_run_as_one_stay_apart(function):
    assert kernel_launches(_chained(_Apart), function) == 2


# Decode launches per layer: every CPU target class (x86 AVX2/AVX-512 integer GEMVs, the float path of q0f32, ARM
# dotprod and i8mm); the KV cache's attention counts as one. Outside the layers: the model's last norm with lm_head,
# and the attention scale's host function once per call (passes/reuse_host_scalars.py); prefill also its shapes'.
# Every family on x86's AVX2 integer GEMVs and ARM's i8mm ones (int8 prefill GEMMs too); Llama alone on the rest.
CPU_CASES = [(family, target, quant) for family in ("llama_gqa", "qwen3", "gemma3")
             for target, quant in (("x86-64-v3", None), ("android-arm64", None))] + [
    ("llama_gqa", "host", "q0f32"), ("llama_gqa", "host", "q4f16_g32"), ("llama_gqa", "linux-arm64", None)]
GPU_TARGETS = ["android-adreno", "android-mali"]
MAX_LAUNCHES_PER_LAYER = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: save_compilable_checkpoint(build_model(name), root / name) for name in ("llama_gqa", "qwen3",
                                                                                          "gemma3")}


@pytest.fixture(scope="module")
def lowered(checkpoints):
    """(family, target, quant) -> (the module after every step, the module after chain-kernels, its layers), each
    lowered once for the tests that read it."""

    @functools.cache
    def lower(family: str, target: str, quant: str | None) -> tuple[tvm.IRModule, tvm.IRModule | None, int]:
        plan = resolve_plan(target, quant)
        with open_model(str(checkpoints[family])) as ckpt:
            imported = import_model(ckpt, plan, 64)
        after: dict[str, tvm.IRModule] = {}
        final = pipeline.run_steps(imported.mod, plan, lambda _, step, mod: after.setdefault(step, mod))
        return final, after.get("chain-kernels"), imported.cfg.num_hidden_layers

    return lower


@pytest.mark.parametrize("family,target,quant", CPU_CASES)
def test_cpu_decode_launches_five_kernels_per_layer(lowered, family, target, quant):
    mod, _, layers = lowered(family, target, quant)
    # the four projections (their norms, quantization, SwiGLU and casts inside) and the attention
    assert kernel_launches(mod, "decode") == 5 * layers + 2
    # prefill's too, the intermediates only a chain reads in its own buffers; outside the layers as decode's, and
    # the host function of prefill's shapes
    assert kernel_launches(mod, "prefill") - 3 <= MAX_LAUNCHES_PER_LAYER * layers


@pytest.mark.parametrize("family,target,quant", CPU_CASES)
def test_every_function_is_well_formed_after_chaining(lowered, family, target, quant):
    """Every var a chained kernel reads is defined before it: prefill_hidden_states concatenates a residual, an
    earlier chain's tuple item, whose binding stands among the later chain's kernels (android-arm64's build failed
    with "Var lv4 is not defined")."""
    _, chained, _ = lowered(family, target, quant)
    for gv, func in chained.functions_items():
        if not isinstance(func, relax.Function):
            continue
        defined = set(func.params)
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                args = [value.tuple_value] if isinstance(value, relax.TupleGetItem) else list(
                    getattr(value, "args", getattr(value, "fields", [])))
                read = [f for a in args for f in (a.fields if isinstance(a, relax.Tuple) else [a])]
                undefined = [v.name for v in read if isinstance(v, relax.Var) and v not in defined]
                assert not undefined, (gv.name_hint, binding.var.name, undefined)
                defined.add(binding.var)


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_gpu_decode_launches_at_most_six_kernels_per_layer(lowered, target):
    """Llama: each RMSNorm inside the GEMV that reads it (passes/fuse_gemv_norms.py); the QKV, O, gate/up and down
    projections, SwiGLU and the attention."""
    mod, _, layers = lowered("llama_gqa", target, None)
    # outside the layers: lm_head with the last norm, the attention scale's host function
    assert kernel_launches(mod) == 6 * layers + 2


@pytest.mark.parametrize("target", GPU_TARGETS)
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_other_families_gpu_decode_launches_at_most_six_kernels_per_layer(lowered, family, target):
    """Qwen3: Llama's six, its q/k norm inside the QKV GEMV (passes/fuse_gemv_norms.py: one head per work group).
    Gemma 3: its norm weights stored as 1 + w (GemmaConfig.param_offsets), the float32 cast of each norm's input
    inside the GEMV with the norm, its q/k norm and RoPE inside the QKV GEMV, each post-norm with its residual add
    inside the next GEMV (gate/up, the next layer's QKV, lm_head) with the norm it feeds."""
    mod, _, layers = lowered(family, target, None)
    assert kernel_launches(mod) - 2 <= MAX_LAUNCHES_PER_LAYER * layers


# Prefill on GPUs: each RMSNorm inside the GEMM that alone reads it, with Gemma's float32 cast of its input, and the
# q/k norm over each head inside the QKV GEMM with Gemma 3's RoPE after it; Gemma 3's post-norms with their residual
# adds (after O and down) inside the next GEMM (gate/up, the next layer's QKV) before the norm it feeds, run a second
# time into the residual stream (passes/fuse_gemm_norms.py); the last layer's post-feedforward norm, which no GEMM
# reads, inside the final norm's kernel (passes/fuse_norm_pairs.py).
GPU_PREFILL_LAUNCHES_PER_LAYER = {"llama_gqa": 6, "qwen3": 6, "gemma3": 6}


@pytest.mark.parametrize("target", GPU_TARGETS)
@pytest.mark.parametrize("family", ["llama_gqa", "qwen3", "gemma3"])
def test_gpu_prefill_launches_per_layer(lowered, family, target):
    """The QKV GEMM with its norm (and the q/k norm, Gemma 3's RoPE; Gemma 3's previous post-norm), the attention, O,
    gate/up with its norm (Gemma 3's post-attention norm), SwiGLU / GeGLU, down."""
    mod, _, layers = lowered(family, target, None)
    # outside the layers: the last norm, the last token's row, lm_head, the host functions of the attention scale
    # and of prefill's shapes
    assert kernel_launches(mod, "prefill") - 5 == GPU_PREFILL_LAUNCHES_PER_LAYER[family] * layers


def test_nothing_runs_between_the_qkv_projection_and_attention(lowered):
    """Each attention call reads the result of the kernel that computed its layer's QKV projection (RoPE and the KV
    append run inside the cache's attention)."""
    _, chained, layers = lowered("qwen3", "x86-64-v3", None)
    func = chained["decode"]
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    attention = [v for v in bindings.values() if isinstance(v, relax.Call) and len(v.args) > 1
                 and isinstance(v.args[0], relax.ExternFunc) and "attention_with_fused_qkv" in v.args[0].global_symbol]
    assert len(attention) == layers
    for layer, call in enumerate(attention):
        qkv = bindings[call.args[1].fields[-1]]
        kernel = bindings[qkv.tuple_value] if isinstance(qkv, relax.TupleGetItem) else qkv
        read = [a.name for a in kernel.args[1].fields if isinstance(a, relax.Var)]
        assert any(name.startswith(f"model_layers_{layer}_self_attn_qkv_proj") for name in read), read


@pytest.mark.parametrize("family,target,quant", [
    ("llama_gqa", "host", "q4f16_g32"),
    pytest.param("gemma3", "host", "q0f32", marks=pytest.mark.extended)])
def test_bit_identical_to_the_unchained_build(tmp_path, monkeypatch, checkpoints, family, target, quant):
    """Prefill logits (29 tokens: more than one tile of rows of the prefill GEMMs) and 32 greedy decode steps' logits
    equal to the last bit with and without the step."""

    def run(out: Path):
        compile_model(CompileOptions(str(checkpoints[family]), target, quant, str(out), context_window=64))
        session = Session(load_artifact(out))
        logits = [session.prefill(list(range(1, 30)))]
        for _ in range(32):
            logits.append(session.decode(int(np.argmax(logits[-1]))))
        return np.stack([np.asarray(x).reshape(-1) for x in logits])

    chained = run(tmp_path / "chained")
    monkeypatch.setattr(pipeline, "ChainKernels", lambda: tvm.transform.Sequential([]))
    unchained = run(tmp_path / "unchained")
    kernels = [load_artifact(tmp_path / out).config["call_sites"]["kernels"] for out in ("chained", "unchained")]
    assert [any(k.endswith("_chained") for k in names) for names in kernels] == [True, False]
    assert np.array_equal(chained, unchained)
