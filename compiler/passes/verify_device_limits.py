"""VerifyDeviceLimits: fail the compile, naming the kernel and the limit, where the device would refuse to run it.

Two kinds of functions are checked, whichever the module holds:
- device kernels as SplitHostDevice leaves them (one PrimFunc per launch, calling_conv 2): threads per work
  group, local (shared) memory and argument count, against the attributes of the kernel's own TVM target
  (max_num_threads, max_shared_memory_per_block, max_function_args; compiler/target/targets.py sets them from the
  target file's [device] table). A driver rejects such a kernel only when it is launched, on the phone.
- Relax functions after memory planning: every storage allocation and every parameter tensor against the
  largest single allocation the device allows (Adreno: 1 GiB), where the size is known at compile time.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, tirx

from ..errors import MobilecError
from .ir_walk import relax_nodes, tir_statements

_KERNEL_LAUNCH = 2  # CallingConv::kDeviceKernelLaunch
_LOCAL_SCOPES = ("shared", "shared.dyn")
_ALLOC_STORAGE = ("relax.memory.alloc_storage", "relax.vm.alloc_storage")


def _bytes(shape, dtype) -> int | None:
    if not all(isinstance(d, (int, tirx.IntImm)) for d in shape):
        return None
    dt = tvm.DataType(str(dtype))
    return math.prod(int(d) for d in shape) * dt.bits * dt.lanes // 8


def kernel_usage(func: tirx.PrimFunc) -> dict[str, int]:
    """threads (per work group), local_bytes and args of one device kernel."""
    extents: dict[str, int] = {}
    local = 0
    for stmt in tir_statements(func.body):
        if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent":
            tag = stmt.node.thread_tag
            if tag.startswith("threadIdx") and isinstance(stmt.value, tirx.IntImm):
                extents[tag] = max(extents.get(tag, 1), int(stmt.value))
        if isinstance(stmt, tirx.AllocBuffer) and stmt.buffer.scope() in _LOCAL_SCOPES:
            local += _bytes(stmt.buffer.shape, stmt.buffer.dtype) or 0
    return {"threads": math.prod(extents.values()), "local_bytes": local, "args": len(func.params)}


# (usage key, target attribute, what the message calls it)
_KERNEL_LIMITS = (
    ("threads", "max_num_threads", "threads per work group"),
    ("local_bytes", "max_shared_memory_per_block", "bytes of local memory"),
    ("args", "max_function_args", "kernel arguments"),
)


def _check_kernel(name: str, func: tirx.PrimFunc) -> None:
    target = func.attrs["target"]
    usage = kernel_usage(func)
    for key, attr, what in _KERNEL_LIMITS:
        limit = target.attrs.get(attr)
        if limit is not None and usage[key] > int(limit):
            raise MobilecError(
                f"kernel {name} uses {usage[key]} {what}; target {target.kind.name} ({target.attrs.get('device', '')}) "
                f"allows {int(limit)} ({attr}); lower the tile sizes in the target file's [schedule] tables"
            )


def _tensor_sizes(ty) -> list[int]:
    if isinstance(ty, relax.TensorType) and ty.shape is not None and isinstance(ty.shape, relax.ShapeExpr):
        size = _bytes(ty.shape.values, ty.dtype)
        return [] if size is None else [size]
    if isinstance(ty, tvm.ir.TupleType):
        return [s for field in ty.fields for s in _tensor_sizes(field)]
    return []


def _check_buffers(name: str, func: relax.Function, max_bytes: int) -> None:
    sizes: list[tuple[int, str]] = []
    for param in func.params:
        sizes += [(s, f"parameter {param.name}") for s in _tensor_sizes(param.ty)]
    for call in relax_nodes(func):
        if isinstance(call.op, tvm.ir.Op) and call.op.name in _ALLOC_STORAGE:
            size = call.args[0]
            if isinstance(size, relax.ShapeExpr) and all(isinstance(v, tirx.IntImm) for v in size.values):
                sizes.append((math.prod(int(v) for v in size.values), "a storage allocation"))
    for size, what in sizes:
        if size > max_bytes:
            raise MobilecError(
                f"function {name}: {what} takes {size / 2**30:.2f} GiB, above the target's largest single "
                f"allocation (device.max_alloc_gb = {max_bytes / 2**30:g}); use a smaller --context-window or "
                f"a lower-bit --quant"
            )


@tvm.transform.module_pass(opt_level=0, name="VerifyDeviceLimits")
class VerifyDeviceLimits:  # pylint: disable=too-few-public-methods
    """Check only, never rewrite."""

    def __init__(self, max_alloc_gb: float):
        self.max_bytes = int(max_alloc_gb * 2**30)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and func.attrs is not None \
                    and int(func.attrs.get("calling_conv", 0)) == _KERNEL_LAUNCH:
                _check_kernel(gv.name_hint, func)
            elif isinstance(func, relax.Function):
                _check_buffers(gv.name_hint, func, self.max_bytes)
        return mod
