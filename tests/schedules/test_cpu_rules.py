"""CPU dlight rules: each applies to its kernel (and only to it), and the scheduled kernels match numpy."""

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.backend.cpu_generic import pipeline as cp
from tvm.s_tir import dlight as dl
from tvm.script import tirx as T

from compiler.kernels import prefill_gemm
from compiler.passes.fuse_transpose_matmul import FuseTransposeMatmul
from compiler.quantization import dequantize_te, group
from compiler.schedules import cpu
from compiler.target.host import host_features
from compiler.target.isa import cpu_isa, missing_features

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
ISA = cpu_isa(TARGET)
K, N = 64, 48
# PrefillMatmul's GEMM (compiler/kernels/prefill_gemm.py) takes x86 CPUs with FMA and AVX-512 or AVX2, its tiles
# from the instruction set; TARGET, a generic x86-64 (SSE2, no FMA), gets the row tiles. Each GEMM variant runs
# (numerics against numpy) where this machine has its features; the others are compiled and their assembly checked.
AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "x86-64-v4", "num-cores": 2})
AVX2 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "x86-64-v3", "num-cores": 2})
GEMM_TARGETS = {"avx512": AVX512, "avx2": AVX2}
gemm_variants = pytest.mark.parametrize("variant", list(GEMM_TARGETS))


def _missing_on_host(target) -> list[str]:
    """The features `target`'s code needs that this machine lacks (code for it would die with SIGILL here)."""
    return missing_features(cpu_isa(target).required_features, host_features())


def _skip_unless_host_runs(variant):
    missing = _missing_on_host(GEMM_TARGETS[variant])
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {variant} GEMM is compiled and its assembly checked "
                    "in test_prefill_gemm_assembly, not run")


