"""`mobilec tune`: MetaSchedule tunes a tiny model's decode kernels into a tuning log that compile applies.

A few trials per kernel, so the tuned schedules are whatever the search found first; the flow is what is
checked. On this machine the database gets one record per trial and compile schedules the kernel from the
record the log picked (the compiled kernel is that record's schedule; logits still match the quantized float
reference). Through a tracker, two RPC servers both measure. A run killed with SIGKILL resumes without redoing a
finished kernel. A corrupt file is a one-line error, and a record that measured slower than the default rules is
not applied (negative control). Every process started here runs in its own process group and is killed with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tvm_ffi
from click.testing import CliRunner

from compiler import tuning_log
from compiler.artifacts.artifact import load_artifact
from compiler.codegen import pipeline
from compiler.commands.cli import main
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.commands.tune import TuneOptions, tune
from compiler.loaders import open_checkpoint
from compiler.model_import.importer import import_model
from compiler.passes.apply_tuning_database import TUNED_ATTR
from compiler.quantization.schemes import SCHEMES
from compiler.runtime.session import Session
from compiler.target.build_plan import resolve_plan
from compiler.testing.local_rpc import start_server, start_tracker, wait_until_free
from compiler.testing.processes import spawn
from compiler.torch_hidden import worker_environ
from tests.helpers.assertions import without_progress
from tests.helpers.reference import fake_quantized, reference_greedy
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

pytestmark = pytest.mark.slow  # MetaSchedule tuning runs and RPC servers: ~8 minutes on 2 cores

QUANT = "q4f16_g32"
TRIALS = 4
MODEL = "llama_mha_untied"  # its int4 build equals numpy's quantize-dequantize model to ~1e-6
GEMV = "fused_dequantize3_NT_matmul8"  # the MLP's down projection, 80 -> 48, once per layer and decode step
PROMPT = [3, 7, 1, 4, 4, 9, 2, 5, 6, 8]
RPC_KEY = "mobilec-tune-test"
TUNE_TIMEOUT_S = 300  # a tuning subprocess that runs longer is hanging


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    model = build_model(MODEL)
    save_compilable_checkpoint(model, root / "hf")
    return model, root / "hf"


@pytest.fixture(scope="module")
def tuned(tiny, tmp_path_factory):
    """One host tuning run of GEMV: (its tuning_logs root, its summary)."""
    logs = tmp_path_factory.mktemp("tuned") / "tuning_logs"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(tuning_log.TUNING_LOGS_ENV, str(logs))
        summary = tune(TuneOptions(str(tiny[1]), "host", QUANT, TRIALS, kernel_patterns=[GEMV]))
    return logs, summary


@pytest.fixture
def logs_copy(tuned, tmp_path, monkeypatch) -> Path:
    """A copy of the tuned log that this test may edit, in effect for compile; returns its host directory."""
    root = tmp_path / "tuning_logs"
    shutil.copytree(tuned[0], root)
    monkeypatch.setenv(tuning_log.TUNING_LOGS_ENV, str(root))
    return root / "host"


def _edit_selection(directory: Path, **latencies_us) -> dict:
    """Set the GEMV's measured latencies in mobilec-tuned.json, e.g. as if the default rules had been slower."""
    selection = tuning_log.read_selection(directory, "")
    (entry,) = selection.values()
    entry.update(latencies_us)
    tuning_log.write_selection(directory, selection)
    return entry


def _kernels_after(hf: Path, **run_options) -> dict[str, dict]:
    """The IR after each pipeline step of the tiny model, by step name."""
    plan = resolve_plan("host", QUANT)
    with open_checkpoint(hf) as ckpt:
        mod = import_model(ckpt, plan, 64).mod
    seen = {}
    pipeline.run_steps(mod, plan, lambda _i, name, m: seen.__setitem__(name, m), **run_options)
    return seen


def test_tuning_writes_a_record_per_trial_and_compile_follows_the_comparison(tiny, tuned, tmp_path, monkeypatch):
    logs, summary = tuned
    (row,) = summary["kernels"]
    assert row["functions"] == [GEMV] and row["calls"] == {"decode": 2} and row["trials"] == TRIALS
    assert row["default_us"] > 0 and row["tuned_us"] > 0
    directory = logs / "host"
    log = tuning_log.read_log(directory, "")
    (key,) = log.workloads
    assert len(log.records_for(key)) == TRIALS
    entry = tuning_log.read_selection(directory, "")[key]
    assert entry["record"] == log.best(key).key and entry["kernels"] == [GEMV]
    assert row["applied"] == (entry["tuned_us"] < entry["default_us"])

    monkeypatch.setenv(tuning_log.TUNING_LOGS_ENV, str(logs))
    compiled = compile_model(CompileOptions(str(tiny[1]), "host", QUANT, str(tmp_path / "art"), context_window=64,
                                            progress=False, kv_dtype="f32"))
    assert compiled["tuned_kernels"] == ([GEMV] if row["applied"] else [])


