"""`mobilec tune`: MetaSchedule (XGBoost cost model, evolutionary search) tunes the kernels one decode step runs,
measured on this machine or on the devices an RPC tracker has under a key, into tuning_logs/<target>/.

The kernels come from the compile pipeline itself (the same import and steps, up to the step that applies the
log), so their database keys are the ones compile looks up. Every trial is appended to the database as it is
measured: a killed run leaves a valid log, and the same command resumes it (a kernel with --trials records is
done; one with fewer continues from them). At the end, each kernel's best record and our default rules'
schedule are measured side by side with the same runner; mobilec-tuned.json keeps both latencies, and compile
applies only the records that were faster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
from tvm.support import cc

from .. import torch_hidden, tuning_log, validate
from ..choices import TUNE_FUNCTIONS
from ..codegen import link, pipeline
from ..errors import MobilecError
from ..model_import.importer import import_model, keeps_gguf_blocks, open_model
from ..passes.ir_walk import relax_nodes
from ..rpc_peers import check_key, last_line, open_tracker
from ..target.build_plan import BuildPlan, resolve_plan
from ..target.targets import TargetSpec

# A round gives one kernel this many trials, then the next kernel has its turn: a --max-seconds budget then
# leaves every kernel some tuning instead of all of it to the first.
ROUND_TRIALS = 16
COMPARE_RUNS = 3  # default and tuned schedules measured this many times, interleaved; the median counts
BUILD_TIMEOUT_S = 30  # MetaSchedule's default; a kernel slower to compile would slow every compile too
RUN_TIMEOUT_S = 60
SESSION_TIMEOUT_S = 300  # one RPC session uploads and times one kernel; TVM's 10 s is too short for a board
EVALUATOR = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=100)
FIX = "delete it or restore it from git, then rerun"
# MetaSchedule logs every trial at INFO; its warnings still show.
SEARCH_LOGGER = logging.getLogger(__name__)
TENSOR_INTRIN_MODULE = "tvm.s_tir.tensor_intrin"


@dataclasses.dataclass
class Kernel:
    """One workload to tune: the functions that share it and how often the selected Relax functions call it."""

    key: str  # database workload key
    names: list[str]
    func: tirx.PrimFunc
    default: tvm.IRModule  # as compile schedules it without a tuning log
    calls: dict[str, int]  # Relax function (decode, prefill) -> call sites
    trials: int = 0  # records in the database
    exhausted: bool = False  # a round found fewer new schedules than asked: the search space is used up
    default_us: float | None = None
    tuned_us: float | None = None
    record: str | None = None  # key of the best record

    @property
    def name(self) -> str:
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]} (+{len(self.names) - 1})"


def build_kernel(mod: tvm.IRModule, target: tvm.target.Target, _params) -> tvm.runtime.Module:
    """MetaSchedule's default build without its import of tensor intrinsics (see _without_tensor_intrinsics),
    which would cost every builder process 30-60 s: LocalBuilder starts new ones for each batch."""
    return tvm.build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def export_kernel(compiler: str | None, module: tvm.runtime.Module) -> str:
    """A shared library the runner can load: linked here, with the target's cross compiler for a device (RPC
    servers on phones have no compiler to link MetaSchedule's default .tar)."""
    path = os.path.join(tempfile.mkdtemp(prefix="mobilec-tune-"), "kernel.so")
    module.export_library(path, fcompile=cc.cross_compiler(compiler) if compiler else None)
    return path


def kernel_module(model: str | None, plan: BuildPlan) -> tvm.IRModule:
    """The model as compile has it right before the tuning log is applied: the same import and steps."""
    with open_model(model) as ckpt:
        mod = import_model(ckpt, plan, context_window=None).mod
    steps = pipeline.steps(plan, tuning=True)
    with plan.spec.tvm_target():
        for _, step in steps[: [name for name, _ in steps].index(pipeline.APPLY_TUNING_STEP)]:
            mod = step(mod)
    return mod