def _fused_kernel(build_body, *var_types):
    """Legalize + fuse a one-kernel Relax function; return the fused PrimFunc."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"p{i}", relax.TensorType(shape, dtype)) for i, (shape, dtype) in enumerate(var_types)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build_body(*params))
        bb.emit_func_output(out)
    with TARGET:
        mod = tvm.transform.Sequential([FuseTransposeMatmul()] + cp.legalize_passes(TARGET))(bb.get())
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def _linear_residual(m):
    """out = x @ w.T + r: the o_proj/down_proj kernel with its fused residual add."""
    return _fused_kernel(
        lambda x, w, r: relax.op.add(relax.op.matmul(x, relax.op.permute_dims(w)), r),
        ([1, m, K], "float32"), ([N, K], "float32"), ([1, m, N], "float32"),
    )


def _seq():
    return tirx.Var("seq_len", "int64")


def _schedule(func):
    with TARGET:
        mod = dl.ApplyDefaultSchedule(*cpu.rules(ISA))(tvm.IRModule({"main": func}))
    return mod["main"]


def _run(func, *arrays, out_shape, target=TARGET):
    lib = tvm.tirx.build(func.with_attr("global_symbol", "main"), target=target)
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"))
    lib["main"](*[tvm.runtime.tensor(a) for a in arrays], out)
    return out.numpy()


def _assert_parallel_and_vectorized(func):
    assert func.attrs["tirx.is_scheduled"]
    text = func.script()
    assert "T.parallel(" in text and "T.vectorized(" in text


def test_decode_gemv_with_residual_epilogue():
    func = _linear_residual(1)
    assert cpu.DecodeGEMV(ISA).apply(func, TARGET, False) is not None
    assert cpu.PrefillMatmul(ISA).apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    rng = np.random.default_rng(0)
    x, w, r = (rng.standard_normal(s, dtype="float32") for s in ((1, 1, K), (N, K), (1, 1, N)))
    np.testing.assert_allclose(_run(scheduled, x, w, r, out_shape=(1, 1, N)), x @ w.T + r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 7, 33])
def test_prefill_matmul_dynamic_m_with_residual_epilogue(m):
    func = _linear_residual(_seq())
    assert cpu.PrefillMatmul(ISA).apply(func, TARGET, False) is not None
    assert cpu.DecodeGEMV(ISA).apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    rng = np.random.default_rng(m)
    x, w, r = (rng.standard_normal(s, dtype="float32") for s in ((1, m, K), (N, K), (1, m, N)))
    np.testing.assert_allclose(_run(scheduled, x, w, r, out_shape=(1, m, N)), x @ w.T + r, rtol=1e-4, atol=1e-4)


def test_matmul_rules_reject_non_nt_layout():
    """x @ w with w [K, N]: the reduction axis of w is strided, which these rules do not handle."""
    func = _fused_kernel(lambda x, w: relax.op.matmul(x, w), ([1, 1, K], "float32"), ([K, N], "float32"))
    assert cpu.DecodeGEMV(ISA).apply(func, TARGET, False) is None
    assert cpu.PrefillMatmul(ISA).apply(func, TARGET, False) is None


def test_elementwise_silu_mul_dynamic_seq():
    def body(x):
        gate, up = relax.op.split(x, 2, axis=-1)[0], relax.op.split(x, 2, axis=-1)[1]
        return relax.op.multiply(relax.op.nn.silu(gate), up)

    func = _fused_kernel(body, ([1, _seq(), 2 * K], "float32"))
    for rule in (cpu.DecodeGEMV(ISA), cpu.PrefillMatmul(ISA)):
        assert rule.apply(func, TARGET, False) is None
    assert cpu.Elementwise(ISA).apply(func, TARGET, False) is not None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    x = np.random.default_rng(3).standard_normal((1, 5, 2 * K), dtype="float32")
    gate, up = x[..., :K], x[..., K:]
    np.testing.assert_allclose(_run(scheduled, x, out_shape=(1, 5, K)), gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-5)


def test_rms_norm_gets_a_parallel_schedule():
    func = _fused_kernel(
        lambda x, g: relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5),
        ([1, _seq(), K], "float32"), ([K], "float32"),
    )
    for rule in (cpu.DecodeGEMV(ISA), cpu.PrefillMatmul(ISA), cpu.Elementwise(ISA)):
        assert rule.apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    rng = np.random.default_rng(4)
    x, g = rng.standard_normal((1, 6, K), dtype="float32"), rng.standard_normal(K, dtype="float32")
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(_run(scheduled, x, g, out_shape=(1, 6, K)), ref, rtol=1e-4, atol=1e-4)


def test_small_static_elementwise_stays_single_threaded():
    """A decode-sized kernel is cheaper than a parallel launch: vectorized, not parallel."""
    func = _fused_kernel(lambda a, b: relax.op.add(a, b), ([1, 1, K], "float32"), ([1, 1, K], "float32"))
    text = _schedule(func).script()
    assert "T.vectorized(" in text and "T.parallel(" not in text


def test_decode_gemv_inlines_a_dequantize_prologue():
    """Room for quantized weights: an injective producer of W (here int8 * per-group scale) is inlined."""
    group = 16
    x = tvm.te.placeholder((1, 1, K), "float32", name="x")
    wq = tvm.te.placeholder((N, K), "int8", name="wq")
    scale = tvm.te.placeholder((N, K // group), "float32", name="scale")
    w = tvm.te.compute((N, K), lambda n, k: wq[n, k].astype("float32") * scale[n, k // group], name="dequantize")
    k = tvm.te.reduce_axis((0, K), name="k")
    y = tvm.te.compute((1, 1, N), lambda b, s, n: tvm.te.sum(x[b, s, k] * w[n, k], axis=k), name="NT_matmul")
    func = tvm.te.create_prim_func([x, wq, scale, y])
    assert cpu.DecodeGEMV(ISA).apply(func, TARGET, False) is not None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    assert 'T.sblock("dequantize")' not in scheduled.script()
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((1, 1, K), dtype="float32")
    qs = rng.integers(-8, 8, (N, K), dtype="int8")
    ss = rng.random((N, K // group), dtype="float32")
    ref = xs @ (qs.astype("float32") * np.repeat(ss, group, axis=1)).T
    np.testing.assert_allclose(_run(scheduled, xs, qs, ss, out_shape=(1, 1, N)), ref, rtol=1e-4, atol=1e-4)


def test_single_row_rms_norm_is_not_threaded_over_hidden():
    """Decode's rms_norm has one row: threading over the hidden axis would redo the reduction per element."""
    func = _fused_kernel(
        lambda x, g: relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5), ([1, 1, K], "float32"), ([K], "float32")
    )
    assert cpu.RowReduction().apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    assert "T.parallel(" not in scheduled.script()
    rng = np.random.default_rng(6)
    x, g = rng.standard_normal((1, 1, K), dtype="float32"), rng.standard_normal(K, dtype="float32")
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(_run(scheduled, x, g, out_shape=(1, 1, K)), ref, rtol=1e-4, atol=1e-4)