def test_compile_schedules_the_kernel_from_its_record(tiny, logs_copy, tmp_path):
    model, hf = tiny
    entry = tuning_log.read_selection(logs_copy, "")
    (key,) = entry
    _edit_selection(logs_copy, default_us=entry[key]["tuned_us"] * 10)  # as if our rules were 10x slower
    seen = _kernels_after(hf, tuning=True)
    kernel = seen[pipeline.APPLY_TUNING_STEP][GEMV]
    log = tuning_log.read_log(logs_copy, "")
    (record,) = [r for r in log.records if r.key == kernel.attrs[TUNED_ATTR]]
    assert record.key == entry[key]["record"]
    assert tvm_ffi.structural_equal(kernel.body, log.schedule(record)["main"].body, map_free_vars=True)
    untuned = _kernels_after(hf)["schedule"][GEMV]
    assert not tvm_ffi.structural_equal(seen["schedule"][GEMV].body, untuned.body, map_free_vars=True)

    compiled = compile_model(CompileOptions(str(hf), "host", QUANT, str(tmp_path / "art"), context_window=64,
                                            progress=False, kv_dtype="f32"))
    assert compiled["tuned_kernels"] == [GEMV]
    session = Session(load_artifact(tmp_path / "art"))
    tokens, _, decode_logits = reference_greedy(fake_quantized(model, SCHEMES[QUANT].layout), PROMPT, 4)
    session.reset()
    session.prefill_all_logits(PROMPT)
    for token, want in zip(tokens[:-1], decode_logits):
        got = session.decode(token)
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_negative_control_a_record_slower_than_the_default_is_not_applied(tiny, logs_copy, tmp_path):
    entry = tuning_log.read_selection(logs_copy, "")
    (key,) = entry
    _edit_selection(logs_copy, tuned_us=entry[key]["default_us"] * 10)
    seen = _kernels_after(tiny[1], tuning=True)
    untuned = _kernels_after(tiny[1])
    assert TUNED_ATTR not in seen[pipeline.APPLY_TUNING_STEP][GEMV].attrs
    assert tvm_ffi.structural_equal(seen["schedule"][GEMV].body, untuned["schedule"][GEMV].body, map_free_vars=True)
    compiled = compile_model(CompileOptions(str(tiny[1]), "host", QUANT, str(tmp_path / "art"), context_window=64,
                                            progress=False, kv_dtype="f32"))
    assert compiled["tuned_kernels"] == []


