"""Assertions shared by tests of user-facing errors and output."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from compiler.errors import MobilecError


def assert_mobilec_error(fn: Callable[[], Any], *fragments: str) -> str:
    """`fn()` must raise MobilecError with a one-line message containing every fragment (case-insensitive)."""
    with pytest.raises(MobilecError) as info:
        fn()
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    for fragment in fragments:
        assert fragment.lower() in message.lower(), f"{fragment!r} not in {message!r}"
    return message


def without_progress(stderr: str) -> list[str]:
    """stderr's lines less compile's step and count lines (compiler/progress.py: "compile: ..."), which come
    before an error met after a step began."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("compile: ")]


def strict_json(text: str) -> Any:
    """`text` parsed as strict JSON (as jq and JavaScript parse it): NaN and Infinity, which Python's json writes
    and reads by default, fail the test."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} in JSON output (a figure that does not exist must be null): {text}")

    return json.loads(text, parse_constant=refuse)