def _call_sites(func: relax.Function) -> Counter[str]:
    return Counter(call.args[0].name_hint for call in relax_nodes(func)
                   if call.args and isinstance(call.args[0], tvm.ir.GlobalVar))


def _static_shapes(func: tirx.PrimFunc) -> bool:
    shapes = [getattr(p, "shape", None) for p in func.params]
    return all(shape is not None and all(isinstance(d, tirx.IntImm) for d in shape) for shape in shapes)


def _default_schedule(func: tirx.PrimFunc, plan: BuildPlan) -> tvm.IRModule:
    """The kernel as compile schedules it without a tuning log: the pipeline's own schedule step."""
    schedule = dict(pipeline.steps(plan, tuning=False))["schedule"]
    with plan.spec.tvm_target():
        return schedule(tuning_log.normalized(func))


def find_kernels(mod: tvm.IRModule, plan: BuildPlan, functions: tuple[str, ...],
                 patterns: list[str]) -> tuple[list[Kernel], dict[str, str]]:
    """The kernels `functions` call (those matching a glob in `patterns`, if any), one per workload, and the
    ones left out with why."""
    kernels: dict[str, Kernel] = {}
    left_out: dict[str, str] = {}
    for function in functions:
        for name, sites in _call_sites(mod[function]).items():
            func = mod[name]
            wanted = not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)
            if not isinstance(func, tirx.PrimFunc) or not wanted:
                continue
            if func.attrs.get("tirx.is_scheduled"):
                left_out[name] = "scheduled by a mobilec pass"
                continue
            if not _static_shapes(func):
                left_out[name] = "dynamic shape (MetaSchedule measures fixed shapes)"
                continue
            default = _default_schedule(func, plan)
            if relax.analysis.has_reshape_pattern(default["main"]):
                left_out[name] = "a reshape, which compile turns into a view"
            else:
                key = tuning_log.workload_key(func)
                kernel = kernels.setdefault(key, Kernel(key, [], func, default, {}))
                if name not in kernel.names:
                    kernel.names.append(name)
                kernel.calls[function] = kernel.calls.get(function, 0) + sites
    return list(kernels.values()), left_out


def _tuning_target(spec: TargetSpec, on_device: bool) -> tvm.target.Target:
    """The target to search for: a CPU one with `num-cores` (MetaSchedule parallelizes for it), which a target file
    may leave out, or an OpenCL one with its host side, measured on an RPC server."""
    kind = spec.tvm_target_json["kind"]
    if kind == "opencl" and spec.schedule["rules"] == "gpu":
        if not on_device:
            raise MobilecError(f"{spec.name} kernels run on OpenCL, which tune measures over RPC: pass --tracker "
                               f"HOST:PORT --key KEY (a server started with `mobilec device-server`, on a board from "
                               f"`mobilec board-folder`, or the TVM RPC app on a phone)")
        return tvm.target.Target(spec.tvm_target_json)
    if kind != "llvm" or spec.schedule["rules"] != "cpu":
        raise MobilecError(f"tuning covers CPU targets (kind llvm, cpu rules) and OpenCL GPU targets; {spec.name} is "
                           f"{kind} with {spec.schedule['rules']} rules")
    if spec.link["method"] != "native" and not on_device:
        raise MobilecError(f"{spec.name} code runs on a device, not here; pass --tracker HOST:PORT --key KEY")
    target = dict(spec.tvm_target_json)
    if "num-cores" not in target:
        if on_device:
            raise MobilecError(f"target file {spec.path} lacks num-cores in [tvm.target], which tuning needs; add the "
                               f"device's core count there")
        target["num-cores"] = os.cpu_count()
    return tvm.target.Target(target)


def _search_rules(target: tvm.target.Target) -> str:
    """MetaSchedule's rule set for the target: its GPU rules (thread binding, cross-thread reductions) are named
    after CUDA and fit any GPU kind; the generic LLVM ones for CPUs (the x86/ARM variants add int8 tensor
    intrinsics, which our float kernels never use)."""
    return "llvm" if target.kind.name == "llvm" else "cuda"