# Packed (quantized) weights: the kernels FuseDequantizeMatmul produces, a `dequantize` block over uint8 codes
# and per-group scales (and mins), then the NT matmul, optionally a residual add.
SYM4_G32 = group.GroupLayout(bits=4, group=32, symmetric=True, scale_dtype="float16")
ASYM4_G32 = group.GroupLayout(bits=4, group=32, symmetric=False, scale_dtype="float16")
SYM4_G128 = group.GroupLayout(bits=4, group=128, symmetric=True, scale_dtype="float16")
SYM8_G32_F32 = group.GroupLayout(bits=8, group=32, symmetric=True, scale_dtype="float32")
ASYM8_G32 = group.GroupLayout(bits=8, group=32, symmetric=False, scale_dtype="float16")
PACKED_CASES = [  # (layout, K, residual epilogue); K=192 with group 128 ends in a 64-value group
    (SYM4_G32, 64, False), (ASYM4_G32, 64, True), (SYM4_G128, 192, True), (SYM8_G32_F32, 96, False),
    (ASYM8_G32, 96, True),
]
PACKED_IDS = ["int4-sym-g32", "int4-asym-g32-residual", "int4-sym-g128-partial-residual", "int8-sym-g32-f32",
              "int8-asym-g32-residual"]


def _packed_linear(layout, k, m, residual, n=N):
    """y = x @ dequantize(q).T (+ r), as te.create_prim_func lays out the fused dequantize + NT_matmul kernel."""
    x = tvm.te.placeholder((1, m, k), "float32", name="x")
    stored = [tvm.te.placeholder(shape, dtype, name=name) for name, (shape, dtype) in layout.shapes(n, k).items()]
    w = dequantize_te.dequantize_te(layout, k, "float32")(*stored)
    kr = tvm.te.reduce_axis((0, k), name="k")
    y = tvm.te.compute((1, m, n), lambda b, s, j: tvm.te.sum(x[b, s, kr] * w[j, kr], axis=kr), name="NT_matmul")
    tensors = [x, *stored]
    if residual:
        r = tvm.te.placeholder((1, m, n), "float32", name="r")
        y = tvm.te.compute((1, m, n), lambda b, s, j: y[b, s, j] + r[b, s, j], name="T_add")
        tensors.append(r)
    return tvm.te.create_prim_func([*tensors, y])


def _packed_inputs(layout, k, m, residual, seed):
    rng = np.random.default_rng(seed)
    arrays = group.quantize(rng.standard_normal((N, k), dtype="float32"), layout)
    x = rng.standard_normal((1, m, k), dtype="float32")
    args = [x, *(arrays[name] for name in layout.shapes(N, k))]
    ref = x @ group.dequantize(arrays, layout, k).T
    if residual:
        r = rng.standard_normal((1, m, N), dtype="float32")
        args.append(r)
        ref = ref + r
    return args, ref


