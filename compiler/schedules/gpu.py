"""dlight GPU rules with their tile parameters taken from the target file's [schedule.gemv] / [schedule.matmul].

dlight chooses parameters inside its rules by looking at the target: any OpenCL target whose host triple
contains "android" gets Adreno's settings, so an Android Mali target never reaches the Mali ones (the cause
of slow Mali prefill in MLC-LLM issue #2762). Here every GPU target states its own numbers, and the rules are
handed the target without its host so dlight's remaining device checks go by the device ("adreno"/"mali").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.schedule import _ffi_api as schedule_ffi
from tvm.s_tir.dlight.analysis import (SBlockInfo, collect_block_iter_vars_used_in_access_region,
                                       is_broadcast_epilogue, is_gemv, normalize, normalize_prim_func)
from tvm.s_tir.dlight.base import get_extent, try_inline_contiguous_spatial
from tvm.sym.analyzer import Analyzer
from tvm.target import Target

from ..passes.ir_walk import is_reduction, stmts_of, tir_statements
from ..quantization.group import NIBBLE_BLOCK
from . import code_loads

# Each section's fields and their types; compiler/target/targets.py validates target files against these.
PARAMETERS: dict[str, dict[str, type]] = {
    "gemv": {"ts": int, "tr": int, "vec": int, "unroll": int, "row_threads": str},
    "matmul": {
        "block_size_x": int, "block_size_y": int, "micro_size_x": int, "micro_size_y": int,
        "micro_size_k": int, "vector_size": int, "unroll": int, "use_shared": bool, "inner_x": bool,
    },
}
ROW_THREAD_TAGS = ("threadIdx.x", "threadIdx.y")


def _device_only(target: Target) -> Target:
    return Target({key: value for key, value in target.export().items() if key != "host"})


class Matmul(dlight.gpu.Matmul):
    """dlight's gpu.Matmul with the tile configuration from the target file."""

    def __init__(self, params: dict[str, Any] | dlight.gpu.Matmul.Config):
        self.config = params if isinstance(params, dlight.gpu.Matmul.Config) else dlight.gpu.Matmul.Config(**params)

    def get_configs(self, target: Target) -> dlight.gpu.Matmul.Config:
        return self.config

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        second_run = _second_run_stmts(func)
        if second_run:
            return self._with_second_run(func, target, tunable, second_run)
        epilogue = _group_norm_epilogue(func)
        if epilogue is not None:
            return self._with_group_norm(func, target, tunable, *epilogue)
        norm = _norm_prologue(func)
        if norm is not None:
            return self._with_norm(func, target, tunable, *norm)
        return self._matmul(func, target, tunable)

    def takes(self, func: tirx.PrimFunc, target: Target) -> bool:
        """Whether this rule schedules `func` (a kernel a pass only proposes: any failure means no)."""
        try:
            return self.apply(func, target, False) is not None
        except Exception:  # pylint: disable=broad-exception-caught
            return False

    def _with_norm(self, func: tirx.PrimFunc, target: Target, tunable: bool, prologue: list, operand: tirx.Buffer):
        """A GEMM whose row operand is an RMSNorm's output, computed in the kernel (passes/fuse_gemm_norms.py): the
        GEMM scheduled as without the norm, then each thread reduces the rows it multiplies (its sums of squares and
        their rsqrt, in local memory) and normalizes its share of each K step of the operand into local memory before
        it multiplies it, reusing it across its columns. Every thread along the tile's columns reduces the same rows
        (one pass over K per row, against the GEMM's pass over K per row and column), so a thread reads only what it
        wrote: no shared memory, no barrier, no cross-thread reduction (TVM's, inside the loop over a thread's rows,
        lost its buffer when that loop was unrolled)."""
        root = func.body.block
        gemm_stmts = stmts_of(root.body)[len(prologue):]
        gemm_body = gemm_stmts[0] if len(gemm_stmts) == 1 else tirx.SeqStmt(gemm_stmts)
        written = _written_buffers(prologue)
        gemm_only = func.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock(
            [], [], [], "root", gemm_body, alloc_buffers=[b for b in root.alloc_buffers if not _among(b, written)])))
        gemm_only = tirx.PrimFunc([*func.params, operand], gemm_only.body).with_attrs(dict(func.attrs))
        scheduled = self._matmul(gemm_only, target, tunable)
        if scheduled is None:
            return None
        scheduled_root = scheduled.mod["main"].body.block
        body = tirx.SeqStmt([*stmts_of(root.body)[:len(prologue)], *stmts_of(scheduled_root.body)])
        allocs = [*[b for b in root.alloc_buffers if _among(b, written)], *scheduled_root.alloc_buffers]
        # without the stage-pipeline check: the GEMM reads its padded tile's rows past the sequence, which the norm
        # does not write (those reads are guarded, and compute_at predicates the rows it adds)
        sch = s_tir.Schedule(func.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock(
            [], [], [], "root", body, alloc_buffers=allocs))), enable_check=False)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))[:len(prologue)]
        writer = blocks[-1]
        # per row: the sums of squares, and what reads only them (the rsqrt), once per thread; the elementwise rest
        # inlined into the operand's writer
        reductions = [sch.get(b) for b in blocks if is_reduction(sch.get(b))]
        statistics = [b for b in blocks if sch.get(b) in reductions or (
            b is not writer and sch.get_producers(b) and all(sch.get(p) in reductions for p in sch.get_producers(b)))]
        for block in blocks:
            if block is not writer and block not in statistics:
                sch.compute_inline(block)
        (reader,) = sch.get_consumers(writer)
        loops = sch.get_loops(reader)
        threads = max((loop for loop in loops if sch.get(loop).thread_binding is not None), key=loops.index)
        sch.compute_at(writer, loops[loops.index(threads) + 1], preserve_unit_loops=True)
        sch.set_scope(writer, 0, "local")
        for block in reversed(statistics):
            sch.compute_at(block, threads, preserve_unit_loops=True)
            sch.set_scope(block, 0, "local")
        return sch

    def _with_group_norm(self, func: tirx.PrimFunc, target: Target, tunable: bool, epilogue: list,
                         result: tirx.Buffer):
        """A GEMM with a norm prologue (_with_norm) and, after it, a norm over groups of its columns (Qwen3's q/k norm
        over each head; passes/fuse_gemm_norms.py): the GEMM scheduled as without the epilogue, its tile kept in
        shared memory; then each thread takes (row, group) pairs of the tile, sums the group's squares and writes it
        normalized. A tile holds whole groups (its columns a multiple of the group; where a group is a multiple of the
        tile's columns, the micro tile is widened to it), else the rule declines."""
        reduction = next(b for stmt in epilogue for b in _blocks_of(stmt) if is_reduction(b))
        group = 1
        for var in reduction.iter_vars:
            if var.iter_type == tirx.IterVar.CommReduce:
                group *= _extent(var.dom.extent) or 0
        columns = self.config.vthread_x * self.config.block_size_x * self.config.micro_size_x if self.config.inner_x \
            else self.config.vthread_y * self.config.block_size_y * self.config.micro_size_y
        if group and columns < group and group % columns == 0:
            # a group wider than the tile (a 128/256-wide head, Mali's 64 columns): each thread's micro tile that
            # many times as wide, so that a work group holds whole groups, and as many times fewer rows where it has
            # them (the same accumulators per thread; the tile in shared memory within the device's)
            factor = group // columns
            columns_micro, rows_micro = ("micro_size_x", "micro_size_y") if self.config.inner_x \
                else ("micro_size_y", "micro_size_x")
            wide = dataclasses.replace(self.config, **{
                columns_micro: getattr(self.config, columns_micro) * factor,
                rows_micro: max(1, getattr(self.config, rows_micro) // factor)})
            return Matmul(wide)._with_group_norm(func, target, tunable, epilogue, result)
        if not group or columns % group:
            return None
        root = func.body.block
        kept = stmts_of(root.body)[:-len(epilogue)]
        written = _written_buffers(epilogue)
        gemm_only = tirx.PrimFunc([*func.params, result], s_tir.SBlockRealize([], True, s_tir.SBlock(
            [], [], [], "root", kept[0] if len(kept) == 1 else tirx.SeqStmt(kept),
            alloc_buffers=[b for b in root.alloc_buffers if not _among(b, [*written, result])]))).with_attrs(
            dict(func.attrs))
        scheduled = self.apply(gemm_only, target, tunable)
        if scheduled is None:
            return None
        scheduled_root = scheduled.mod["main"].body.block
        # the result's and the epilogue's buffers with their rows padded to whole tiles: their regions in a work
        # group are then constants (OpenCL's shared and private arrays are), not clipped at the sequence's end
        tile = self.config.vthread_y * self.config.block_size_y * self.config.micro_size_y if self.config.inner_x \
            else self.config.vthread_x * self.config.block_size_x * self.config.micro_size_x
        own = [result, *[b for b in root.alloc_buffers if _among(b, written)]]
        padded = [tirx.decl_buffer([d if isinstance(d, tirx.IntImm) else (d + tile - 1) // tile * tile
                                    for d in b.shape], b.dtype, b.name) for b in own]

        def pad(buffer):
            return next((new for old, new in zip(own, padded) if buffer.same_as(old)), buffer)

        body = tvm_ffi.structural_map(tirx.SeqStmt([*stmts_of(scheduled_root.body), *map(_in_bounds, epilogue)]),
                                      [(tirx.Buffer, pad)])
        allocs = [*scheduled_root.alloc_buffers, *padded]
        sch = s_tir.Schedule(func.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock(
            [], [], [], "root", body, alloc_buffers=allocs))), enable_check=False)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))[-len(epilogue):]
        (writer,) = sch.get_producers(blocks[0])
        loops = sch.get_loops(writer)
        bound = [loop for loop in loops if sch.get(loop).thread_binding is not None]
        work_group = max((loop for loop in bound if sch.get(loop).thread_binding.thread_tag.startswith("blockIdx")),
                         key=loops.index)
        extents = {sch.get(loop).thread_binding.thread_tag: get_extent(sch, loop) for loop in bound}
        sch.set_scope(writer, 0, "shared")
        # the normalized groups stay a block of their own where others follow them (Gemma's RoPE): inlined into a
        # reader of other columns of the group (rotate-half), its reads would index the GEMM's flat columns, whose
        # region TVM cannot solve per group
        reduced = next(i for i, b in enumerate(blocks) if is_reduction(sch.get(b)))
        normalized = blocks[reduced + 1] if reduced + 2 < len(blocks) else None
        rest = [b for b in blocks if is_reduction(sch.get(b)) or b is normalized or b is blocks[-1]]
        for block in blocks:
            if block not in rest:
                sch.compute_inline(block)
        for block in rest:
            if normalized is not None and block is not normalized and not is_reduction(sch.get(block)):
                _reads_within_groups(sch, block, [sch.get(normalized).writes[0].source])
            sch.reverse_compute_at(block, work_group, preserve_unit_loops=True)
            # rows across threadIdx.y as the GEMM's tile has them; each thread sums the squares of every group of its
            # rows (the threads along threadIdx.x alike, each its own copy) and writes its share of each group's
            # columns: every region is the tile's (a split of the groups across threads would reach past it)
            *rows, _, columns = sch.get_loops(block)[loops.index(work_group) + 1:]
            rows_threads, _ = sch.split(sch.fuse(*rows), factors=[extents["threadIdx.y"], None])
            sch.bind(rows_threads, "threadIdx.y")
            if not is_reduction(sch.get(block)):
                _, columns_threads = sch.split(columns, factors=[None, extents["threadIdx.x"]])
                sch.bind(columns_threads, "threadIdx.x")
            if block is not rest[-1]:
                # the normalized groups in shared memory: what follows reads columns other threads wrote
                sch.set_scope(block, 0, "shared" if block is normalized else "local")
        return sch

    def _with_second_run(self, func: tirx.PrimFunc, target: Target, tunable: bool, second_run: list):
        """A GEMM with a residual prologue whose result others read too (passes/fuse_gemm_norms.py: Gemma 3's
        post-norm with its residual add, run a second time last into a result of its own): the GEMM scheduled as
        without the second run; the second run in the first work group only, its rows across the work group's
        threads, each thread reducing its row whole (its sum of squares a scalar) and writing it. One work group's
        extra pass over the rows (two reads and a write of each value) against the GEMM's over the weights, and no
        launch; each value written once, by one work-item."""
        root = func.body.block
        written = _written_buffers(second_run)
        kept = stmts_of(root.body)[:-len(second_run)]
        scheduled = self.apply(func.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock(
            [], [], [], "root", kept[0] if len(kept) == 1 else tirx.SeqStmt(kept),
            alloc_buffers=[b for b in root.alloc_buffers if not _among(b, written)]))), target, tunable)
        if scheduled is None:
            return None
        scheduled_root = scheduled.mod["main"].body.block
        sch = s_tir.Schedule(func.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock(
            [], [], [], "root", tirx.SeqStmt([*stmts_of(scheduled_root.body), *second_run]),
            alloc_buffers=[*scheduled_root.alloc_buffers, *[b for b in root.alloc_buffers if _among(b, written)]]))),
            enable_check=False)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        count = sum(len(_blocks_of(stmt)) for stmt in second_run)
        gemm, second = blocks[:-count], blocks[-count:]
        last = second[-1]
        # the elementwise blocks inlined into the result's; the sums of squares (and their rsqrt) per row of it
        statistics = [b for b in second if is_reduction(sch.get(b)) or (
            b is not last and sch.get_producers(b) and all(is_reduction(sch.get(p)) for p in sch.get_producers(b)))]
        for block in second:
            if block is not last and block not in statistics:
                sch.compute_inline(block)
        writer = next(b for b in gemm if _among(sch.get(b).writes[0].source, [func.params[-1]]))
        loops = sch.get_loops(writer)
        bound = [loop for loop in loops if sch.get(loop).thread_binding is not None]
        work_groups = [loop for loop in bound if sch.get(loop).thread_binding.thread_tag.startswith("blockIdx")]
        work_group = max(work_groups, key=loops.index)
        extents = {sch.get(loop).thread_binding.thread_tag: get_extent(sch, loop) for loop in bound}
        # into the work group loop, each after its producers (over every row: what they read is the function's
        # arguments), then the statistics into the result's loop over rows (a scalar each)
        for block in [*statistics, last]:
            sch.reverse_compute_at(block, work_group, preserve_unit_loops=True)
        *rows, _ = sch.get_loops(last)[loops.index(work_group) + 1:]
        row = sch.fuse(*rows)
        for block in reversed(statistics):
            sch.compute_at(block, row, preserve_unit_loops=True)
            sch.set_scope(block, 0, "local")
        _, thread_y, thread_x = sch.split(row, factors=[None, extents["threadIdx.y"], extents["threadIdx.x"]])
        sch.bind(thread_y, "threadIdx.y")
        sch.bind(thread_x, "threadIdx.x")
        return _in_first_work_group(sch, work_groups, [*statistics, last])

    def _matmul(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not any(getattr(p, "dtype", None) == code_loads.CODE_DTYPE for p in func.params):
            return super().apply(func, _device_only(target), tunable)
        # Packed codes. K steps of a whole 32-code block: the 16 bytes one 128-bit load brings are all used
        # (a 16-code step reads every byte twice, once per nibble). No compute vector: it runs across weight
        # rows, and TVM's OpenCL codegen emits invalid C for an 8-bit vector gather (convert_int8 of a scalar).
        packed = Matmul(dataclasses.replace(
            self.config, micro_size_k=max(self.config.micro_size_k, NIBBLE_BLOCK), vector_size=1))
        sch = dlight.gpu.Matmul.apply(packed, func, _device_only(target), tunable)
        if sch is not None:
            update = next(b for b in sch.get_child_blocks(sch.get_sblock("root"))
                          if code_loads.code_read_index(sch, b) is not None)
            loops = sch.get_loops(update)
            k_outer = max(i for i, loop in enumerate(loops) if sch.get(loop).thread_binding is not None) + 1
            code_loads.stage_codes(sch, update, loops[k_outer])
        return sch


class GEMV(dlight.gpu.GEMV):
    """dlight's gpu.GEMV; rows x K reductions (the decode matmuls) get the target file's tiles.

    dlight's inner-reduction schedule takes its tiles as arguments of a nested function it calls with
    per-vendor constants; this is that schedule for the case our kernels take (vector operand read from
    global memory, cross-thread reduction through local memory), with the constants from the file."""

    def __init__(self, params: dict[str, Any]):
        self.params = params

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        target = _device_only(target)
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        second_run = _second_run(sch, func, infos)
        infos = [info for info in infos if info not in second_run]
        prologue, epilogue = _around_gemv(sch, infos)
        if not prologue and not epilogue:
            return None if second_run else super().apply(func, target, tunable)
        return self._with_norms(sch, target, infos, prologue, epilogue, second_run)

    def takes(self, func: tirx.PrimFunc, target: Target) -> bool:
        """Whether this rule schedules `func`. dlight's analyses assert, and schedule primitives raise, on access
        patterns they do not take: for a kernel a pass only proposes, any failure means no."""
        try:
            return self.apply(func, target, False) is not None
        except Exception:  # pylint: disable=broad-exception-caught
            return False

    def _with_norms(  # pylint: disable=too-many-arguments,too-many-locals
        self, sch: s_tir.Schedule, target: Target, infos: list[SBlockInfo], prologue: list[SBlockInfo],
        epilogue: list[SBlockInfo], second_run: list[SBlockInfo],
    ):
        """A GEMV with the norms around it (passes/fuse_gemv_norms.py). Prologue: its vector operand computed in the
        kernel from values of the whole input row (RMSNorm's sum of squares and its rsqrt): each work group reduces
        the row itself, across its K threads, before its share of the GEMV; the elementwise rest is inlined into the
        GEMV's loads. Epilogue: a norm over groups of its results (a q/k norm over each head) and what follows it
        within the group (RoPE): each work group computes one group's rows into shared memory, one row per thread
        and no threads along K, reduces them across those threads and writes the group normalized (the prologue's
        row reduction across them too). A second run of a norm kernel of the prologue, into a result of its own
        (Gemma's residual stream): in the first work group only, after the GEMV, its row reduction whole in each
        thread and its elementwise rest inlined into its result, which the work group's threads write."""
        # The normalized rows stay a block of their own: inlined into a reader of other rows of the head (RoPE's
        # rotate-half), its reads would index the GEMV's flat rows, whose region TVM cannot solve per head.
        normalized = next((infos[i + 1] for i, info in enumerate(infos[:-1]) if info in epilogue and
                           info.is_reduction()), None)
        rest = try_inline_contiguous_spatial(sch, [info for info in infos if info not in prologue
                                                   and info is not normalized])
        if not rest:
            return None
        rest = sorted([*rest, *([normalized] if normalized is not None else [])], key=infos.index)
        gemv, after = rest[0], rest[1:]
        ts, tr = self.params["ts"], self.params["tr"]
        if epilogue:
            group = _group_rows(sch, gemv, after)
            if group is None:
                return None
            # one thread per row and none beside it: TVM's barrier placement misses a shared row one thread along
            # K writes and another reads at the same row index (Oclgrind found the race)
            ts, tr = group, 1
        elif len(after) > 1 or (after and not after[0].is_injective()):
            return None
        vector_buffers = is_gemv(sch, gemv) if len(gemv.iters) in (2, 3) else None
        if vector_buffers is None or normalize(sch, gemv) is not True:
            return None
        sch = self.sch_inner_reduction(sch, target, gemv.block_rv, vector_buffers, None if epilogue else
                                       (after[0] if after else None), ts, tr)
        work_group = sch.get_loops(gemv.block_rv)[0]
        tag_s = self.params["row_threads"]
        tag_r = ROW_THREAD_TAGS[1 - ROW_THREAD_TAGS.index(tag_s)]
        # the prologue's row reduction across the K threads, or across the rows' where each row has one thread
        threads_r, tag_p = (ts, tag_s) if epilogue else (tr, tag_r)
        for info in reversed(prologue):  # each before its readers, which are in the work group by now
            sch.compute_at(info.block_rv, work_group, preserve_unit_loops=True)
            if info.is_reduction():
                _, threads = sch.split(sch.get_loops(info.block_rv)[-1], factors=[None, threads_r])
                sch.bind(threads, tag_p)
                sch.set_scope(info.block_rv, 0, "shared")
            else:
                sch.set_scope(info.block_rv, 0, "local")
        if epilogue:
            sch.set_scope(gemv.block_rv, 0, "shared")
            for info in after:  # each group's sum of squares across the row threads, then its rows normalized
                _reads_within_groups(sch, info.block_rv, [sch.get(a.block_rv).writes[0].source for a in after])
                sch.reverse_compute_at(info.block_rv, work_group, preserve_unit_loops=True)
                loops = sch.get_loops(info.block_rv)[1:]
                inner = [loop for loop in loops if get_extent(sch, loop) != 1] or loops[-1:]
                _, threads = sch.split(sch.fuse(*inner), factors=[None, ts])
                sch.bind(threads, tag_s)
                # the sum of squares in each thread (an allreduce: a shared one would make TVM's in-thread partial
                # sums shared by the threads too); rows read across threads (RoPE) in shared memory
                if info is not after[-1]:
                    sch.set_scope(info.block_rv, 0, "local" if info.is_reduction() else "shared")
        if not second_run:
            return sch
        # each after its producers, which are in the work group by now (the reduction has none: its loads inlined)
        second_run = try_inline_contiguous_spatial(sch, second_run)
        extents = {tag_s: ts, tag_r: tr}
        for info in second_run:
            sch.reverse_compute_at(info.block_rv, work_group, preserve_unit_loops=True)
            if info.is_reduction():
                # whole in each thread: TVM places no barrier (a cross-thread sum's) under the first work group's
                # condition, and across threads every work group would pay for a sum only the first one uses
                sch.set_scope(info.block_rv, 0, "local")
            else:
                _, thread_y, thread_x = sch.split(sch.fuse(*sch.get_loops(info.block_rv)[1:]),
                                                  factors=[None, extents["threadIdx.y"], extents["threadIdx.x"]])
                sch.bind(thread_y, "threadIdx.y")
                sch.bind(thread_x, "threadIdx.x")
        return _in_first_work_group(sch, [work_group], [info.block_rv for info in second_run])

    def sch_inner_reduction(  # pylint: disable=too-many-arguments,too-many-locals,unused-argument
        self, sch: s_tir.Schedule, target: Target, block, vector_input_buffers, epilogue_info: SBlockInfo | None,
        ts: int | None = None, tr: int | None = None,
    ):
        """dlight's signature; `ts` x `tr` threads per work group (rows x K), the target file's unless given."""
        p = self.params
        ts, tr, unroll, tag_s = ts or p["ts"], tr or p["tr"], p["unroll"], p["row_threads"]
        tag_r = ROW_THREAD_TAGS[1 - ROW_THREAD_TAGS.index(tag_s)]
        _, _, r, c = sch.get_loops(block)
        len_r, len_c = (get_extent(sch, loop) for loop in (r, c))
        tile_r = len_c if len_c > 1 else max(_max_factor(len_r, [tr, tr * 2, tr * 4, tr * 8]) // tr, 1)
        vec = min(_max_factor(tile_r, [1, 2, 4, 8]), p["vec"])

        # As dlight: each thread sums `vec` lanes of its share of K (rf), then the lanes (rf2), then the threads.
        batch, s, r, c = sch.get_loops(block)
        s = sch.fuse(batch, s)
        r = sch.fuse(r, c)
        bx, t_s, tile_s = sch.split(s, factors=[None, ts, 1], preserve_unit_iters=True)
        r, t_r, tile_r_vec_n, v = sch.split(r, factors=[None, tr, tile_r // vec, vec], preserve_unit_iters=True)
        sch.reorder(r, tile_r_vec_n, t_r, v)
        rf = sch.rfactor(sch.fuse(t_r, v), 0)
        bx, t_s, tile_s, t_r_v = sch.get_loops(block)
        t_r, v = sch.split(t_r_v, factors=[tr, None], preserve_unit_iters=True)
        rf2 = sch.rfactor(t_r, 0)

        bx, t_s, tile_s, r, tile_r_vec_n, t_r_v = sch.get_loops(rf)
        t_r, v = sch.split(t_r_v, factors=[tr, None], preserve_unit_iters=True)
        sch.reorder(bx, t_s, t_r, r, tile_s, tile_r_vec_n, v)
        sch.bind(bx, "blockIdx.x")
        sch.bind(t_s, tag_s)
        sch.bind(t_r, tag_r)
        sch.vectorize(v)
        codes = code_loads.code_read_index(sch, rf)
        matrix = _matrix_read(sch, rf)
        if matrix != codes:  # the scales (read at every iterator); where K fits in one group, the codes are that
            weights = sch.cache_read(rf, read_buffer_index=matrix, storage_scope="local", consumer_blocks=[rf])
            sch.compute_at(weights, r, preserve_unit_loops=True)
        if codes is not None:
            code_loads.stage_codes(sch, rf, r)
            # Constant indices into the staged codes let the device compiler keep them in registers.
            sch.unroll(tile_r_vec_n)

        sch.reverse_compute_at(rf2, bx, preserve_unit_loops=True)
        t_r, v, *rows = sch.get_loops(rf2)[1:]
        outer, t_s, tile_s = sch.split(sch.fuse(*rows), factors=[None, ts, 1], preserve_unit_iters=True)
        assert sch.get(outer).extent.value == 1
        t_s = sch.fuse(outer, t_s)
        sch.reorder(t_s, t_r, tile_s, v)
        sch.bind(t_s, tag_s)
        sch.bind(t_r, tag_r)

        sch.reverse_compute_at(block, bx, preserve_unit_loops=True)
        t_r, *rows = sch.get_loops(block)[1:]
        outer, t_s, tile_s = sch.split(sch.fuse(*rows), factors=[None, ts, 1], preserve_unit_iters=True)
        assert sch.get(outer).extent.value == 1
        t_s = sch.fuse(outer, t_s)
        sch.reorder(tile_s, t_s, t_r)
        sch.bind(t_s, tag_s)
        sch.bind(t_r, tag_r)

        sch.decompose_reduction(rf, sch.get_loops(rf)[3])
        sch.decompose_reduction(rf2, sch.get_loops(rf2)[-1])
        for b in (rf, rf2):
            sch.set_scope(b, 0, "local")
            sch.annotate(sch.get_loops(b)[3], "pragma_auto_unroll_max_step", unroll)
            sch.annotate(sch.get_loops(b)[3], "pragma_unroll_explicit", 1)

        if epilogue_info is not None:
            epilogue = epilogue_info.block_rv
            if is_broadcast_epilogue(sch, block, epilogue):
                sch.reverse_compute_at(epilogue, bx)
                sch.set_scope(block, 0, "shared")
                _, t_r = sch.split(sch.fuse(*sch.get_loops(epilogue)[2:]), factors=[None, tr])
                sch.bind(t_r, "threadIdx.x")
            else:
                sch.reverse_compute_at(epilogue, bx, preserve_unit_loops=True)
                sch.fuse(*sch.get_loops(epilogue)[1:])
                outer, t_s, _ = sch.split(sch.get_loops(epilogue)[-1], factors=[None, ts, 1], preserve_unit_iters=True)
                assert sch.get(outer).extent.value == 1
                sch.bind(sch.fuse(outer, t_s), tag_s)
                sch.set_scope(block, 0, "local")
        return sch


def _blocks_of(stmt) -> list[s_tir.SBlock]:
    return [node for node in tir_statements(stmt) if isinstance(node, s_tir.SBlock)]


def _written_buffers(stmts: list) -> list[tirx.Buffer]:
    return [w.source for stmt in stmts for block in _blocks_of(stmt) for w in block.writes]


def _among(buffer: tirx.Buffer, buffers: list[tirx.Buffer]) -> bool:
    return any(buffer.same_as(b) for b in buffers)


def _one_block_each(func: tirx.PrimFunc) -> tuple[list, list[s_tir.SBlock]] | None:
    """The root's statements and the one block of each; None where a statement holds more or none."""
    stmts = stmts_of(func.body.block.body)
    blocks = [_blocks_of(stmt) for stmt in stmts]
    if any(len(found) != 1 for found in blocks):
        return None
    return stmts, [found[0] for found in blocks]


def _writer(blocks: list[s_tir.SBlock], buffer: tirx.Buffer) -> int | None:
    """The index of the first of `blocks` that writes `buffer`."""
    return next((i for i, block in enumerate(blocks) if _among(buffer, [w.source for w in block.writes])), None)


def _second_run_stmts(func: tirx.PrimFunc) -> list:
    """The root's statements after the last that writes the function's last result, where they are FuseGEMMNorms'
    second run of a residual prologue (a norm kernel: a row reduction, then what writes the result before the last);
    [] otherwise."""
    found = _one_block_each(func)
    if found is None or len(func.params) < 2:
        return []
    stmts, blocks = found
    after = _writer(blocks[::-1], func.params[-1])
    if not after:
        return []
    second = blocks[-after:]
    if not any(is_reduction(b) for b in second) or not _among(second[-1].writes[0].source, [func.params[-2]]):
        return []
    return stmts[-after:]


def _norm_prologue(func: tirx.PrimFunc) -> tuple[list, tirx.Buffer] | None:
    """(the root's statements that compute the GEMM's row operand, that operand) where the function starts with an
    RMSNorm (a row reduction among the statements) whose result is the row operand of its last reduction, the GEMM,
    and nothing else before it; None otherwise."""
    found = _one_block_each(func)
    if found is None:
        return None
    stmts, blocks = found
    reductions = [i for i, block in enumerate(blocks) if is_reduction(block)]
    if len(reductions) < 2:
        return None
    gemm = reductions[-1]
    operand = next((r.source for r in blocks[gemm].reads if (w := _writer(blocks, r.source)) is not None and w < gemm
                    and any(i < w for i in reductions[:-1])), None)
    if operand is None:
        return None
    end = _writer(blocks, operand) + 1
    # what the statements before the operand's write is read by them alone (the GEMM's own statements follow)
    written = _written_buffers(stmts[:end])
    if any(_among(r.source, written) and not r.source.same_as(operand) for block in blocks[end:] for r in block.reads):
        return None
    return stmts[:end], operand


def _in_bounds(stmt):
    """`stmt` with each block's indices simplified within its iterators' domains: a reshape's flat index modulo the
    sequence length (the generic form of a reshape) becomes the row itself, which TVM's region analysis can place."""

    def simplified(block: s_tir.SBlock) -> s_tir.SBlock:
        analyzer = Analyzer()
        for iv in block.iter_vars:
            analyzer.bind(iv.var, iv.dom)

        def within(node):  # x mod n of an x in [0, n): x (the simplifier leaves it where n is symbolic)
            inside = analyzer.can_prove(node.a >= 0) and analyzer.can_prove(node.a < node.b)
            return node.a if inside else node

        def load(node):
            return tirx.BufferLoad(node.source, [tvm_ffi.structural_map(analyzer.simplify(i), [(tirx.FloorMod, within)])
                                                 for i in node.indices])

        return tvm_ffi.structural_map(block, [(tvm.ir.expr.TensorLoad, load)])

    return tvm_ffi.structural_map(stmt, [(s_tir.SBlock, simplified)])


def _group_norm_epilogue(func: tirx.PrimFunc) -> tuple[list, tirx.Buffer] | None:
    """(the root's statements after the GEMM, the GEMM's result they read) where the function is a GEMM with a norm
    prologue (its row operand computed from a row reduction) and, after it, spatial statements and one reduction
    (a norm over groups of the GEMM's columns) reading the GEMM's result; None otherwise."""
    found = _one_block_each(func)
    if found is None:
        return None
    stmts, blocks = found

    def reduced_before(i: int) -> int | None:
        """The reduction nearest before block `i` along what it reads (through spatial blocks)."""
        for read in blocks[i].reads:
            j = _writer(blocks, read.source)
            if j is not None and j < i:
                found = j if is_reduction(blocks[j]) else reduced_before(j)
                if found is not None:
                    return found
        return None

    reductions = [i for i, block in enumerate(blocks) if is_reduction(block)]
    if len(reductions) < 3:
        return None
    gemm = reduced_before(reductions[-1])
    if gemm is None or gemm != reductions[-2] or not _multiplies_a_matrix(blocks[gemm]) \
            or reduced_before(gemm) is None:
        return None
    return stmts[gemm + 1:], blocks[gemm].writes[0].source


def _multiplies_a_matrix(block: s_tir.SBlock) -> bool:
    """Whether `block` reads a buffer at fewer of its spatial iterators than it has (the weight of a GEMM, the same
    for every row), not a norm's sum of squares, which reads its rows only (a residual prologue's before the GEMM)."""
    spatial = {v.var for v in block.iter_vars if v.iter_type == tirx.IterVar.DataPar and _extent(v.dom.extent) != 1}
    return any(not spatial <= set(collect_block_iter_vars_used_in_access_region(block, read.region))
               for read in block.reads)


def _matrix_read(sch: s_tir.Schedule, block) -> int:
    """The index of the first buffer `block` reads at every one of its iterators (a weight matrix, not the vector
    operand or a value of the whole row)."""
    stmt = sch.get(block)
    return next(i for i, read in enumerate(stmt.reads)
                if len(collect_block_iter_vars_used_in_access_region(stmt, read.region)) == len(stmt.iter_vars))


def _around_gemv(sch: s_tir.Schedule, infos: list[SBlockInfo] | None) -> tuple[list[SBlockInfo], list[SBlockInfo]]:
    """(prologue, epilogue) of a function's GEMV, its first reduction that writes more than one value: the prologue,
    the blocks before it that write one value (a decode row's sum of squares and its rsqrt) where a reduction is among
    them; the epilogue, the blocks after it where a reduction is among them (a norm of its results). Each [] where
    it is not so."""
    if not infos:
        return [], []
    scalar = [all(_extent(d) == 1 for d in sch.get(info.block_rv).writes[0].source.shape) for info in infos]
    gemv = next((i for i, info in enumerate(infos) if info.is_reduction() and not scalar[i]), None)
    if gemv is None:
        return [], []
    before = [info for info, one in zip(infos[:gemv], scalar[:gemv]) if one]
    reduced_before = any(info.is_reduction() for info in infos[:gemv])
    prologue = before if reduced_before and all(info in before for info in infos[:gemv] if info.is_reduction()) else []
    epilogue = infos[gemv + 1:] if any(info.is_reduction() for info in infos[gemv + 1:]) else []
    return prologue, epilogue


def _second_run(sch: s_tir.Schedule, func: tirx.PrimFunc, infos: list[SBlockInfo]) -> list[SBlockInfo]:
    """The blocks after the last that writes the function's last result (FuseGEMVNorms' second run of a norm kernel of
    the prologue, into a result of its own)."""
    last = max((i for i, info in enumerate(infos) if sch.get(info.block_rv).writes[0].source.same_as(func.params[-1])),
               default=len(infos))
    return infos[last + 1:]


def _in_first_work_group(sch: s_tir.Schedule, work_groups: list, block_rvs: list) -> s_tir.Schedule:
    """`sch`'s function with the blocks of `block_rvs` run by the first work group (0 along each loop of
    `work_groups`) only: their result is written once, by work-items of one work group, which read nothing another
    work group writes. Schedule primitives cannot predicate a block on a loop outside it, so this edits the blocks'
    predicates and starts a schedule of the result."""
    func = sch.mod["main"]
    first = None
    for loop in (sch.get(rv) for rv in work_groups):
        at_zero = tirx.EQ(loop.loop_var, tirx.const(0, loop.loop_var.ty))
        first = at_zero if first is None else tirx.And(first, at_zero)
    blocks = [sch.get(rv) for rv in block_rvs]

    def first_only(realize: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
        if not any(realize.block.same_as(block) for block in blocks):
            return realize
        always = isinstance(realize.predicate, tirx.IntImm) and realize.predicate.value == 1
        return s_tir.SBlockRealize(realize.iter_values, first if always else tirx.And(realize.predicate, first),
                                   realize.block)

    return s_tir.Schedule(func.with_body(tvm_ffi.structural_map(func.body, [(s_tir.SBlockRealize, first_only)])))


def _group_rows(sch: s_tir.Schedule, gemv: SBlockInfo, after: list[SBlockInfo]) -> int | None:
    """The rows of one group of an epilogue norm (its reduction's extent): a reduction then the elementwise
    normalization (and what follows it within the group: Gemma's RoPE), over whole groups of more than one; None for
    any other epilogue."""
    if len(after) < 2 or not after[0].is_reduction() or not all(info.is_injective() for info in after[1:]):
        return None
    group = 1
    for var in sch.get(after[0].block_rv).iter_vars:
        if var.iter_type == tirx.IterVar.CommReduce:
            group *= _extent(var.dom.extent) or 0
    rows = 1
    for var in sch.get(gemv.block_rv).iter_vars:
        if var.iter_type == tirx.IterVar.DataPar:
            rows *= _extent(var.dom.extent) or 0
    return group if group > 1 and rows > group and rows % group == 0 else None


def _reads_within_groups(sch: s_tir.Schedule, block, buffers: list) -> None:
    """Declare each read of `block` from `buffers` (the epilogue's) at an offset of an iterator (RoPE's rotate-half
    reads position d -+ half of the head) as a read at that iterator. TVM's reverse_compute_at solves a block's
    iterators only from plain indices; the declared region places the block per group as its real one would, since
    the producer writes whole groups in the same work group (in shared memory: TVM's barrier comes from the real
    accesses, not this declaration)."""
    stmt = sch.get(block)
    iters = [v.var for v in stmt.iter_vars]
    for index, read in enumerate(stmt.reads):
        if not any(read.source.same_as(b) for b in buffers):
            continue
        bounds, offset = [], False
        for r in read.region:
            used = [v for v in tirx.analysis.undefined_vars(r.min, []) if any(v.same_as(i) for i in iters)]
            if len(used) > 1:
                break
            offset |= bool(used) and not (r.min.same_as(used[0]) and _extent(r.extent) == 1)
            bounds += [used[0], used[0] + 1] if used else [r.min, r.min + r.extent]
        else:
            if offset:  # Schedule.annotate_buffer_access takes a range per block iterator, not per buffer dimension
                schedule_ffi.ScheduleAnnotateBufferAccess(sch, block, index, 0, tirx.IndexMap(iters, bounds, None))


def _extent(dim) -> int | None:
    return dim.value if isinstance(dim, tirx.IntImm) else None


def _max_factor(n: int, factors: list[int]) -> int:
    return next((f for f in sorted(factors, reverse=True) if n % f == 0), 1)


def rules(schedule: dict[str, Any]) -> list:
    """The GPU rules in the order ApplyDefaultSchedule should try them; the first that applies wins."""
    return [
        Matmul(schedule["matmul"]),
        GEMV(schedule["gemv"]),
        dlight.gpu.Reduction(),
        dlight.gpu.GeneralReduction(),
        dlight.gpu.Fallback(),
    ]
