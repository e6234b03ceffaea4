"""Phone GPU artifacts over RPC, as with a phone: a tiny Llama built for android-adreno with `--host-target host
--compute-dtype float32` is benched through a tracker on an RPC server started with our OpenCL device
(`--load-library`), and its kernels are tuned there by MetaSchedule's RPC runner.

The benched tokens equal the local Session's; a server without the library is a one-line error naming the fix
(negative control). Tuning writes measured records, and compile applies a record that measured faster and declines
one that measured slower. Timings on PoCL mean nothing for a phone; the workflow and the numerics do.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from compiler import tuning_log
from compiler.artifacts.artifact import load_artifact
from compiler.commands.cli import main
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.commands.tune import TuneOptions, tune
from compiler.runtime import opencl_device
from compiler.runtime.bench import generate, prompt_ids
from compiler.runtime.session import Session
from compiler.testing.local_rpc import start_server, start_tracker, wait_until_free
from tests.helpers.assertions import assert_mobilec_error
from tests.helpers.pocl_device import (
    FP16_PLATFORM,
    NEEDS_OPENCL,
    NEEDS_X86_FOR_FP16,
    ON_FP16_OPENCL,
    ON_POCL,
    fp16_platform_installed,
)
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

pytestmark = [pytest.mark.slow,  # three compiles, a tuning run and RPC servers: ~3 minutes on 2 cores
              NEEDS_OPENCL]

TARGET, QUANT = "android-adreno", "q4f32_g32"
OPENCL_KEY, PLAIN_KEY = "mobilec-opencl", "mobilec-plain"
PROMPT_LEN, GEN_LEN = 12, 8
GEMV = "fused_dequantize4_NT_matmul4"  # the MLP's down projection, once per layer and decode step
TRIALS = 2
FP16_QUANT, FP16_KEY = "q4f16_g32", "mobilec-opencl-fp16"
# the down projection's float16 form (its residual add inside; it reads SwiGLU's result, not a norm, so it stays a
# kernel of its own: passes/fuse_gemv_norms.py)
FP16_GEMV = "fused_fused_dequantize3_NT_matmul3_cast1_add"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_over_rpc")
    save_compilable_checkpoint(build_model("llama_gqa"), root / "hf")
    return root


def _compile(root, name: str, tuning_logs=None, quant: str = QUANT, here=ON_POCL) -> tuple[str, dict]:
    """An android-adreno artifact that runs here (`here`: the options that make it run on this machine's OpenCL),
    and compile's summary; with tuning_logs, compiled with them."""
    with pytest.MonkeyPatch.context() as env:
        if tuning_logs is not None:
            env.setenv(tuning_log.TUNING_LOGS_ENV, str(tuning_logs))
        summary = compile_model(CompileOptions(str(root / "hf"), TARGET, quant, str(root / name), context_window=64,
                                               progress=False, no_tuning=tuning_logs is None, **here))
    return str(root / name), summary


@pytest.fixture(scope="module")
def artifact(checkpoint) -> str:
    return _compile(checkpoint, "adreno-here")[0]


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """A loopback tracker with two RPC servers: one started with our OpenCL device, one without."""
    tmp = tmp_path_factory.mktemp("tracker")
    tracker_proc, port = start_tracker(tmp / "tracker.log")
    processes = [tracker_proc]
    try:
        for key, extra in ((OPENCL_KEY, ("--load-library", str(opencl_device.library_path()))), (PLAIN_KEY, ())):
            processes.append(start_server(tmp / f"{key}.log", port, key, extra)[0])
        wait_until_free(port, {OPENCL_KEY: 1, PLAIN_KEY: 1}, processes[1:])
        yield f"127.0.0.1:{port}"
    finally:
        for process in processes:
            process.kill()


def _local_tokens(path: str) -> list[int]:
    """The bench's greedy tokens from a Session in this process (its kernels on this machine's OpenCL)."""
    artifact = load_artifact(path)
    ids = prompt_ids(int(artifact.config["model"]["config"]["vocab_size"]), PROMPT_LEN, 0)
    return generate(Session(artifact), ids, GEN_LEN).tokens


def _bench(path: str, tracker: str, key: str):
    return CliRunner().invoke(main, ["bench", path, "--tracker", tracker, "--key", key, "--prompt-len",
                                     str(PROMPT_LEN), "--gen-len", str(GEN_LEN), "--repeat", "1",
                                     "--session-timeout", "120", "--json"])


def test_bench_over_rpc_runs_the_kernels_on_the_servers_opencl(artifact, tracker):
    result = _bench(artifact, tracker, OPENCL_KEY)
    assert result.exit_code == 0, result.output
    bench = json.loads(result.stdout)
    assert bench["device"]["kind"] == "tracker" and bench["device"]["kernels_on"] == "opencl"
    assert bench["tokens"] == _local_tokens(artifact)
    assert bench["decode_tok_s_device"] > 0


def test_a_server_without_the_opencl_device_is_told_how_to_start(artifact, tracker):
    result = _bench(artifact, tracker, PLAIN_KEY)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "has no OpenCL device" in lines[0] and "mobilec device-server" in lines[0]


def _set_latencies(logs, default_us: float, tuned_us: float) -> None:
    """As if tune had measured these (PoCL's timings say nothing of a phone; the decision is what is checked)."""
    directory = logs / TARGET
    selection = tuning_log.read_selection(directory, "")
    (entry,) = selection.values()
    entry.update(default_us=default_us, tuned_us=tuned_us)
    tuning_log.write_selection(directory, selection)


@pytest.mark.extended  # ~5 minutes: tuning on PoCL and two more compiles
def test_tuning_on_the_rpc_servers_opencl_and_compile_follows_the_log(checkpoint, artifact, tracker, tmp_path,
                                                                       monkeypatch):
    logs = tmp_path / "tuning_logs"
    monkeypatch.setenv(tuning_log.TUNING_LOGS_ENV, str(logs))
    summary = tune(TuneOptions(str(checkpoint / "hf"), TARGET, QUANT, TRIALS, tracker=tracker, key=OPENCL_KEY,
                               kernel_patterns=[GEMV], **ON_POCL))
    (row,) = summary["kernels"]
    assert summary["measured_on"].startswith("1 device(s) with key 'mobilec-opencl'")
    assert row["functions"] == [GEMV] and row["trials"] == TRIALS
    assert row["default_us"] > 0 and row["tuned_us"] > 0
    log = tuning_log.read_log(logs / TARGET, "")
    (key,) = log.workloads
    measured = [r for r in log.records_for(key) if r.mean_us is not None]
    assert measured, "no record measured on the server"
    assert {r.json[2]["kind"] for r in log.records} == {"opencl"}

    _set_latencies(logs, default_us=1e6, tuned_us=1.0)
    tuned, compiled = _compile(checkpoint, "tuned", logs)
    assert compiled["tuned_kernels"] == [GEMV]
    assert _local_tokens(tuned) == _local_tokens(artifact)
    _set_latencies(logs, default_us=1.0, tuned_us=1e6)  # negative control: slower than our rules
    assert _compile(checkpoint, "declined", logs)[1]["tuned_kernels"] == []


@NEEDS_X86_FOR_FP16
def test_tuning_a_float16_kernel_on_a_servers_fp16_opencl(checkpoint, tmp_path, monkeypatch):
    """The phones' float16 default (q4f16_g32, no --compute-dtype): a short MetaSchedule run on the same GEMV (its
    float16 form) measured on an RPC server whose OpenCL is Intel's runtime (cl_khr_fp16); compile applies the record
    (forced faster) and the tuned artifact, benched on that server, gives the untuned one's tokens."""
    fp16_platform_installed()
    logs = tmp_path / "tuning_logs"
    monkeypatch.setenv(tuning_log.TUNING_LOGS_ENV, str(logs))
    tracker_proc, port = start_tracker(tmp_path / "tracker.log")
    processes = [tracker_proc]
    try:
        processes.append(start_server(tmp_path / "server.log", port, FP16_KEY,
                                      ("--load-library", str(opencl_device.library_path())), env=FP16_PLATFORM)[0])
        wait_until_free(port, {FP16_KEY: 1}, processes[1:])
        tracker = f"127.0.0.1:{port}"
        summary = tune(TuneOptions(str(checkpoint / "hf"), TARGET, FP16_QUANT, TRIALS, tracker=tracker,
                                   key=FP16_KEY, kernel_patterns=[FP16_GEMV], **ON_FP16_OPENCL))
        (row,) = summary["kernels"]
        assert row["functions"] == [FP16_GEMV] and row["default_us"] > 0 and row["tuned_us"] > 0
        log = tuning_log.read_log(logs / TARGET, "")
        assert any(r.mean_us is not None for r in log.records), "no record measured on the server"
        assert {r.json[2]["kind"] for r in log.records} == {"opencl"}
        _set_latencies(logs, default_us=1e6, tuned_us=1.0)
        tokens = {}
        for name, tuning_logs in (("fp16-default", None), ("fp16-tuned", logs)):
            path, compiled = _compile(checkpoint, name, tuning_logs, FP16_QUANT, ON_FP16_OPENCL)
            assert compiled["tuned_kernels"] == ([FP16_GEMV] if tuning_logs else [])
            result = _bench(path, tracker, FP16_KEY)
            assert result.exit_code == 0, result.output
            tokens[name] = json.loads(result.stdout)["tokens"]
        assert tokens["fp16-tuned"] == tokens["fp16-default"]
    finally:
        for process in processes:
            process.kill()


def test_tuning_opencl_kernels_without_a_tracker_is_told_to_pass_one(checkpoint):
    assert_mobilec_error(lambda: tune(TuneOptions(str(checkpoint / "hf"), TARGET, QUANT, TRIALS, **ON_POCL)),
                         "kernels run on OpenCL", "--tracker HOST:PORT --key KEY", "mobilec device-server")
