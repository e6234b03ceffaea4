"""TVMScript parsing without reading every caller's source line: TVM 0.27's parser looks up its callers' frames with
`inspect.stack()` / `inspect.getouterframes()`, which read the source line (and find the module) of every frame on
the stack, once per `T.prim_func` and once per `T.macro` call. Our kernels expand macros thousands of times (an
unrolled integer-dot GEMV), so those lookups were 60% of a small model's compile (14 of 20 s of parsing for 8 GEMVs).
`install()` gives the parser the same frames without the source lines it does not read: bare frames walked by
`f_back`, and frame records whose source line is read only when asked for."""

from __future__ import annotations

import inspect
import sys
import types

from tvm.script.parser.core.parser import ScriptMacro
from tvm.script.parser.ir import entry as ir_entry
from tvm.tirx.script.parser import entry as tirx_entry


# TVM's own, kept for tests/test_tvmscript_frames.py to compare with
TVMS_FIND_PARSER_DEF = ScriptMacro._find_parser_def  # pylint: disable=protected-access


def _find_parser_def(self):  # pylint: disable=unused-argument
    """ScriptMacro._find_parser_def: the innermost frame whose globals hold the parser (as TVM's, from this frame)."""
    frame = sys._getframe(0)  # pylint: disable=protected-access
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


class _FrameRecord:
    """What the parser reads of an `inspect.FrameInfo`: the frame, its line number and (read when asked) the line."""

    __slots__ = ("frame", "lineno")

    def __init__(self, frame: types.FrameType):
        self.frame = frame
        self.lineno = frame.f_lineno

    @property
    def code_context(self) -> list[str] | None:
        return inspect.getframeinfo(self.frame, context=1).code_context


def _stack(context: int = 1) -> list[_FrameRecord]:  # pylint: disable=unused-argument
    """inspect.stack() as the parser's entry points use it: from the caller outwards."""
    records, frame = [], sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        records.append(_FrameRecord(frame))
        frame = frame.f_back
    return records


# `inspect` as the entry modules see it: the module itself but for stack()
_INSPECT = types.SimpleNamespace(**{name: getattr(inspect, name) for name in dir(inspect) if not name.startswith("__")})
_INSPECT.stack = _stack


def install() -> None:
    """Give TVM's TVMScript parser the frame lookups above (idempotent)."""
    ScriptMacro._find_parser_def = _find_parser_def  # pylint: disable=protected-access
    tirx_entry.inspect = _INSPECT
    ir_entry.inspect = _INSPECT