def _vector_loads(func):
    """{buffer name: index types of its loads} once blocks are lowered and loops vectorized, as codegen sees them.
    A vector index that is not a stride-1 ramp is a per-lane gather."""
    st, tt = s_tir.transform, tirx.transform
    lower = tvm.transform.Sequential([
        st.LowerInitBlock(), st.PlanAndUpdateBufferAllocationLocation(), st.ConvertBlocksToOpaque(),
        st.CompactBufferAllocation(), st.StmtSimplify(), st.LowerOpaqueBlock(), tt.FlattenBuffer(),
        tt.VectorizeLoop(), tt.StmtSimplify(),
    ])
    loads = []
    tvm_ffi.structural_walk(lower(tvm.IRModule({"main": func}))["main"].body, (tvm.ir.expr.TensorLoad, loads.append))
    found = {}
    for load in loads:
        index = load.indices[-1]
        ramp = isinstance(index, tirx.Ramp) and isinstance(index.stride, tirx.IntImm) and index.stride.value == 1
        found.setdefault(load.source.name, set()).add("ramp" if ramp else "scalar" if "x" not in str(index.ty) else "gather")
    return found


def _assert_contiguous_codes_broadcast_scales(func, layout, x_loads=("ramp",)):
    """A vector's codes are one contiguous load (no per-lane gather), every lane reads the same scale (and min);
    x is read in vectors along k (decode), and in prefill also element by element (its transposed copy)."""
    loads = _vector_loads(func)
    for name in layout.shapes(N, 1):
        assert loads[name] == ({"ramp"} if name == "q_weight" else {"scalar"}), (name, loads)
    assert loads["x"] == set(x_loads), loads


@pytest.mark.parametrize(("layout", "k", "residual"), PACKED_CASES, ids=PACKED_IDS)
def test_decode_gemv_on_packed_weights(layout, k, residual):
    func = _packed_linear(layout, k, 1, residual)
    assert cpu.DecodeGEMV(ISA).apply(func, TARGET, False) is not None
    assert cpu.PrefillMatmul(ISA).apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    assert 'T.sblock("dequantize")' not in scheduled.script()
    _assert_contiguous_codes_broadcast_scales(scheduled, layout)
    args, ref = _packed_inputs(layout, k, 1, residual, seed=7)
    np.testing.assert_allclose(_run(scheduled, *args, out_shape=(1, 1, N)), ref, rtol=1e-4, atol=1e-4)


def test_gather_check_catches_a_vector_spanning_both_nibbles():
    """Negative control for the check above: 32 lanes over int4 codes read each byte twice, a per-lane gather."""
    func = _packed_linear(SYM4_G32, 64, 1, False)
    sch = s_tir.Schedule(func)
    sch.compute_inline(sch.get_sblock("dequantize"))
    *_, k = sch.get_loops(sch.get_sblock("NT_matmul"))
    rf = sch.rfactor(sch.split(k, [None, 32])[1], factor_axis=3)
    *_, ko, ki = sch.get_loops(rf)
    sch.vectorize(ki)
    sch.decompose_reduction(rf, ko)
    assert "gather" in _vector_loads(sch.mod["main"])["q_weight"]


def _count_loads(node, buffer_name) -> int:
    loads = []
    tvm_ffi.structural_walk(node, (tvm.ir.expr.TensorLoad, loads.append))
    return sum(load.source.name == buffer_name for load in loads)


