"""Every file of an artifact is listed in its config with its size and sha256, the library included, and checked
before anything is loaded: a truncated or changed library, tokenizer, index or shard is one line (not a bus error
or a traceback), as are a config whose values or file list were tampered with. An intact artifact still loads and
generates, and the check stays fast."""

from __future__ import annotations

import json
import time

import pytest

from compiler.artifacts.artifact import CONFIG_FILE, FORMAT_VERSION, PARAMS_INDEX, load_artifact
from compiler.errors import MobilecError
from tests.robustness.conftest import one_line_error, run_cli, run_subprocess

pytestmark = pytest.mark.slow  # compiles and corrupts artifacts: ~1 minute

GENERATE = ["--prompt", "the cat", "--max-new-tokens", "2", "--json"]


def _config(artifact):
    return json.loads((artifact / CONFIG_FILE).read_text())


def _write_config(artifact, config):
    (artifact / CONFIG_FILE).write_text(json.dumps(config))


def test_every_file_is_listed_with_its_sha256(tiny_artifact):
    config = _config(tiny_artifact)
    files = {p.relative_to(tiny_artifact).as_posix() for p in tiny_artifact.rglob("*") if p.is_file()}
    assert set(config["files"]) == files - {CONFIG_FILE}
    assert config["library"] in config["files"] and PARAMS_INDEX in config["files"]
    assert config["format_version"] == FORMAT_VERSION
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in config["files"].values())


def test_intact_artifact_loads_fast_and_generates(tiny_artifact):
    started = time.perf_counter()
    load_artifact(tiny_artifact)
    assert time.perf_counter() - started < 2.0
    result = run_cli(["generate", tiny_artifact, *GENERATE])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["token_ids"]) == 2


@pytest.mark.parametrize("cut", [0.5, 0.01])
def test_truncated_library_is_one_line_not_a_bus_error(artifact_copy, cut):
    lib = artifact_copy / "lib" / "model.so"
    data = lib.read_bytes()
    lib.write_bytes(data[: int(len(data) * cut)])
    # a separate process: loading the cut library in this one could kill the test run with SIGBUS
    result = run_subprocess(["generate", artifact_copy, *GENERATE], timeout=120)
    one_line_error(result, "compiled library", "model.so", "truncated")
    with pytest.raises(MobilecError, match="truncated"):  # sizes are checked even without the hashes
        load_artifact(artifact_copy, verify_checksums=False)


def test_changed_bytes_in_the_library_fail_its_sha256(artifact_copy):
    lib = artifact_copy / "lib" / "model.so"
    data = bytearray(lib.read_bytes())
    # inverted, not zeroed: the library has runs of zero padding, and zeros written over one changed nothing
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    lib.write_bytes(bytes(data))
    one_line_error(run_subprocess(["generate", artifact_copy, *GENERATE], timeout=120), "model.so", "sha256")


@pytest.mark.parametrize("name", ["tokenizer/tokenizer.json", PARAMS_INDEX, "params/shard_000.bin"])
def test_any_changed_file_is_refused(artifact_copy, name):
    path = artifact_copy / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    one_line_error(run_cli(["generate", artifact_copy, *GENERATE]), name.split("/")[-1], "sha256")


def test_missing_file_is_refused(artifact_copy):
    (artifact_copy / "tokenizer" / "tokenizer.json").unlink()
    one_line_error(run_cli(["generate", artifact_copy, *GENERATE]), "tokenizer.json", "missing")


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(library="../../../etc/passwd"), "names no library inside the artifact"),
    (lambda c: c.update(library="/tmp/evil.so"), "names no library inside the artifact"),
    (lambda c: c["files"].pop(c["library"]), "does not list"),
    (lambda c: c.pop("files"), "no valid list of the artifact's files"),
    (lambda c: c["files"].update({"../outside": {"bytes": 1, "sha256": "0" * 64}}), "no valid list"),
    (lambda c: c.update(context_window="abc"), "'context_window' must be a positive whole number"),
    (lambda c: c.update(page_size=0), "'page_size' must be a positive whole number"),
    (lambda c: c.update(format_version=1), "artifact format 1"),
])
def test_tampered_config_is_one_line(artifact_copy, edit, needle):
    config = _config(artifact_copy)
    edit(config)
    _write_config(artifact_copy, config)
    one_line_error(run_cli(["generate", artifact_copy, *GENERATE]), needle)


def test_config_that_is_not_an_object_is_one_line(artifact_copy):
    (artifact_copy / CONFIG_FILE).write_text("[1, 2]")
    one_line_error(run_cli(["generate", artifact_copy, *GENERATE]), "not a JSON object")


def test_every_command_checks_before_loading(artifact_copy, tmp_path):
    lib = artifact_copy / "lib" / "model.so"
    lib.write_bytes(lib.read_bytes()[:1000])
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat " * 10)
    for args in (["profile", artifact_copy, "--steps", "1", "--context-len", "4"],
                 ["bench", artifact_copy, "--prompt-len", "4", "--gen-len", "2", "--repeat", "1"],
                 ["eval", artifact_copy, "--text", text]):
        one_line_error(run_subprocess(args, timeout=120), "model.so", "truncated")
