"""The artifact's weight shards, index and atomic write, and the checks made when reading one back."""

import json

import numpy as np
import pytest

from compiler.artifacts import artifact as art
from compiler.artifacts.export import ShardWriter, atomic_directory
from compiler.errors import MobilecError


def _write_fake_artifact(root, tensors, versions=None):
    writer = ShardWriter(root / art.PARAMS_DIR)
    for name, array in tensors.items():
        writer.add(name, array)
    writer.finish(root)
    (root / art.LIBRARY_DIR).mkdir()
    (root / art.LIBRARY_DIR / "model.so").write_bytes(b"\x7fELF")
    config = {"format_version": art.FORMAT_VERSION, "library": "lib/model.so",
              "versions": versions or art.installed_versions(), "context_window": 64, "prefill_chunk": 64,
              "page_size": 16, "files": art.file_manifest(root)}
    (root / art.CONFIG_FILE).write_text(json.dumps(config))


def test_shards_align_every_tensor_and_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr("compiler.artifacts.export.SHARD_BYTES", 4096)  # force several shards
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((7, 100 + i)).astype(dt) for i, dt in enumerate(["float32", "float16"] * 5)}
    _write_fake_artifact(tmp_path, tensors)
    loaded = art.load_artifact(tmp_path)
    index = loaded.index
    assert len(index["shards"]) > 1
    assert all(t["offset"] % art.ALIGNMENT == 0 for t in index["tensors"])
    for shard in index["shards"]:
        assert shard["sha256"] == art.sha256_file(tmp_path / art.PARAMS_DIR / shard["file"])
    for (name, want), got in zip(tensors.items(), loaded.load_params()):
        assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_corrupted_shard_is_refused(tmp_path):
    _write_fake_artifact(tmp_path, {"w": np.arange(64, dtype="float32")})
    shard = tmp_path / art.PARAMS_DIR / "shard_000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(MobilecError, match="shard_000.bin fails its sha256 check"):
        art.load_artifact(tmp_path)


def test_version_skew_is_refused_naming_the_package(tmp_path):
    versions = {**art.installed_versions(), "apache-tvm": "0.0.1"}
    _write_fake_artifact(tmp_path, {"w": np.zeros(4, "float32")}, versions)
    with pytest.raises(MobilecError, match=r"apache-tvm 0\.0\.1 \(installed"):
        art.load_artifact(tmp_path)


def test_missing_artifact_is_a_clear_error(tmp_path):
    with pytest.raises(MobilecError, match="does not exist"):
        art.load_artifact(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MobilecError, match="not a mobilec artifact"):
        art.load_artifact(tmp_path / "empty")


def _fake_artifact_body(tmp, text):
    (tmp / "a").write_text(text)
    (tmp / art.CONFIG_FILE).write_text(json.dumps({"format_version": art.FORMAT_VERSION,
                                                   "files": art.file_manifest(tmp)}))


def test_atomic_directory_leaves_nothing_on_failure_and_keeps_the_old_one(tmp_path):
    final = tmp_path / "out"
    with atomic_directory(final) as tmp:
        _fake_artifact_body(tmp, "first")
    assert (final / "a").read_text() == "first"
    with pytest.raises(RuntimeError), atomic_directory(final, overwrite=True) as tmp:
        _fake_artifact_body(tmp, "second")
        raise RuntimeError("compile failed")
    assert (final / "a").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_directory(final, overwrite=True) as tmp:
        (tmp / "b").write_text("third")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
