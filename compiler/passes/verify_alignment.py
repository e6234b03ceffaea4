"""VerifyAlignment: raise MobilecError for any PrimFunc buffer or Relax storage offset that is not 64-byte aligned."""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..errors import MobilecError
from .align import ALIGNMENT, declared_buffers, placement_offsets


@tvm.transform.module_pass(opt_level=0, name="VerifyAlignment")
class VerifyAlignment:  # pylint: disable=too-few-public-methods
    """Check only, never rewrite; run last (see align.py for why these are the things to check)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                for buffer in declared_buffers(func):
                    if int(buffer.data_alignment) < ALIGNMENT:
                        raise MobilecError(
                            f"buffer {buffer.name} of kernel {gv.name_hint} declares data_alignment="
                            f"{int(buffer.data_alignment)}, below the {ALIGNMENT} bytes every buffer must have"
                        )
            elif isinstance(func, relax.Function):
                for call, offset in placement_offsets(func):
                    value = int(offset.value) if isinstance(offset, tirx.IntImm) else None
                    if value is None or value % ALIGNMENT:
                        raise MobilecError(
                            f"{call.op.name} in function {gv.name_hint} places a tensor at byte offset "
                            f"{value if value is not None else offset}, not a multiple of {ALIGNMENT}"
                        )
        return mod
