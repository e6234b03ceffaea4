"""The 64-byte alignment policy, and where to find the buffers and offsets it covers; no rewrite is needed.

What must hold, and how it already holds with TVM 0.27 (checked in its sources; VerifyAlignment enforces it):
- PrimFunc buffers declare data_alignment 64: decl_buffer's default (-1) becomes runtime::kAllocAlignment = 64, and
  every kernel here (TE, TVMScript KV-cache kernels, FuseTIR, dlight) uses that default. MakePackedAPI turns it into
  an unchecked `storage_alignment` assumption on each argument's data pointer, so the pointers must really be aligned:
- they are: CPU tensors, VM storage (`vm.builtin.alloc_storage`) and the paged KV cache's pages (Tensor::Empty in
  paged_kv_cache.cc) all come from DeviceAPI::AllocDataSpace with alignment max(64, element size); weights are
  copied into such tensors (tvm.runtime.tensor). A page is page_size x head_dim elements, 4 KiB for SmolLM2 in fp32.
- Relax's StaticPlanBlockMemory gives every memory.alloc_tensor offset 0 inside its own storage; on CPU an offset
  would travel as DLTensor.byte_offset, which a buffer with elem_offset 0 rejects at call time anyway.
- Scratch buffers inside kernels: LLVM codegen sizes each alloca's alignment itself (at most 16 bytes) and emits
  loads at the alignment it actually has, so nothing assumes more; heap scratch comes from the 64-aligned pool.
Padding rows to 64-byte multiples is not done: float rows here are already multiples (hidden 576 x 4 B = 2304 B),
while q4 weight rows at K=576 are 288 B and their fp16 scale rows 36 B. Vector loads across those boundaries are
legal on x86 and AArch64 (an occasional cache-line split); padding them would add ~11% to the weight bytes that
bandwidth-bound decode reads, and change the stored layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import tvm
from tvm import relax, tirx

from .ir_walk import relax_nodes, tir_statements

ALIGNMENT = 64
# Calls that place a tensor at a byte offset: (op name, index of the offset argument).
OFFSET_OPS = {"relax.memory.alloc_tensor": 1, "relax.vm.alloc_tensor": 1, "relax.memory.view": 3}


def declared_buffers(func: tirx.PrimFunc) -> Iterator:
    """Every buffer a PrimFunc declares: parameters, block allocations and match_buffers, AllocBuffer/DeclBuffer."""
    for param in func.params:
        if hasattr(param, "data_alignment"):
            yield param
    for stmt in tir_statements(func.body):
        if hasattr(stmt, "buffer") and hasattr(stmt.buffer, "data_alignment"):
            yield stmt.buffer
        for buffer in getattr(stmt, "alloc_buffers", ()):
            yield buffer
        for match in getattr(stmt, "match_buffers", ()):
            yield match.buffer


def placement_offsets(func: relax.Function) -> list[tuple[relax.Call, relax.Expr]]:
    """(call, offset argument) for every Relax call that places a tensor at a byte offset in storage."""
    return [(call, call.args[OFFSET_OPS[call.op.name]]) for call in relax_nodes(func)
            if isinstance(call.op, tvm.ir.Op) and call.op.name in OFFSET_OPS]