def _loops(func) -> list:
    loops = []
    tvm_ffi.structural_walk(func.body, (tirx.For, loops.append))
    return loops


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize(("layout", "k", "residual"), PACKED_CASES, ids=PACKED_IDS)
def test_prefill_matmul_dequantizes_each_weight_tile_once(layout, k, residual, m):
    """The row-tile schedule (CPUs without AVX-512; the GEMM's case is below)."""
    func = _packed_linear(layout, k, _seq(), residual)
    assert cpu.PrefillMatmul(ISA).apply(func, TARGET, False) is not None
    assert cpu.DecodeGEMV(ISA).apply(func, TARGET, False) is None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    # The dequantize stays a block, in task-local memory under the parallel tile loop and outside the loop
    # over rows of X (no dynamic extent among its loops), its codes loaded contiguously and scales broadcast.
    sch = s_tir.Schedule(scheduled)
    dequantize = sch.get_sblock("dequantize")
    loops = sch.get_loops(dequantize)
    assert sch.get(loops[0]).kind == tirx.ForKind.PARALLEL
    assert all(isinstance(sch.get(loop).extent, tirx.IntImm) for loop in loops)
    assert sch.get(dequantize).writes[0].source.scope() == "local"
    _assert_contiguous_codes_broadcast_scales(scheduled, layout)
    args, ref = _packed_inputs(layout, k, m, residual, seed=m)
    np.testing.assert_allclose(_run(scheduled, *args, out_shape=(1, m, N)), ref, rtol=1e-4, atol=1e-4)


@gemm_variants
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize(("layout", "k", "residual"), PACKED_CASES, ids=PACKED_IDS)
def test_prefill_gemm_dequantizes_each_weight_tile_once(layout, k, residual, m, variant):
    target = GEMM_TARGETS[variant]
    func = _packed_linear(layout, k, _seq(), residual)
    assert cpu.PrefillMatmul(cpu_isa(target)).apply(func, target, False) is not None
    assert cpu.DecodeGEMV(cpu_isa(target)).apply(func, target, False) is None
    scheduled = _gemm_schedule(func, target)
    assert "_rf" not in scheduled.script()  # the GEMM, not the row tiles (an rfactor along k)
    _assert_parallel_and_vectorized(scheduled)
    # The codes are read once per weight tile: under the parallel loop over tiles, outside every loop over rows
    # of X (no dynamic extent around them), contiguously, with the scales broadcast.
    total = _count_loads(scheduled.body, "q_weight")
    loops = _loops(scheduled)
    assert total and sum(_count_loads(lp.body, "q_weight") for lp in loops if lp.kind == tirx.ForKind.PARALLEL) == total
    assert not any(_count_loads(lp.body, "q_weight") for lp in loops if not isinstance(lp.extent, tirx.IntImm))
    _assert_contiguous_codes_broadcast_scales(scheduled, layout, x_loads=("scalar", "ramp"))
    _skip_unless_host_runs(variant)
    args, ref = _packed_inputs(layout, k, m, residual, seed=m)
    np.testing.assert_allclose(_run(scheduled, *args, out_shape=(1, m, N), target=target), ref, rtol=1e-4, atol=1e-4)


def test_prefill_inlines_a_producer_of_the_activation():
    """Negative control: only the weight's producer is hoisted to the tile loop; one of x (a scale of the
    activation) is inlined into the matmul, as before."""
    x = tvm.te.placeholder((1, _seq(), K), "float32", name="x")
    w = tvm.te.placeholder((N, K), "float32", name="w")
    xs = tvm.te.compute(x.shape, lambda b, s, k: x[b, s, k] * tirx.const(0.5, "float32"), name="T_multiply")
    kr = tvm.te.reduce_axis((0, K), name="k")
    y = tvm.te.compute((1, x.shape[1], N), lambda b, s, n: tvm.te.sum(xs[b, s, kr] * w[n, kr], axis=kr), name="NT_matmul")
    func = tvm.te.create_prim_func([x, w, y])
    assert cpu.PrefillMatmul(ISA).apply(func, TARGET, False) is not None
    scheduled = _schedule(func)
    _assert_parallel_and_vectorized(scheduled)
    assert "T_multiply" not in scheduled.script()
    rng = np.random.default_rng(8)
    x, w = rng.standard_normal((1, 5, K), dtype="float32"), rng.standard_normal((N, K), dtype="float32")
    np.testing.assert_allclose(_run(scheduled, x, w, out_shape=(1, 5, N)), 0.5 * x @ w.T, rtol=1e-4, atol=1e-4)