def _library_compiler(spec: TargetSpec) -> str | None:
    """The compiler that links kernels for the target's devices; None for this machine's own."""
    method = spec.link["method"]
    if method == "native":
        return None
    link.check_toolchain(spec)
    if method == "cross":
        return spec.link["compiler"]
    compiler = link.ndk_compiler(spec)
    if compiler is None:
        raise MobilecError(f"tuning for {spec.name} runs linked kernels on the phone, which needs the Android NDK; "
                           f"set TVM_NDK_CC or ANDROID_NDK")
    return compiler


def tracker_devices(tracker: str, key: str) -> tuple[str, int, int]:
    """(host, port, how many RPC servers the tracker has under `key`); an unknown key is refused with the keys."""
    host, port = validate.address(tracker, "--tracker")
    tracker_session, keys = open_tracker(host, port)
    tracker_session.close()
    check_key(host, port, key, keys)
    return host, port, keys.count(key)


class _Measurer:
    """Builds kernels here and times them where they run (this machine, or the tracker's devices in parallel),
    for the search and for the default-vs-tuned comparison alike."""

    def __init__(self, spec: TargetSpec, target: tvm.target.Target, tracker: tuple[str, int, int] | None,
                 key: str | None):
        self.target = target
        self.device_type = "cpu" if target.kind.name == "llvm" else target.kind.name  # where the runner allocates
        compiler = _library_compiler(spec)
        if tracker is not None:
            host, port, devices = tracker
            self.where = f"{devices} device(s) with key {key!r} from the tracker at {host}:{port}"
            self.runner = ms.runner.RPCRunner(
                ms.runner.RPCConfig(host, port, key, session_timeout_sec=SESSION_TIMEOUT_S),
                evaluator_config=EVALUATOR, max_workers=devices)
        else:
            self.where = "this machine"
            self.runner = ms.runner.LocalRunner(timeout_sec=RUN_TIMEOUT_S, evaluator_config=EVALUATOR)
        self.builder = ms.builder.LocalBuilder(
            max_workers=os.cpu_count(), timeout_sec=BUILD_TIMEOUT_S, f_build=build_kernel,
            f_export=functools.partial(export_kernel, compiler))

    def latencies_us(self, mods: list[tvm.IRModule], runs: int) -> list[float | None]:
        """Each scheduled kernel's median latency over `runs` interleaved runs; None where it failed."""
        built = self.builder.build([ms.builder.BuilderInput(mod, self.target) for mod in mods])
        ok = [i for i, b in enumerate(built) if b.error_msg is None]
        inputs = [ms.runner.RunnerInput(built[i].artifact_path, self.device_type,
                                        ms.arg_info.ArgInfo.from_prim_func(mods[i]["main"])) for i in ok]
        times: dict[int, list[float]] = {i: [] for i in ok}
        try:
            for _ in range(runs):
                for i, future in zip(ok, self.runner.run(inputs)):
                    result = future.result()
                    if result.error_msg is None:
                        times[i].append(sum(float(s) for s in result.run_secs) / len(result.run_secs) * 1e6)
        finally:
            for i in ok:
                shutil.rmtree(os.path.dirname(built[i].artifact_path), ignore_errors=True)
        return [statistics.median(times[i]) if times.get(i) else None for i in range(len(mods))]

    def close(self) -> None:
        self.runner.pool.shutdown()


@contextlib.contextmanager
def _without_tensor_intrinsics() -> Iterator[None]:
    """TuneContext imports tvm.s_tir.tensor_intrin: ~500 TVMScript tensor intrinsics, parsed in 30-60 s here in
    every process, for schedule rules that tensorize. The generic LLVM rules we search with use none, so while
    a context is made the import finds a placeholder (removed after, so a later real import still works)."""
    if TENSOR_INTRIN_MODULE in sys.modules:
        yield
        return
    sys.modules[TENSOR_INTRIN_MODULE] = types.ModuleType(TENSOR_INTRIN_MODULE)
    try:
        yield
    finally:
        del sys.modules[TENSOR_INTRIN_MODULE]


