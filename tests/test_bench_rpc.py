"""`mobilec bench` in this process and through TVM RPC on loopback (a server, and a tracker with a key).

The greedy tokens made on the device equal a local Session's; shards are uploaded once, skipped by sha256 and
re-sent when changed; a device killed mid-bench, an unknown key, an unreachable address, a library for another
architecture and an artifact too big for the device all end in one-line errors. Every bench that reaches the
device runs as a subprocess with a timeout, so a hang fails the test instead of stalling the suite; every
server and tracker runs in its own process group and is killed with it, and ends with the test run even when that
is killed (compiler/testing/processes.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from compiler.artifacts.artifact import CONFIG_FILE, PARAMS_DIR, PARAMS_INDEX, file_manifest, load_artifact
from compiler.commands.cli import main
from compiler.runtime.bench import prompt_ids
from compiler.runtime.remote import slot_name
from compiler.runtime.session import Session
from compiler.target.targets import load_target
from compiler.testing.local_rpc import LocalProcess, free_port, start_server, start_tracker, wait_until_free
from tests.helpers.compiled_once import tiny_compiled_once

pytestmark = pytest.mark.slow  # RPC servers and compiled models: ~2 minutes

PROMPT_LEN, GEN_LEN = 12, 8
BENCH_ARGS = ["--prompt-len", str(PROMPT_LEN), "--gen-len", str(GEN_LEN), "--repeat", "2"]
KEY = "mobilec-test"
SESSION_TIMEOUT_S = 60
BENCH_TIMEOUT_S = 120  # a bench subprocess that runs longer is hanging


def _start_server(tmp: Path, tracker_port: int | None = None) -> tuple[LocalProcess, str, Path]:
    """An RPC server whose work directories (and what bench keeps beside them) are under tmp/device."""
    device_dir = tmp / "device"
    device_dir.mkdir()
    server, address = start_server(tmp / "server.log", tracker_port, KEY, env={"TMPDIR": str(device_dir)})
    return server, address, device_dir


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory) -> Path:
    return tiny_compiled_once(tmp_path_factory, "llama_gqa", "host", "q0f32", context_window=64)


@pytest.fixture(scope="module")
def rpc_server(tmp_path_factory):
    server, address, device_dir = _start_server(tmp_path_factory.mktemp("rpc"))
    yield address, device_dir
    server.kill()


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """A tracker on loopback with one RPC server registered under KEY."""
    tmp = tmp_path_factory.mktemp("tracker")
    tracker_proc, port = start_tracker(tmp / "tracker.log")
    server = None
    try:
        server, _, _ = _start_server(tmp, tracker_port=port)
        wait_until_free(port, {KEY: 1}, [server])
        yield f"127.0.0.1:{port}"
    finally:
        if server is not None:
            server.kill()
        tracker_proc.kill()


def _copy(artifact: Path, tmp_path: Path) -> Path:
    """A copy in its own directory: on the device it gets its own files, so each test starts from none."""
    return Path(shutil.copytree(artifact, tmp_path / "tiny"))


def _bench(artifact: Path, *args: str, timeout: float = BENCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compiler", "bench", str(artifact), *args],
                          capture_output=True, text=True, timeout=timeout)


def _bench_in_process(artifact: Path, *args: str) -> subprocess.CompletedProcess:
    """For errors raised before anything runs on the device (no hang to guard against): saves the start-up."""
    result = CliRunner().invoke(main, ["bench", str(artifact), *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback reached the user: that is the bug
    return subprocess.CompletedProcess(["bench", *args], result.exit_code, result.stdout, result.stderr)


def _bench_json(artifact: Path, *args: str) -> dict:
    result = _bench(artifact, *BENCH_ARGS, "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mobilec: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _session_tokens(artifact: Path) -> list[int]:
    """Greedy tokens of compiler/runtime/session.py in this process, for the bench's prompt."""
    art = load_artifact(artifact)
    session = Session(art)
    ids = prompt_ids(art.config["model"]["config"]["vocab_size"], PROMPT_LEN, seed=0)
    tokens = [int(np.argmax(session.prefill(ids)))]
    while len(tokens) < GEN_LEN:
        tokens.append(int(np.argmax(session.decode(tokens[-1]))))
    return tokens