def _gemm_linear(m, k, n, residual):
    body = (lambda x, w, r: relax.op.add(relax.op.matmul(x, relax.op.permute_dims(w)), r)) if residual else \
        (lambda x, w: relax.op.matmul(x, relax.op.permute_dims(w)))
    types = [([1, m, k], "float32"), ([n, k], "float32")] + ([([1, m, n], "float32")] if residual else [])
    return _fused_kernel(body, *types)


def _gemm_schedule(func, target):
    with target:
        return dl.ApplyDefaultSchedule(*cpu.rules(cpu_isa(target)))(tvm.IRModule({"main": func}))["main"]


def _gemm_inputs(m, k, n, residual, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((1, m, k), dtype="float32"), rng.standard_normal((n, k), dtype="float32")
    args, ref = [x, w], x @ w.T
    if residual:
        r = rng.standard_normal((1, m, n), dtype="float32")
        args, ref = [x, w, r], ref + r
    return args, ref


def _gemm_run(scheduled, target, args, out_shape):
    lib = tvm.tirx.build(scheduled.with_attr("global_symbol", "main"), target=target)
    out = tvm.runtime.tensor(np.full(out_shape, np.nan, "float32"))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()


def test_gemm_tile_shape_follows_the_instruction_set():
    """AVX-512: 16 lanes, 12 x 2 vectors (24 of 32 zmm registers); AVX2 + FMA: 8 lanes, 6 x 2 (12 of 16 ymm); no
    GEMM without FMA (generic x86-64, Sandy Bridge's AVX) nor on aarch64 (row tiles there). SmolLM2's N values
    (qkv 960, o/down 576, gate_up 3072, 1536) take NR 12 resp. 6; N = 2048 (a 1B Llama) the AVX2 4 x 3 tile."""
    assert prefill_gemm.tile_shape(cpu_isa(AVX512)) is prefill_gemm.AVX512_SHAPE
    assert prefill_gemm.tile_shape(cpu_isa(AVX2)) is prefill_gemm.AVX2_SHAPE
    for other in ({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "x86-64"},
                  {"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "sandybridge"},
                  {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]}):
        assert prefill_gemm.tile_shape(cpu_isa(tvm.target.Target(other))) is None, other
    assert prefill_gemm.tile_shape(ISA) is None
    for shape, lanes, nr in ((prefill_gemm.AVX512_SHAPE, 16, 12), (prefill_gemm.AVX2_SHAPE, 8, 6)):
        for n in (960, 576, 3072, 1536):
            tiles = shape.tiles(n, w_lanes=lanes)
            assert (tiles.lanes, tiles.nr, tiles.mv, tiles.tn) == (lanes, nr, 2, 96)
            registers = cpu_isa(AVX512 if lanes == 16 else AVX2).vector_registers
            assert tiles.nr * tiles.mv + tiles.mv + 1 <= registers  # accumulators, X vectors, one broadcast
    tiles = prefill_gemm.AVX2_SHAPE.tiles(2048, w_lanes=8)
    assert (tiles.nr, tiles.mv, tiles.mp, tiles.tn) == (4, 3, 24, 64)
    assert prefill_gemm.AVX2_SHAPE.tiles(7, w_lanes=1) is None  # no NR divides N: the row tiles


GEMM_CASES = [(96, 192, True), (40, 54, False), (64, 64, False), (36, 48, False)]
# AVX-512: NR 12 (two tasks), 6 (three tasks, K % 16 != 0: no dot-product rows), 8, 12 (K % 16 != 0); AVX2: NR 6
# (two tasks of 96 rows), 6 (one task), 4 x 3 (24-row panels), 6 (K % 8 != 0: a zero-padded last panel)
GEMM_IDS = ["k-96-n-192-residual", "k-40-n-54", "k-64-n-64", "k-36-padded-panel"]


@gemm_variants
@pytest.mark.parametrize("m", [1, 16, 31, 32, 70])
@pytest.mark.parametrize(("k", "n", "residual"), GEMM_CASES, ids=GEMM_IDS)
def test_prefill_gemm_register_tiles_and_row_tail(m, k, n, residual, variant):
    """Panels of MP rows of X (the last one partial, or dot products for the last rows), register tiles of every
    NR, one to three parallel tasks, an epilogue: every output element written, with the float sum numpy
    computes."""
    _skip_unless_host_runs(variant)
    target = GEMM_TARGETS[variant]
    scheduled = _gemm_schedule(_gemm_linear(_seq(), k, n, residual), target)
    assert "_rf" not in scheduled.script()  # the GEMM, not the row tiles (an rfactor along k)
    args, ref = _gemm_inputs(m, k, n, residual, seed=m + k)
    np.testing.assert_allclose(_gemm_run(scheduled, target, args, (1, m, n)), ref, rtol=1e-5, atol=1e-5)


@gemm_variants
def test_prefill_gemm_comparison_catches_a_perturbed_weight(variant):
    """Negative control for the numerics above: one weight changed after the reference was computed shows up in
    exactly its output column, in the panel rows and in the dot-product rows alike (m = 70: AVX-512 two panels of
    32 + 6 rows, AVX2 four of 16 + 6)."""
    _skip_unless_host_runs(variant)
    target = GEMM_TARGETS[variant]
    m, k, n = 70, 96, 192
    scheduled = _gemm_schedule(_gemm_linear(_seq(), k, n, True), target)
    args, ref = _gemm_inputs(m, k, n, True, seed=1)
    args[1][101, 37] += 0.5  # W[n = 101, k = 37]: the second task's tile
    out = _gemm_run(scheduled, target, args, (1, m, n))
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    wrong = ~np.isclose(out, ref, rtol=1e-5, atol=1e-5)
    assert sorted(set(np.nonzero(wrong)[2])) == [101] and wrong[0, :, 101].all()
    np.testing.assert_allclose(out[0, :, 101] - ref[0, :, 101], 0.5 * args[0][0, :, 37], rtol=1e-4, atol=1e-4)


def _asm_loops(asm: str) -> list[str]:
    """The single-block loops of `asm`: from a label to the jump back to it."""
    pattern = r"^(\.LBB\w+):\n(?:(?!\.LBB\w+:)[^\n]*\n)*?\s*j\w+\s+\1\n"
    return [match.group(0) for match in re.finditer(pattern, asm, re.MULTILINE)]


def _check_gemm_assembly(asm: str, variant: str) -> None:
    """AVX-512: the register tile's k loop does 24 zmm FMAs (12 x 2 vectors, unrolled: a multiple of 24) and no
    ymm ones; AVX2: 12 ymm FMAs (6 x 2) and no zmm register anywhere (code this CPU can run). Neither spills
    its tile: no vector store in the loop."""
    fma = r"vfmadd\w*ps\s+[^\n]*%{}\d+"
    wide, narrow, per_step = ("zmm", "ymm", 24) if variant == "avx512" else ("ymm", "zmm", 12)
    if variant == "avx2":
        assert "zmm" not in asm
    tiles = [lp for lp in _asm_loops(asm) if len(re.findall(fma.format(wide), lp)) >= per_step]
    assert tiles, f"no loop with {per_step} {wide} FMAs"
    for lp in tiles:
        count = len(re.findall(fma.format(wide), lp))
        assert count % per_step == 0 and not re.findall(fma.format(narrow), lp), (count, lp)
        assert not re.search(rf"vmov\w*\s+%{wide}\d+, [^\n]*\(", lp), lp  # a vector stored back: a spill


@gemm_variants
@pytest.mark.parametrize(("k", "n", "residual"), [(576, 960, False), (1536, 576, True)], ids=["qkv", "down-residual"])
def test_prefill_gemm_assembly(k, n, residual, variant):
    """Every variant compiles here and its assembly is checked, whether or not this CPU can run it: SmolLM2's qkv
    and down matmuls, float and int4 weights."""
    target = GEMM_TARGETS[variant]
    for func in (_gemm_linear(_seq(), k, n, residual), _packed_linear(SYM4_G32, k, _seq(), residual, n=n)):
        scheduled = _gemm_schedule(func, target)
        assert "_rf" not in scheduled.script()
        asm = tvm.tirx.build(scheduled.with_attr("global_symbol", "main"), target=target).inspect_source("asm")
        _check_gemm_assembly(asm, variant)
        # Negative control: the other variant's check rejects this code.
        with pytest.raises(AssertionError):
            _check_gemm_assembly(asm, "avx2" if variant == "avx512" else "avx512")


@T.prim_func(s_tir=True)
def _may_alias(h: T.Buffer((2,), "int64")):
    """A kernel without tirx.noalias, as the Relax build has (shape functions, the KV cache's attention)."""
    h[1] = h[0] * T.int64(2)


def _fma_loops_storing_vectors(func, target, with_aliasing_kernel: bool) -> list[int]:
    """(vector FMAs, vector stores) per loop of the compiled kernel (a basic block branching to itself) that does 8+
    vector FMAs."""
    funcs = {"main": func.with_attr("global_symbol", "main")}
    if with_aliasing_kernel:  # sorts last: TVM's LLVM codegen then tags every kernel's buffers as may-alias
        funcs["zzz_may_alias"] = _may_alias.with_attr("global_symbol", "zzz_may_alias")
    ll = tvm.tirx.build(tvm.IRModule(funcs), target=target).inspect_source("ll")
    lanes = cpu_isa(target).float_lanes
    loops = []
    for block in re.split(r"\n(?=[\w.$-]+:)", ll):
        label = block.split(":", 1)[0].strip()
        fmas = block.count(f"llvm.fmuladd.v{lanes}f32")
        if fmas >= 8 and re.search(rf"label %{re.escape(label)}\b", block):
            loops.append((fmas, block.count(f"store <{lanes} x float>")))
    return loops


@gemm_variants
def test_prefill_gemm_keeps_its_register_tile_when_other_kernels_may_alias(variant):
    """In the Relax build, the last kernel of the module lacks tirx.noalias, and TVM's LLVM codegen lets that flag
    decide for every kernel: all buffer accesses may alias. A tile kept in its own buffer is then stored back at
    every FMA (prefill ran at 1/3 of the speed); the GEMM's tile shares one buffer with its operands at constant
    offsets, which LLVM still tells apart. Negative control: the row-tile schedule's loop stores more then.
    (Compiled only: the LLVM IR is the same on any x86 host.)"""
    target = GEMM_TARGETS[variant]
    func = _gemm_linear(_seq(), 256, 192, True)
    gemm = _gemm_schedule(func, target)
    for aliasing in (False, True):
        loops = sorted(_fma_loops_storing_vectors(gemm, target, aliasing))
        if variant == "avx512":
            # the 12 x 32 tile's loop over k (24 FMAs a step) and the last rows' 4 x 4 dot products (16), no stores
            assert loops == [(16, 0), (24, 0)]
        else:
            # the 6 x 16 tile's loop over k (12 FMAs a step; LLVM unrolls the 4 blocks of 64 steps into 4 loops) and
            # the 4 x 3 dot products (12, unrolled twice), no stores
            assert loops[0] == (12, 0) and all(fmas % 12 == 0 and not stores for fmas, stores in loops), loops
    rules = cpu.rules(cpu_isa(target))
    rules[1].outer_product = False  # PrefillMatmul's row tiles
    with target:
        row_tiles = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({"main": func}))["main"]
    stores = [sum(n for _, n in _fma_loops_storing_vectors(row_tiles, target, aliasing)) for aliasing in (False, True)]
    assert stores[1] > stores[0]
