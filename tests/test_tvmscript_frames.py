"""compiler/tvmscript_frames.py: TVMScript parses to the same IR with its frame lookups as with TVM's own, without
reading the stack's source lines."""

from __future__ import annotations

import inspect

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import tirx as T
from tvm.script.parser.core.parser import ScriptMacro
from tvm.script.parser.ir import entry as ir_entry
from tvm.tirx.script.parser import entry as tirx_entry

from compiler import tvmscript_frames


def _kernel(n: int):
    """A macro expanded n times inside a function whose buffer shape is a closure variable of an annotation (what
    `from __future__ import annotations` hides from the closure: the parser finds it in this frame)."""
    width = 4 * n

    @T.macro
    def add_one(buf, i):
        buf[i] = buf[i] + T.float32(1)

    @T.prim_func(private=True)
    def func(a: T.Buffer((width,), "float32")):
        for i in T.unroll(n):
            add_one(a, i)

    return func


def _module():
    @I.ir_module
    class Module:  # pylint: disable=too-few-public-methods
        @T.prim_func
        def main(a: T.Buffer((8,), "float32")):
            for i in range(8):
                a[i] = a[i] * T.float32(2)

    return Module


@pytest.fixture
def tvms_own_lookups(monkeypatch):
    """TVM's lookups, as before install()."""
    monkeypatch.setattr(ScriptMacro, "_find_parser_def", tvmscript_frames.TVMS_FIND_PARSER_DEF)
    monkeypatch.setattr(tirx_entry, "inspect", inspect)
    monkeypatch.setattr(ir_entry, "inspect", inspect)


def test_the_same_ir_as_tvms_own_lookups(tvms_own_lookups, monkeypatch):  # pylint: disable=redefined-outer-name
    own = (_kernel(6), _module())
    monkeypatch.undo()
    tvmscript_frames.install()
    ours = (_kernel(6), _module())
    tvm.ir.assert_structural_equal(ours[0], own[0])
    tvm.ir.assert_structural_equal(ours[1], own[1])
    assert "T.Buffer((24,)" in ours[0].script()  # the closure's width, found in _kernel's frame


def test_no_source_line_is_read_while_parsing(monkeypatch):
    """With install(), neither getouterframes (every macro call, before) nor stack() (every prim_func) runs; TVM's own
    parser fails on the same spy (the negative control)."""

    def spy(*_args, **_kwargs):
        raise AssertionError("a frame's source line was read")

    tvmscript_frames.install()
    monkeypatch.setattr(inspect, "getouterframes", spy)
    monkeypatch.setattr(inspect, "stack", spy)
    _kernel(3)
    monkeypatch.setattr(ScriptMacro, "_find_parser_def", tvmscript_frames.TVMS_FIND_PARSER_DEF)
    with pytest.raises(tvm.error.DiagnosticError, match="source line was read"):
        _kernel(3)
