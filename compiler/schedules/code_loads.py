"""Packed weight codes staged per thread in private memory by 128-bit loads (vload16 of the uint8 code buffer).

A GPU reaches its memory bandwidth only with wide loads. The dequantize that the GEMV and prefill matmul inline
reads one code byte per weight (a 4-bit code byte twice, once per nibble), so the loads the kernels get follow
the compute's vector: 4 or 8 bytes per load in the GEMV, one byte in the prefill matmul (its vector runs across
weight rows, and TVM's OpenCL codegen emits invalid C for an 8-bit vector gather, `convert_int8` of a scalar).

Here the codes a thread consumes in one step of its K loop are first copied from global memory into a private
array (a schedule `cache_read` at that loop, `compute_at` deriving the byte range from the dequantize's index
arithmetic), and that copy is vectorized 16 bytes wide: TVM 0.27's OpenCL codegen emits
`vstore16(vload16(0, codes + offset), 0, codes_local + i)`, one 128-bit load. The dequantize then reads its
bytes from the private array, which the compiler keeps in registers once the loops are unrolled, so the nibbles
are unpacked in registers. Chosen over the alternatives because it needs nothing from the codegen beyond a
contiguous uchar16 load: storing the codes as uint32 words (so four of them make a legal uint4 load) would
change the artifact layout the CPU kernels share, and a TIR pass rewriting the code accesses would redo the
region analysis that `compute_at` already does.
"""

from __future__ import annotations

from tvm import s_tir
from tvm.s_tir.dlight.base import get_extent

CODE_DTYPE = "uint8"
LOAD_BYTES = 16  # 128 bits


def code_read_index(sch: s_tir.Schedule, block) -> int | None:
    """The index of the block's read of a packed code buffer, or None when it reads none."""
    return next((i for i, region in enumerate(sch.get(block).reads) if region.source.dtype == CODE_DTYPE), None)


def stage_codes(sch: s_tir.Schedule, block, loop) -> None:
    """Copy the code bytes `block` reads in one iteration of `loop` into private memory, 16 bytes per load."""
    codes = sch.cache_read(block, read_buffer_index=code_read_index(sch, block), storage_scope="local")
    sch.compute_at(codes, loop, preserve_unit_loops=True)
    # The copy's own loops are the code buffer's [row, byte]: rows are apart in memory, bytes are contiguous.
    row_bytes = sch.get_loops(codes)[-1]
    extent = get_extent(sch, row_bytes)
    lanes = next(n for n in (LOAD_BYTES, 8, 4, 2, 1) if extent % n == 0)
    _, vector = sch.split(row_bytes, factors=[None, lanes], preserve_unit_iters=True)
    sch.vectorize(vector)