def _search_round(kernel: Kernel, trials: int, measurer: _Measurer, database: ms.database.JSONDatabase,
                  cost_model: ms.cost_model.CostModel) -> None:
    """Up to `trials` more measured schedules for one kernel; the evolutionary search starts from the database's
    best records and skips every schedule already in it."""
    before = len(database)
    rules = _search_rules(measurer.target)
    with _without_tensor_intrinsics():
        context = ms.TuneContext(
            mod=tuning_log.normalized(kernel.func), target=measurer.target,
            space_generator=ms.space_generator.PostOrderApply(sch_rules=rules, postprocs=rules, mutator_probs=rules),
            search_strategy="evolutionary", task_name=kernel.name, num_threads=os.cpu_count(), logger=SEARCH_LOGGER,
        ).clone()
    ms.tune_tasks(tasks=[context], task_weights=[float(sum(kernel.calls.values()))],
                  work_dir=os.path.dirname(database.path_workload),
                  max_trials_global=trials, max_trials_per_task=trials, num_trials_per_iter=trials,
                  builder=measurer.builder, runner=measurer.runner, database=database, cost_model=cost_model)
    added = len(database) - before
    kernel.trials += added
    kernel.exhausted = added < trials


def _best_us(database: ms.database.Database, kernel: Kernel) -> float | None:
    top = database.get_top_k(database.commit_workload(tuning_log.normalized(kernel.func)), 1)
    secs = [float(s) for s in top[0].run_secs] if top else []
    return sum(secs) / len(secs) * 1e6 if secs and max(secs) < tuning_log.FAILED_RUN_S else None


def _open_database(directory: Path) -> tuple[ms.database.JSONDatabase, tuning_log.TuningLog]:
    """MetaSchedule's database in `directory`, which it appends to, and what it holds; a corrupt file is named
    before TVM stops on it."""
    directory.mkdir(parents=True, exist_ok=True)
    for note in tuning_log.repair(directory):
        print(f"tune: {note}", file=sys.stderr)
    log = tuning_log.read_log(directory, FIX)
    try:
        return ms.database.JSONDatabase(work_dir=str(directory)), log
    except Exception as err:  # TVM raises several error types for records it cannot rebuild
        raise MobilecError(f"tuning database in {directory} cannot be loaded ({last_line(err)}); {FIX}") from None


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """What `mobilec tune` is asked; model, target and quant as for compile (CompileOptions)."""

    model: str | None = "default"
    target: str = "host"
    quant: str | None = None
    trials: int = 64  # measured schedules per kernel, counting those already in the log
    tracker: str | None = None  # HOST:PORT of an RPC tracker whose devices under `key` measure
    key: str | None = None
    only: str = "decode"  # the function whose kernels are tuned (choices.TUNE_FUNCTIONS)
    kernel_patterns: tuple[str, ...] | list[str] = ()  # only kernels whose name matches one of these globs
    max_seconds: float | None = None  # no new round of trials after this long
    host_target: str | None = None  # GPU targets: the host side for this target file's CPU (as compile's)
    compute_dtype: str | None = None  # instead of the target's (as compile's)

    def check(self) -> None:
        if (self.tracker is None) != (self.key is None):
            raise MobilecError("--tracker and --key go together: pass the tracker's address and the devices' key")
        validate.count(self.trials, "--trials")
        validate.seconds(self.max_seconds, "--max-seconds")
        if self.key is not None:
            validate.device_key(self.key)


def tune(options: TuneOptions) -> dict[str, Any]:
    """Tune, write tuning_logs/<target>/, and return the per-kernel comparison (see format_table)."""
    with torch_hidden.workers_without_torch():  # MetaSchedule's builder and runner processes
        return _tune(options)