def _one_line_error(args: list[str], *needles: str) -> str:
    result = CliRunner().invoke(main, args)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 2, result.output
    lines = without_progress(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("mobilec: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_corrupt_database_file_is_a_one_line_error(tiny, logs_copy, tmp_path):
    records = logs_copy / tuning_log.RECORD_FILE
    intact = records.read_text()
    lines = intact.splitlines()
    records.write_text("\n".join([lines[0], '[0, [["truncated', *lines[1:]]) + "\n")
    tune_args = ["tune", "--model", str(tiny[1]), "--quant", QUANT, "--trials", "1"]
    _one_line_error(tune_args, str(records), "line 2", "delete it or restore it from git")
    compile_args = ["compile", "--model", str(tiny[1]), "--quant", QUANT, "-o", str(tmp_path / "art")]
    _edit_selection(logs_copy, default_us=1e9)  # so compile reads the records
    _one_line_error(compile_args, str(records), "--no-tuning")
    result = CliRunner().invoke(main, [*compile_args, "--no-tuning"])
    assert result.exit_code == 0, result.output

    records.write_text(intact)
    selection = logs_copy / tuning_log.SELECTION_FILE
    selection.write_text(selection.read_text()[:40])
    _one_line_error(tune_args, str(selection))
    _one_line_error([*compile_args, "--overwrite"], str(selection), "--no-tuning")  # the artifact made above


def _count_lines(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


def _spawn(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    """`python -m command` in its own process group, its output in `log`; it ends with this test run, however
    that ends (compiler/testing/processes.py)."""
    return spawn([sys.executable, "-m", *command], log, env=worker_environ({**os.environ, **env}))


def _kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.extended  # ~5 minutes: two tuning subprocesses
def test_a_killed_run_resumes_without_redoing_finished_kernels(tiny, tmp_path):
    """Two kernels, TRIALS each, one round apiece: SIGKILL once the first kernel's records are committed."""
    logs = tmp_path / "tuning_logs"
    records = logs / "host" / tuning_log.RECORD_FILE
    command = ["compiler", "tune", "--model", str(tiny[1]), "--quant", QUANT, "--trials", str(TRIALS),
               "--kernel", "fused_dequantize[23]_*"]
    first = _spawn(command, tmp_path / "first.log", **{tuning_log.TUNING_LOGS_ENV: str(logs)})
    try:
        deadline = time.monotonic() + TUNE_TIMEOUT_S
        while _count_lines(records) < TRIALS:
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "no records committed in time"
            time.sleep(0.1)
    finally:
        _kill_group(first)
    killed = tuning_log.read_log(logs / "host", "")
    before = {key: len(killed.records_for(key)) for key in killed.workloads}
    finished = [key for key, n in before.items() if n >= TRIALS]
    assert len(finished) == 1 and sum(before.values()) < 2 * TRIALS, before

    second = _spawn(command, tmp_path / "second.log", **{tuning_log.TUNING_LOGS_ENV: str(logs)})
    try:
        assert second.wait(timeout=TUNE_TIMEOUT_S) == 0, (tmp_path / "second.log").read_text()
    finally:
        _kill_group(second)
    output = (tmp_path / "second.log").read_text()
    assert f"{TRIALS} trials in the log already, skipped" in output
    log = tuning_log.read_log(logs / "host", "")
    after = {key: len(log.records_for(key)) for key in log.workloads}
    assert len(after) == 2 and after[finished[0]] == before[finished[0]]  # no duplicate work
    assert all(n == TRIALS for n in after.values()) and sum(after.values()) > sum(before.values())


@pytest.fixture
def two_servers(tmp_path):
    """A tracker on loopback with two RPC servers under RPC_KEY: (tracker address, the servers' log files)."""
    tracker, port = start_tracker(tmp_path / "tracker.log")
    processes = [tracker]
    try:
        for i in range(2):
            processes.append(start_server(tmp_path / f"server{i}.log", port, RPC_KEY)[0])
        wait_until_free(port, {RPC_KEY: 2}, processes[1:])
        yield f"127.0.0.1:{port}", [process.log for process in processes[1:]]
    finally:
        for process in processes:
            process.kill()


@pytest.mark.extended  # ~3 minutes: a tracker, two servers and a tuning run
def test_tracker_tuning_measures_on_both_devices(tiny, two_servers, tmp_path, monkeypatch):
    tracker, server_logs = two_servers
    monkeypatch.setenv(tuning_log.TUNING_LOGS_ENV, str(tmp_path / "tuning_logs"))
    _one_line_error(["tune", "--model", str(tiny[1]), "--tracker", tracker, "--key", "phone"], RPC_KEY)
    summary = tune(TuneOptions(str(tiny[1]), "host", QUANT, TRIALS, tracker=tracker, key=RPC_KEY,
                               kernel_patterns=[GEMV]))
    assert summary["measured_on"].startswith("2 device(s)")
    assert summary["kernels"][0]["trials"] == TRIALS and summary["kernels"][0]["tuned_us"] > 0
    sessions = [log.read_text().count("connected from") for log in server_logs]
    assert all(n >= 1 for n in sessions), sessions


@pytest.mark.extended  # ~3 minutes under qemu; the emulated device runs an arm64 model in the default set
def test_tuning_for_linux_arm64_on_the_emulated_device(tiny, emulated_arm_device, tmp_path, monkeypatch):
    """Kernels cross-compiled here and timed on an aarch64 device (under qemu: the flow counts, not the timings)."""
    monkeypatch.setenv(tuning_log.TUNING_LOGS_ENV, str(tmp_path / "tuning_logs"))
    tracker = f"{emulated_arm_device.tracker_host}:{emulated_arm_device.tracker_port}"
    summary = tune(TuneOptions(str(tiny[1]), "linux-arm64", QUANT, 2, tracker=tracker, key=emulated_arm_device.key,
                               kernel_patterns=[GEMV]))
    (row,) = summary["kernels"]
    assert summary["measured_on"].startswith("1 device(s)") and row["trials"] == 2
    assert row["default_us"] > 0 and row["tuned_us"] > 0
    log = tuning_log.read_log(tmp_path / "tuning_logs" / "linux-arm64", "")
    assert {record.json[2]["mtriple"] for record in log.records} == {"aarch64-linux-gnu"}
