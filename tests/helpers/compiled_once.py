"""Artifacts compiled once per test run and shared by every test module and xdist worker that asks for the same
compile: the workers' temporary directories share a parent, where the first compiles under a file lock and the
others wait, then find the artifact (compile_model renames it into place whole). The key is everything the compile
reads: the checkpoint's bytes, the target file's, the options, and the tuning logs' location.

    artifact = compiled_once(tmp_path_factory, checkpoint, "host", "q0f32", context_window=64)

A shared artifact is read-only to its users: a test that changes one works on a copy."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import pytest

from compiler.commands.compile_model import CompileOptions, compile_model
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    shared = root / "compiled-once"
    shared.mkdir(exist_ok=True)
    return shared


def _digest_of(path: Path, digest) -> None:
    """The bytes of a file, or of every file under a directory with its relative name."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)


def compiled_once(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, target: str, quant: str,
                  **options) -> Path:
    """The artifact of compile_model(CompileOptions(checkpoint, target, quant, **options)), compiled the first time
    any test of this run asks for it."""
    options = {"progress": False, **options}
    digest = hashlib.sha256()
    _digest_of(Path(checkpoint), digest)
    target_file = Path(target)
    if target_file.suffix == ".toml" and target_file.is_file():
        _digest_of(target_file, digest)
    else:
        digest.update(target.encode())
    digest.update(json.dumps([quant, options, os.environ.get("MOBILEC_TUNING_LOGS")], sort_keys=True).encode())
    shared = _shared_root(tmp_path_factory)
    out = shared / f"{target_file.stem}-{quant}-{digest.hexdigest()[:16]}"
    with (shared / f"{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            compile_model(CompileOptions(str(checkpoint), target, quant, str(out), **options))
    return out


def tiny_compiled_once(tmp_path_factory: pytest.TempPathFactory, model_name: str, target: str, quant: str,
                       **options) -> Path:
    """compiled_once for the tiny model `model_name` of tests/helpers/tiny_models.py (seed 0, as built)."""
    root = tmp_path_factory.mktemp(f"{model_name}-checkpoint")
    checkpoint = save_compilable_checkpoint(build_model(model_name), root / "hf")
    return compiled_once(tmp_path_factory, checkpoint, target, quant, **options)