def _tune(options: TuneOptions) -> dict[str, Any]:
    options.check()
    model, target, quant, trials, tracker, key = (options.model, options.target, options.quant, options.trials,
                                                  options.tracker, options.key)
    only, kernel_patterns, max_seconds = options.only, options.kernel_patterns, options.max_seconds
    started = time.monotonic()
    plan = resolve_plan(target, quant, host_target=options.host_target, compute_dtype=options.compute_dtype,
                        gguf_keepable=keeps_gguf_blocks(model))
    spec = plan.spec
    tuning_target = _tuning_target(spec, on_device=tracker is not None)
    devices = tracker_devices(tracker, key) if tracker is not None else None
    directory = tuning_log.log_dir(spec.name)
    database, log = _open_database(directory)
    selection = tuning_log.read_selection(directory, FIX)
    measurer = _Measurer(spec, tuning_target, devices, key)
    try:
        print(f"tune: extracting kernels ({spec.name}, measured on {measurer.where})", file=sys.stderr)
        kernels, left_out = find_kernels(kernel_module(model, plan), plan, TUNE_FUNCTIONS[only],
                                         list(kernel_patterns))
        if not kernels:
            raise MobilecError(f"no kernel to tune among {', '.join(left_out) or 'none matched --kernel'}; "
                               f"pass --kernel globs that match kernels of {only} (or leave --kernel out)")
        for kernel in kernels:
            kernel.trials = len(log.records_for(kernel.key))
        defaults = measurer.latencies_us([k.default for k in kernels], runs=1)
        for kernel, default_us in zip(kernels, defaults):
            kernel.default_us = default_us
        kernels.sort(key=lambda k: -(k.default_us or 0) * sum(k.calls.values()))  # most time per step first
        print("tune: " + ", ".join(f"{k.name} x{sum(k.calls.values())} ({_us(k.default_us)} with the default rules)"
                                   for k in kernels), file=sys.stderr)
        stopped = _search(kernels, trials, measurer, database, started, max_seconds)
        _compare(kernels, measurer, directory)
    except KeyboardInterrupt:
        raise MobilecError(f"interrupted; every trial measured so far is in {directory}; rerun the same command "
                           f"to resume") from None
    finally:
        measurer.close()
    for kernel in kernels:
        previous = selection.get(kernel.key, {})
        selection[kernel.key] = {"kernels": kernel.names, "record": kernel.record, "default_us": kernel.default_us,
                                 "tuned_us": kernel.tuned_us, "trials": kernel.trials,
                                 "calls": {**previous.get("calls", {}), **kernel.calls}}
    tuning_log.write_selection(directory, selection)
    return _summary(spec, directory, measurer.where, kernels, left_out, trials, stopped, time.monotonic() - started)


def _search(kernels: list[Kernel], trials: int, measurer: _Measurer, database: ms.database.JSONDatabase,
            started: float, max_seconds: float | None) -> str | None:
    """Rounds over the kernels until each has `trials` records; returns why it stopped early, if it did."""
    cost_model = ms.cost_model.XGBModel(num_tuning_cores=os.cpu_count())
    for kernel in kernels:
        if kernel.trials >= trials:
            print(f"tune: {kernel.name}: {kernel.trials} trials in the log already, skipped", file=sys.stderr)
    while pending := [k for k in kernels if k.trials < trials and not k.exhausted]:
        for kernel in pending:
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                return f"--max-seconds {max_seconds:g} reached"
            _search_round(kernel, min(ROUND_TRIALS, trials - kernel.trials), measurer, database, cost_model)
            print(f"tune: {kernel.name} (x{sum(kernel.calls.values())}): {kernel.trials}/{trials} trials, "
                  f"best {_us(_best_us(database, kernel))}, default rules {_us(kernel.default_us)} "
                  f"[{time.monotonic() - started:.0f} s]", file=sys.stderr)
    return None