def _assert_sane(result: dict) -> None:
    assert result["ttft_ms"] > 0 and result["prefill_tok_s"] > 0
    assert result["decode_tok_s"] > 0 and result["decode_tok_s_p90"] > 0 and result["decode_tok_s_device"] > 0
    assert result["decode_tok_s_p90"] <= result["decode_tok_s"] * 1.000001  # the slow tail
    # targets/host.toml: this machine's bandwidth, measured once and cached
    assert result["bytes_per_token"] > 0 and result["memory_bandwidth_gbs"] == load_target("host").device["memory_bandwidth_gbs"]
    assert 0 < result["roofline_fraction"] <= 1
    assert result["achieved_gbs"] == pytest.approx(result["bytes_per_token"] * result["decode_tok_s"] / 1e9)
    assert len(result["tokens"]) == GEN_LEN


def _device_files(device_dir: Path, artifact: Path) -> dict[str, str]:
    """The files bench keeps on the device for this artifact, by name, with their sha256."""
    prefix = slot_name(load_artifact(artifact, verify_checksums=False)) + "."
    return {p.name[len(prefix):]: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in device_dir.iterdir() if p.name.startswith(prefix)}


def _rewrite_norm_weight(artifact: Path) -> str:
    """Scale the final norm weight in its shard and update the shard's sha256; returns the shard's name."""
    index = json.loads((artifact / PARAMS_INDEX).read_text())
    entry = next(t for t in index["tensors"] if t["name"] == "model.norm.weight")
    shard = artifact / PARAMS_DIR / entry["shard"]
    data = bytearray(shard.read_bytes())
    end = entry["offset"] + entry["nbytes"]
    data[entry["offset"]:end] = (np.frombuffer(data[entry["offset"]:end], "float32") * -3.0).tobytes()
    shard.write_bytes(data)
    next(s for s in index["shards"] if s["file"] == entry["shard"])["sha256"] = hashlib.sha256(data).hexdigest()
    (artifact / PARAMS_INDEX).write_text(json.dumps(index))
    config = json.loads((artifact / CONFIG_FILE).read_text())  # the artifact's list of its files, as compile writes it
    config["files"] = file_manifest(artifact)
    (artifact / CONFIG_FILE).write_text(json.dumps(config))
    return entry["shard"]


def test_rpc_tokens_equal_local_session_and_shards_upload_once(tiny_artifact, rpc_server, tmp_path):
    address, device_dir = rpc_server
    artifact = _copy(tiny_artifact, tmp_path)
    first = _bench_json(artifact, "--rpc", address)
    assert first["tokens"] == _session_tokens(artifact)
    _assert_sane(first)
    assert first["device"]["kind"] == "rpc" and first["device"]["address"] == address
    assert first["device"]["triple"].startswith("x86_64") and first["device"]["arch"] == "x86_64"
    assert first["cpu_check"]["features_checked"]  # the server's TVM has LLVM: it reports its CPU's features
    assert first["peak_mem_mb"] is None and "RPC" in first["peak_mem_note"]
    shards = [s["file"] for s in load_artifact(artifact).index["shards"]]
    assert sorted(first["upload"]["uploaded_files"]) == sorted(["model.so", *shards])
    assert first["upload"]["uploaded"] == len(shards) + 1 and first["upload"]["skipped"] == 0
    local = {"model.so": hashlib.sha256((artifact / "lib" / "model.so").read_bytes()).hexdigest(),
             **{s: hashlib.sha256((artifact / PARAMS_DIR / s).read_bytes()).hexdigest() for s in shards}}
    assert {k: v for k, v in _device_files(device_dir, artifact).items() if k in local} == local

    second = _bench_json(artifact, "--rpc", address)
    assert second["upload"]["uploaded"] == 0 and second["upload"]["bytes"] == 0
    assert sorted(second["upload"]["skipped_files"]) == sorted(local)
    assert second["tokens"] == first["tokens"]

    changed = _rewrite_norm_weight(artifact)
    third = _bench_json(artifact, "--rpc", address)
    assert third["upload"]["uploaded_files"] == [changed]
    # The device computed with the new shard: its tokens are the local Session's on the changed weights.
    assert third["tokens"] == _session_tokens(artifact) != first["tokens"]


def test_tracker_with_key_tokens_equal_local_session(tiny_artifact, tracker, tmp_path):
    result = _bench_json(tiny_artifact, "--tracker", tracker, "--key", KEY)
    assert result["tokens"] == _session_tokens(tiny_artifact)
    _assert_sane(result)
    assert result["device"]["kind"] == "tracker" and result["device"]["key"] == KEY


def test_unknown_key_lists_the_trackers_keys(tiny_artifact, tracker):
    _assert_one_line_error(_bench_in_process(tiny_artifact, *BENCH_ARGS, "--tracker", tracker, "--key",
                                             "no-such-phone"), "'no-such-phone'", f"its keys: {KEY}")


