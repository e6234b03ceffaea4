"""Shared by the robustness tests: one tiny checkpoint and one artifact compiled from it (~30 s), copied by tests
that damage or replace it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.commands.cli import main
from tests.helpers.assertions import without_progress
from tests.helpers.compiled_once import compiled_once
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

CONTEXT = 64


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return save_compilable_checkpoint(build_model("llama_gqa"), tmp_path_factory.mktemp("robust") / "hf")


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    return compiled_once(tmp_path_factory, tiny_checkpoint, "host", "q0f32", context_window=CONTEXT)


@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_artifact, tmp_path / "copy"))


def run_cli(args: list[str], **kwargs):
    """The CLI in this process; a traceback that reaches the user fails the test."""
    result = CliRunner().invoke(main, [str(a) for a in args], **kwargs)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def run_subprocess(args: list, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """`python -m compiler ARGS` as a user runs it (a crash shows as a signal, not as a Python exception)."""
    return subprocess.run([sys.executable, "-m", "compiler", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False, **kwargs)


def one_line_error(result, *needles: str) -> str:
    """The result is exit 2 with exactly one `mobilec: error:` line on stderr holding every needle."""
    code = result.exit_code if hasattr(result, "exit_code") else result.returncode
    out = result.output if hasattr(result, "output") else result.stdout + result.stderr
    assert code == 2, out
    lines = without_progress(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("mobilec: error: "), result.stderr
    assert "Traceback" not in out
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