def _compare(kernels: list[Kernel], measurer: _Measurer, directory: Path) -> None:
    """Each kernel's best record against the default rules, measured side by side with the same runner."""
    log = tuning_log.read_log(directory, FIX)
    best = {k.key: log.best(k.key) for k in kernels}
    measured = [k for k in kernels if best[k.key] is not None]
    print(f"tune: measuring {len(measured)} tuned kernels against the default rules", file=sys.stderr)
    mods = [mod for k in measured for mod in (k.default, log.schedule(best[k.key]))]
    latencies = measurer.latencies_us(mods, runs=COMPARE_RUNS)
    for i, kernel in enumerate(measured):
        kernel.default_us, kernel.tuned_us = latencies[2 * i], latencies[2 * i + 1]
        kernel.record = best[kernel.key].key


def _us(value: float | None) -> str:
    return "failed" if value is None else f"{value:.1f} us"


def _summary(spec: TargetSpec, directory: Path, measured_on: str, kernels: list[Kernel], left_out: dict[str, str],
             trials: int, stopped: str | None, seconds: float) -> dict[str, Any]:
    rows = []
    for k in kernels:
        entry = {"record": k.record, "default_us": k.default_us, "tuned_us": k.tuned_us}
        rows.append({"kernel": k.name, "functions": k.names, "calls": k.calls, "trials": k.trials,
                     "default_us": k.default_us, "tuned_us": k.tuned_us,
                     "speedup": k.default_us / k.tuned_us if k.default_us and k.tuned_us else None,
                     "applied": tuning_log.beats_default(entry)})
    decode = [r for r in rows if "decode" in r["calls"] and r["default_us"] is not None]
    return {
        "target": spec.name,
        "database": str(directory),
        "measured_on": measured_on,
        "trials_per_kernel": trials,
        "kernels": rows,
        "left_out": left_out,
        # Kernel time of one decode step over the tuned kernels: our rules alone, and with what compile applies.
        "decode_step_us": {
            "default": sum(r["calls"]["decode"] * r["default_us"] for r in decode),
            "tuned": sum(r["calls"]["decode"] * (r["tuned_us"] if r["applied"] else r["default_us"]) for r in decode),
        },
        "stopped_early": stopped,
        "seconds": round(seconds, 1),
    }


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a table: kernel, calls per step, default and tuned latency, speedup, used by compile."""
    functions = sorted({f for row in summary["kernels"] for f in row["calls"]})
    head = f"{'kernel':40s} " + " ".join(f"{f + ' calls':>13s}" for f in functions)
    lines = [f"{head} {'trials':>6s} {'default us':>10s} {'tuned us':>9s} {'speedup':>7s}  compile uses"]
    for row in summary["kernels"]:
        calls = " ".join(f"{row['calls'].get(f, 0):13d}" for f in functions)
        speedup = f"{row['speedup']:6.2f}x" if row["speedup"] else "      -"
        default = f"{row['default_us']:10.1f}" if row["default_us"] is not None else f"{'failed':>10s}"
        tuned = f"{row['tuned_us']:9.1f}" if row["tuned_us"] is not None else f"{'-':>9s}"
        lines.append(f"{row['kernel']:40s} {calls} {row['trials']:6d} {default} {tuned} {speedup}  "
                     f"{'tuned' if row['applied'] else 'default rules'}")
    step = summary["decode_step_us"]
    if step["default"]:
        lines.append(f"decode step, these kernels: {step['default'] / 1e3:.3f} ms with the default rules, "
                     f"{step['tuned'] / 1e3:.3f} ms with the tuning log ({step['default'] / step['tuned']:.2f}x)")
    if summary["left_out"]:
        lines.append("not tuned: " + ", ".join(f"{name} ({why})" for name, why in sorted(summary["left_out"].items())))
    if summary["stopped_early"]:
        lines.append(f"stopped early: {summary['stopped_early']}; rerun the same command to continue")
    lines.append(f"log: {summary['database']} ({summary['seconds']:.0f} s)")
    return "\n".join(lines)