def test_unreachable_server_and_tracker_fail_fast(tiny_artifact):
    port = free_port()
    _assert_one_line_error(_bench(tiny_artifact, *BENCH_ARGS, "--rpc", f"127.0.0.1:{port}", timeout=30),
                           f"cannot connect to the RPC server at 127.0.0.1:{port}", "rpc_server",
                           f"--port {port} --port-end {port + 1}", "mobilec device-server")
    _assert_one_line_error(_bench(tiny_artifact, *BENCH_ARGS, "--tracker", f"127.0.0.1:{port}", "--key", KEY,
                                  timeout=30), f"cannot reach the RPC tracker at 127.0.0.1:{port}", "rpc_tracker")


def test_device_killed_mid_bench_is_an_error_not_a_hang(tiny_artifact, tmp_path):
    server, address, _ = _start_server(tmp_path)
    try:
        bench = subprocess.Popen([sys.executable, "-m", "compiler", "bench", str(tiny_artifact), "--rpc", address,
                                  *BENCH_ARGS, "--sustained", "60", "--session-timeout", str(SESSION_TIMEOUT_S)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            server.wait_for("load_module")  # the device has the library: the bench is running there
            time.sleep(1.0)  # inside the sustained decode
            server.kill()
            killed = time.monotonic()
            stdout, stderr = bench.communicate(timeout=SESSION_TIMEOUT_S)
        finally:
            bench.kill()
    finally:
        server.kill()
    assert time.monotonic() - killed < SESSION_TIMEOUT_S
    _assert_one_line_error(subprocess.CompletedProcess(bench.args, bench.returncode, stdout, stderr),
                           f"lost the connection to the RPC server at {address}", "still running")


def test_session_timeout_ends_the_bench(tiny_artifact, rpc_server):
    """The server ends a session that outlives --session-timeout; the bench says so instead of hanging."""
    address, _ = rpc_server
    result = _bench(tiny_artifact, *BENCH_ARGS, "--rpc", address, "--sustained", "60", "--session-timeout", "5",
                    timeout=SESSION_TIMEOUT_S)
    _assert_one_line_error(result, "ran past --session-timeout 5 s", "raise --session-timeout")


def test_too_big_for_the_device_is_refused_before_upload(tiny_artifact, rpc_server, tmp_path):
    address, device_dir = rpc_server
    artifact = _copy(tiny_artifact, tmp_path)
    config = json.loads((artifact / CONFIG_FILE).read_text())
    config.setdefault("memory_estimate", {})["total_bytes"] = 2 * 2**20  # `mobilec compile` writes the estimate
    (artifact / CONFIG_FILE).write_text(json.dumps(config))
    _assert_one_line_error(_bench_in_process(artifact, *BENCH_ARGS, "--rpc", address, "--device-ram-mb", "1"),
                           "needs an estimated 2 MB but the device has 1 MB (--device-ram-mb)", "1 MB too many")
    assert _device_files(device_dir, artifact) == {}


def test_library_for_another_architecture_is_refused_before_upload(tiny_artifact, rpc_server, tmp_path):
    address, device_dir = rpc_server
    artifact = _copy(tiny_artifact, tmp_path)
    config = json.loads((artifact / CONFIG_FILE).read_text())
    config["target"]["tvm_target"]["mtriple"] = "aarch64-linux-gnu"
    config["cpu"]["arch"] = "aarch64"  # what an aarch64 target records (compiler/target/cpu_check.py)
    (artifact / CONFIG_FILE).write_text(json.dumps(config))
    _assert_one_line_error(_bench_in_process(artifact, *BENCH_ARGS, "--rpc", address), "built for aarch64", "is x86_64")
    assert _device_files(device_dir, artifact) == {}


def test_local_device_with_sustained_run_and_plot(tiny_artifact, tmp_path):
    plot = tmp_path / "sustained.png"
    result = _bench_json(tiny_artifact, "--device", "local", "--sustained", "3", "--plot", str(plot))
    assert result["tokens"] == _session_tokens(tiny_artifact)
    _assert_sane(result)
    assert result["device"]["kind"] == "local" and result["peak_mem_mb"] > 0
    sustained = result["sustained"]
    assert sustained["t_s"] == [0.0, 1.0, 2.0] and all(rate > 0 for rate in sustained["tok_s"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_option_errors(tiny_artifact):
    _assert_one_line_error(_bench_in_process(tiny_artifact, "--plot", "x.png"), "--sustained")
    _assert_one_line_error(_bench_in_process(tiny_artifact, "--tracker", "127.0.0.1:1"), "--key")
    _assert_one_line_error(_bench_in_process(tiny_artifact, "--prompt-len", "60", "--gen-len", "8"),
                           "context window of 64")
