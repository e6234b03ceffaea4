"""dlight schedule rules for LLM kernels on CPUs (decode GEMV, prefill matmul, norms, elementwise).

Apply after LegalizeOps/FuseOps/FuseTIR, inside ``with target:``:
``tvm.s_tir.dlight.ApplyDefaultSchedule(*rules(isa))``, `isa` the target's instruction set (compiler/target/isa.py).
Weights are expected as W[N, K] row-major (FuseTransposeMatmul produces that), so every matmul reduces along a
contiguous axis.
"""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import SBlockInfo, collect_vars_used_in_prim_expr, normalize_prim_func
from tvm.s_tir.dlight.analysis.gemv import get_reduction_expr
from tvm.s_tir.dlight.base import get_extent, try_inline, try_inline_contiguous_spatial
from tvm.s_tir.dlight.cpu import Reduction
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from ..kernels import nt_matmul_access, prefill_gemm
from ..target.isa import CpuIsa


def _write_bits(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int:
    return sch.get(block).writes[0].source.dtype.bits


def _divisor_tile(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, tile: int) -> int:
    """A tile that divides N: a ragged split adds a predicate, which keeps the accumulators out of registers."""
    return math.gcd(get_extent(sch, loop), tile)


def _match_nt_matmul(sch: s_tir.Schedule, keep_weight_producer: bool):
    """Inline prologue/epilogue chains; return (main, epilogue or None, producer or None) if the func is
    out[.., n] = sum_k a[.., k] * b[n, k]. With `keep_weight_producer`, the injective block right before the
    matmul (a dequantize) stays a block of its own when the matmul reads its output as the weight."""
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    producer = None
    n_pre = next((i for i, info in enumerate(infos) if not info.is_injective()), len(infos))
    if keep_weight_producer and 1 <= n_pre < len(infos):
        producer, pre = infos[n_pre - 1], infos[: n_pre - 1]
        if try_inline(sch, pre):
            return None
        infos = infos[n_pre:]
    infos = try_inline_contiguous_spatial(sch, infos)
    if not infos or not 1 <= len(infos) <= 2 or infos[0].is_injective():
        return None
    main, epilogue = infos[0], (infos[1] if len(infos) == 2 else None)
    if main.dom_kind()[-1:] != "R" or "R" in main.dom_kind()[:-1] or len(main.iters) < 2:
        return None
    if epilogue is not None and not epilogue.is_injective():
        return None
    block = sch.get(main.block_rv)
    if get_reduction_expr(block) is None or len(block.writes) != 1:
        return None
    ivars = [iv.var for iv in block.iter_vars]
    *lead, n, k = ivars
    # normalize_prim_func drops unit iters, so the output may carry constant indices.
    out_idx = [r.min for r in block.writes[0].region if not isinstance(r.min, tirx.IntImm)]
    if len(out_idx) != len(lead) + 1 or not all(a.same_as(b) for a, b in zip(out_idx, lead + [n])):
        return None
    # Every operand must be contiguous along k (k only in its last index), so loads along k vectorize.
    kinds, weights = set(), []
    for read in block.reads:
        used = [collect_vars_used_in_prim_expr(r.min) for r in read.region]
        if not used or k not in used[-1] or any(k in u for u in used[:-1]):
            return None
        flat = set().union(*used)
        if n in flat and flat & set(lead):
            return None
        kinds.add("weight" if n in flat else "act")
        if n in flat:
            weights.append(read.source)
    if kinds != {"weight", "act"}:
        return None
    if producer is not None:
        written = sch.get(producer.block_rv).writes[0].source
        if not any(w.same_as(written) for w in weights):
            return None
    return main, epilogue, producer


def _k_divisors(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> set[int]:
    """The constants c of every k // c and k % c in the block body (k: the innermost iter): a dequantize of
    packed weights reads word k // (32/bits), shift k % (32/bits) and scale k // group."""
    k = sch.get(block).iter_vars[-1].var
    found = set()

    def visit(node):
        if isinstance(node.b, tirx.IntImm) and k in collect_vars_used_in_prim_expr(node.a):
            found.add(int(node.b.value))

    tvm_ffi.structural_walk(sch.get(block).body, ((tirx.FloorDiv, tirx.FloorMod), visit))
    return found


def _divisor_lanes(lanes: int, k_ext, divisors: set[int]) -> int:
    """The widest power-of-two share of `lanes` that divides K and every divisor: then all lanes of a vector
    read one packed word and one scale (broadcasts, not per-lane gathers). 0 for a dynamic K."""
    if not isinstance(k_ext, int):
        return 0
    while lanes > 1 and any(d % lanes for d in (k_ext, *divisors)):
        lanes //= 2
    return lanes


def _rfactor_k(sch: s_tir.Schedule, main: SBlockInfo, chunk: int) -> s_tir.schedule.SBlockRV:
    """Split k by `chunk` and rfactor the inner part: the new block accumulates rf[..., n, kc]
    (contiguous in kc, so it vectorizes) under the original loops; the main block then sums over kc."""
    k = main.iters[-1].loop_rv
    _, ki = sch.split(k, [None, chunk])
    rf = sch.rfactor(ki, factor_axis=len(sch.get(main.block_rv).writes[0].region))
    # A small stack buffer once compacted to its tile: LLVM can keep the partial sums in registers.
    sch.set_scope(rf, 0, "local")
    return rf


class _VectorRule(CPUScheduleRule):
    """A rule that vectorizes for the instruction set `isa` of the target it is applied under (the widest vector
    register: LLVM's own vector width reports 512 bits for AVX2 CPUs too)."""

    def __init__(self, isa: CpuIsa):
        self.isa = isa


class _NTMatmulRule(_VectorRule):
    """Shared matching; subclasses schedule the decode (M == 1) and prefill (M > 1 or dynamic) cases."""

    def _match(self, func: tirx.PrimFunc):
        """(schedule, main, epilogue, producer) when `func` is an NT matmul of this rule's kind (M == 1 or not)."""
        # Prefill first tries to keep a weight producer (a dequantize) as a block of its own, else inlines it as
        # decode does (a producer of the activation, say).
        for keep in (False,) if self.for_gemv else (True, False):
            sch = s_tir.Schedule(func)
            matched = _match_nt_matmul(sch, keep_weight_producer=keep)
            if matched is not None:
                break
        if matched is None:
            return None
        main, epilogue, producer = matched
        m_ext = [get_extent(sch, it.loop_rv) for it in main.iters[:-2]]
        is_gemv = all(isinstance(e, int) and e == 1 for e in m_ext)
        if is_gemv != self.for_gemv:
            return None
        return sch, main, epilogue, producer

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        matched = self._match(func)
        if matched is None:
            return None
        sch, main, epilogue, producer = matched
        # Vector width along k: the widest power-of-two share of the target's width that divides K and, for
        # packed weights, the codes per word and the group, so all lanes read one word and one scale.
        k_ext, lanes = get_extent(sch, main.iters[-1].loop_rv), self.isa.lanes(_write_bits(sch, main.block_rv))
        divisors = _k_divisors(sch, main.block_rv)
        lanes = _divisor_lanes(lanes, k_ext, divisors)
        if lanes < 2:
            return None
        self.schedule(sch, main, epilogue, producer, lanes, k_ext, bool(divisors))
        return sch


class DecodeGEMV(_NTMatmulRule):
    """y[n] = sum_k x[k] * W[n, k]: a vector of partial sums along the contiguous k axis per row, threads over rows.

    Each row is read front to back, so the weights stream as one sequence the hardware prefetcher follows.
    Packed weights (an inlined dequantize) cost several instructions per vector: a row takes `packed_vectors`
    vectors of k per step, independent accumulators that hide the FMA latency. Interleaving 4 rows per step
    (which wins when the weights sit in cache) made 4 short streams per row block that the prefetcher did not
    follow: in SmolLM2's decode, weights coming from DRAM, the int8 lm_head took 8.6 ms instead of 3.7 ms and
    a whole q4f16_g32 step 25.7 ms instead of 19.6 ms."""

    for_gemv = True
    rows_per_task = 16  # one row streams at ~85% of DRAM bandwidth for float weights
    packed_vectors = 2  # SmolLM2 q4f16_g32 decode step: 27.4 ms with 1, 19.6 ms with 2; 4 made gate_up 30% slower

    def schedule(self, sch: s_tir.Schedule, main: SBlockInfo, epilogue: SBlockInfo | None,
                 _producer: SBlockInfo | None, lanes: int, k_ext: int, packed: bool):
        vectors = self.packed_vectors if packed else 1
        while k_ext % (lanes * vectors):
            vectors //= 2
        rf = _rfactor_k(sch, main, lanes * vectors)
        n, ko, kc = sch.get_loops(rf)
        no, row_loop = sch.split(n, [None, _divisor_tile(sch, n, self.rows_per_task)])
        sch.parallel(no)
        kv, ki = sch.split(kc, [None, lanes])
        sch.unroll(kv)
        sch.vectorize(ki)
        sch.vectorize(sch.get_loops(sch.decompose_reduction(rf, ko))[-1])
        # The horizontal sums of the rows' vectors, then the fused epilogue, stay inside the thread's task.
        sch.reverse_compute_at(main.block_rv, row_loop)
        if epilogue is not None:
            sch.reverse_compute_at(epilogue.block_rv, no)


class PrefillMatmul(_NTMatmulRule):
    """Y[m, n] = sum_k X[m, k] * W[n, k] for any (dynamic) m.

    On x86 CPUs with FMA and AVX-512 or AVX2 the kernel is replaced by an outer-product GEMM over the same
    parameters (compiler/kernels/prefill_gemm.py), its tiles from the instruction set (prefill_gemm.tile_shape):
    AVX-512 register tiles of 12 columns of W x 32 rows of X, AVX2 6 x 16 (or 4 x 24), each task dequantizing its
    tile of W once. SmolLM2 128-token prefill matmuls ran 2.3-2.6x faster than the schedule below with AVX-512;
    with AVX2 on Zen 3 down_proj 1.8x, the others ~1.1x, the whole prefill 188 -> ~250 tok/s at one thread. Its
    tile shares one task-local buffer with its operands: the Relax build's codegen marks every buffer as possibly
    aliasing every other (TVM's LLVM codegen takes tirx.noalias from the last kernel of the module, and those of
    the KV cache lack it), and a tile in a buffer of its own would be stored back at every FMA.

    Other kernels (other CPUs, several row axes, N that no NR of the TileShape divides) keep this schedule:
    per row of X, a register tile of `tile_n` k-vectors (rfactor along k), the dequantized W tile reused across
    rows. m is not tiled: a split of a dynamic m needs a predicate, which stops the partial sums from being
    compacted to a register-sized buffer (measured: 2x slower).
    """

    for_gemv = False
    tile_n = 8
    outer_product = True  # False: always this schedule (tests' negative controls)

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        gemm = self._outer_product_gemm(func)
        return gemm if gemm is not None else super().apply(func, target, tunable)

    def _outer_product_gemm(self, func: tirx.PrimFunc) -> s_tir.Schedule | None:
        """The kernel replaced by prefill_gemm's (a new PrimFunc with the same parameters), or None: this rule only
        chooses it and its tiles; kernels/ builds it."""
        shape = prefill_gemm.tile_shape(self.isa) if self.outer_product else None
        if shape is None:
            return None
        matched = self._match(func)
        if matched is None:
            return None
        sch, main, epilogue, producer = matched
        access = nt_matmul_access.read(sch.mod["main"], sch.get(main.block_rv),
                                       None if epilogue is None else sch.get(epilogue.block_rv),
                                       None if producer is None else sch.get(producer.block_rv))
        if access is None:
            return None
        # The weight tile's dequantize (or copy) along k: all lanes of a vector in one packed word and group.
        divisors = _k_divisors(sch, (producer or main).block_rv)
        tiles = shape.tiles(access.n, w_lanes=max(_divisor_lanes(shape.lanes, access.k, divisors), 1))
        if tiles is None:
            return None
        return s_tir.Schedule(prefill_gemm.replace_kernel(sch.mod["main"], access, tiles))

    def schedule(self, sch: s_tir.Schedule, main: SBlockInfo, epilogue: SBlockInfo | None,
                 producer: SBlockInfo | None, lanes: int, k_ext: int, _packed: bool):
        self._row_tiles(sch, main, epilogue, producer, lanes, k_ext)

    def _row_tiles(self, sch: s_tir.Schedule, main: SBlockInfo, epilogue: SBlockInfo | None,
                   producer: SBlockInfo | None, lanes: int, k_ext: int) -> None:
        rf = _rfactor_k(sch, main, lanes)
        *lead, n, ko, ki = sch.get_loops(rf)
        m = sch.fuse(*lead) if len(lead) > 1 else lead[0]
        no, ni = sch.split(n, [None, _divisor_tile(sch, n, self.tile_n)])
        # Threads split the rows of W; a thread keeps its W tile in L1 while it walks all rows of X.
        sch.reorder(no, m, ko, ni, ki)
        sch.parallel(no)
        sch.unroll(ni)
        sch.vectorize(ki)
        sch.vectorize(sch.get_loops(sch.decompose_reduction(rf, ko))[-1])
        sch.reverse_compute_at(main.block_rv, m)
        if epilogue is not None:
            sch.reverse_compute_at(epilogue.block_rv, m)
        if producer is not None:
            # Dequantize the thread's W tile once, into a buffer local to the task, before it walks the rows of
            # X; inlined, every row of X would dequantize the whole weight again.
            sch.compute_at(producer.block_rv, no)
            sch.set_scope(producer.block_rv, 0, "local")
            p_lanes = _divisor_lanes(lanes, k_ext, _k_divisors(sch, producer.block_rv))
            if p_lanes >= 2:
                sch.vectorize(sch.split(sch.get_loops(producer.block_rv)[-1], [None, p_lanes])[1])


class RowReduction(Reduction):
    """Stock cpu.Reduction (rows over threads, vectorized elementwise parts) for rms_norm/softmax-like kernels,
    only when the reductions have a row axis. With a single row (decode) normalize_prim_func drops the unit
    axis, the stock rule then threads over the hidden axis and recomputes the whole reduction per element
    (measured 0.3 ms per 576-wide rms_norm, 20 ms per token); such a tiny kernel is best left serial."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        infos = normalize_prim_func(s_tir.Schedule(func))
        if infos is None or any(_single_row(b) for b in infos if not b.is_injective()):
            return None
        return super().apply(func, target, tunable)


def _single_row(info: SBlockInfo) -> bool:
    kinds = info.dom_kind()
    rows = info.dom()[: len(kinds) - len(kinds.lstrip("S"))]
    return all(isinstance(d, int) and d == 1 for d in rows)


class Elementwise(_VectorRule):
    """Injective kernels (activations, residual adds, reshapes, take, rope): vectorize the innermost axis
    and, when the kernel is big enough to repay a parallel launch (~us), spread the rest over threads."""

    min_parallel_elems = 1 << 14

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline(sch, infos)
        if len(infos) != 1 or not infos[0].is_injective():
            return None
        block = infos[0].block_rv
        loops = list(sch.get_loops(block))
        if not loops:
            return None
        extents = [get_extent(sch, loop) for loop in loops]
        lanes = self.isa.lanes(_write_bits(sch, block))
        inner = extents[-1]
        outer = loops[:-1]
        if isinstance(inner, int) and inner > lanes and inner % lanes == 0:
            rest, vec = sch.split(loops[-1], [None, lanes])
            sch.vectorize(vec)
            outer.append(rest)
        elif isinstance(inner, int) and 2 <= inner <= lanes:
            sch.vectorize(loops[-1])
        else:
            outer.append(loops[-1])
        dynamic = any(not isinstance(e, int) for e in extents)
        if outer and (dynamic or math.prod(extents) >= self.min_parallel_elems):
            sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        return sch


def rules(isa: CpuIsa | None) -> list:
    """The CPU rules for instruction set `isa` in the order ApplyDefaultSchedule should try them; the first that
    applies wins. None (a target that is not an LLVM CPU: Hexagon): none of them applies."""
    return [DecodeGEMV(isa), PrefillMatmul(isa), RowReduction(), Elementwise(isa)]
