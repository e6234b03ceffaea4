"""`mobilec profile`: where one decode step's time goes, and the floor memory bandwidth sets for it.

Three measurements, each on its own:
- the memory read bandwidth this machine reaches at a thread count: a large array (well above the last-level
  cache) summed by a small TVM kernel, parallel over threads and vectorized, best of a few repeats;
- the bytes one decode token reads (compiler/roofline.py): every weight the decode step uses (the token-embedding
  table as one row, unless it is also the output layer) and the KV cache up to the context length. bytes /
  bandwidth is the decode floor;
- one decode step's time, per kernel (the Relax VM's instrument hook, before and after every call) and split
  into kernels, the VM's own work between them, and the host-side Python/FFI around the VM calls. The step's
  wall time is measured without the instrument, which costs time of its own.

Kernel calls are matched to the call sites of the VM bytecode (`as_text` of the library), which name the
weights each call reads: so a GEMV is labelled by its projection (qkv_proj, gate_up_proj, lm_head ...) and its
achieved GB/s is known, whatever the kernel's name.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import time
from typing import Any

import numpy as np

from .. import validate
from ..artifacts.artifact import Artifact, load_artifact
from ..codegen.call_sites import ATTENTION_BUILTIN, stored_call_sites
from ..codegen.hexagon import NPU_FUNCTION
from ..errors import MobilecError
from ..model_import import kv_cache_dtype
from ..roofline import artifact_read_bytes, floor_figures
from ..target.host import measure_read_bandwidth, set_threads
from .bench import device_decode_s
from .remote import check_device_options, connect
from .session import Session

# ---------------------------------------------------------------------------------------------------------
# The VM bytecode: which weights each call reads

def _category(function: str, name: str, params: list[str]) -> str:
    """A readable group: "gemv <projection>" by the weight a call reads, attention, rmsnorm, embedding..."""
    if name.startswith(ATTENTION_BUILTIN):
        return "attention"
    modules = [p.rsplit(".", 1)[0].rsplit(".", 1)[-1] for p in params]
    # a chained kernel (passes/chain_kernels.py) reads its norms' weights beside its projection's: the projection
    projections = [m for m in modules if "norm" not in m]
    if "embed_tokens" in projections:
        return "embedding" if function == "embed" else "gemv lm_head (tied embedding)"
    if projections:
        return f"gemv {projections[0]}"
    if modules:
        return "rmsnorm"
    lowered = name.lower()
    for needle, category in (("rms_norm", "rmsnorm"), ("attention", "attention"), ("matmul", "gemv"),
                             ("gemv", "gemv"), ("take", "embedding"), ("swiglu", "activation"),
                             ("silu", "activation"), ("gelu", "activation")):
        if needle in lowered:
            return category
    return "other"


# ---------------------------------------------------------------------------------------------------------
# One decode step

WARMUP_STEPS = 2
DEFAULT_STEPS = 16


def _opencl(config: dict[str, Any]) -> bool:
    """Whether an artifact's kernels are OpenCL (the device times them: _device_kernel_times)."""
    return config["target"]["tvm_target"]["kind"] == "opencl"


def decoded_positions(steps: int, config: dict[str, Any]) -> int:
    """The positions a profile of `steps` decodes after its context on the artifact of `config`: the warm-up, 3 x
    steps (wall, phased, instrumented steps) and, for OpenCL kernels, steps + 1 more (_device_kernel_times)."""
    return WARMUP_STEPS + 3 * steps + (steps + 1 if _opencl(config) else 0)


def _check_room(config: dict[str, Any], context_len: int, steps: int) -> None:
    validate.tokens(context_len, "--context-len")
    validate.count(steps, "--steps")
    context_window, opencl = int(config["context_window"]), _opencl(config)
    decoded = decoded_positions(steps, config)
    if context_len + decoded > context_window:
        raise MobilecError(f"--context-len {context_len} + {decoded} decode steps (3 x --steps"
                           f"{' + --steps + 1 timed on the OpenCL device' if opencl else ''} + {WARMUP_STEPS} "
                           f"warm-up) exceeds the artifact's context window of {context_window}; lower them or "
                           f"recompile with a larger --context-window")


def _fill(session: Session, context_len: int) -> None:
    """A fresh sequence of `context_len` tokens, then the warm-up steps."""
    session.reset()
    vocab = int(session.artifact.config["model"]["config"]["vocab_size"])
    session.prefill((np.arange(context_len, dtype=np.int64) * 7919 % vocab).astype("int32"))
    for _ in range(WARMUP_STEPS):
        session.decode(1)


def _phased_step(session: Session, token: int, mark=None) -> dict[str, float]:
    """Session.decode, call by call, timed: the same calls in the same order (session.py's _forward)."""
    # pylint: disable=protected-access
    clock = time.perf_counter
    t0 = clock()
    ids = session.token_tensor(token)
    t1 = clock()
    if mark:
        mark("embed")
    embedded = session.embed(ids)
    t2 = clock()
    session.begin_forward(session.kv_cache, session.seq_ids, session.one_token)
    t3 = clock()
    if mark:
        mark("decode")
    out = session.decode_function(embedded, session.kv_cache, session.params)
    t4 = clock()
    session.end_forward(session.kv_cache)
    t5 = clock()
    if mark:
        mark(None)
    session.length += 1
    session.logits(out)
    t6 = clock()
    return {"input": t1 - t0, "embed_call": t2 - t1, "kv_begin_forward": t3 - t2, "decode_call": t4 - t3,
            "kv_end_forward": t5 - t4, "logits_to_numpy": t6 - t5}


class _Recorder:
    """Decode steps under the VM instrument: per step, per VM function, every call's (name, seconds) from
    just before the call to just after it."""

    def __init__(self, session: Session):
        self.session = session
        self._started = 0.0
        self._events: list[tuple[str, float]] = []
        self._function: str | None = None
        self._calls: dict[str, list[tuple[str, float]]] = {}
        self.position = 0  # tokens in the sequence before the last step

    def _instrument(self, _func, name, before, _ret, *_args):
        if before:
            self._started = time.perf_counter()
        else:
            self._events.append((name, time.perf_counter() - self._started))
        return 0

    def _mark(self, function: str | None) -> None:
        if self._function:
            self._calls[self._function] = list(self._events)
        self._events.clear()
        self._function = function

    def step(self) -> tuple[dict[str, list[tuple[str, float]]], float]:
        """One instrumented decode step: its calls, and its wall time under the instrument."""
        self._calls, self._function = {}, None
        self.position = self.session.length
        self.session.vm.set_instrument(self._instrument)
        try:
            phases = _phased_step(self.session, 1, self._mark)
        finally:
            self.session.vm.set_instrument(None)
        return self._calls, sum(phases.values())


def _rate(category: str, nbytes: int, seconds: float) -> float | None:
    """GB/s of a kernel that streams memory (GEMV weights, attention's KV cache); None for the others, whose
    few bytes of weights say nothing about their speed."""
    if seconds <= 0 or not nbytes or not category.startswith(("gemv", "attention")):
        return None
    return nbytes / seconds / 1e9


def profile_decode_step(session: Session, context_len: int, steps: int = DEFAULT_STEPS) -> dict[str, Any]:
    """Profile the decode step of `session` at `context_len` tokens of context over `steps` steps; the
    session's sequence is reset afterwards.

    wall_ms (and tok_s) is the median Session.decode step, timed without the instrument. split_ms divides the
    fastest step, wall_ms_best, into kernels (every compiled kernel, the KV cache's attention call and a hexagon-npu
    artifact's NPU kernels on the emulated DSP, in embed and decode, timed by the instrument less its own cost per
    call, instrument_floor_us), vm_overhead (the embed and decode VM calls, timed without the instrument, less their
    kernels: the interpreter, allocation and tuple builtins), host (the input tensor, KV begin/end_forward and the
    logits copy to numpy) and unattributed (the rest: Python in Session.decode and measurement noise). Every part,
    and every kernel's time, is the fastest of the steps: noise only adds time, and parts measured in different
    steps are only comparable without it. A kernel's time still includes the instrument converting its arguments for
    Python (~0.1 us each), so with very short kernels the kernels part is a little high and vm_overhead a little
    low."""
    _check_room(session.artifact.config, context_len, steps)
    artifact = session.artifact
    tensors = artifact.index["tensors"]
    if "call_sites" not in artifact.config:
        raise MobilecError(f"{artifact.path} has no map of the weights its calls read (built for "
                           f"{artifact.config['target']['name']}, or by an older mobilec); recompile it for a CPU "
                           f"target")
    sites, primfuncs = stored_call_sites(artifact.config["call_sites"])

    # Session.decode (the wall time), the same calls timed one by one, and a step under the instrument,
    # interleaved so that a noisy neighbour slows all three alike.
    _fill(session, context_len)
    recorder = _Recorder(session)
    wall, phases, recorded, instrumented_wall, positions = [], [], [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        session.decode(1)
        wall.append(time.perf_counter() - start)
        phases.append(_phased_step(session, 1))
        calls, seconds = recorder.step()
        recorded.append(calls)
        positions.append(recorder.position)
        instrumented_wall.append(seconds)
    device_times = _device_kernel_times(session, steps)
    session.reset()

    # The instrument's own cost per call: the cheapest builtin's median duration.
    durations: dict[str, list[float]] = {}
    for step in recorded:
        for calls in step.values():
            for name, seconds in calls:
                durations.setdefault(name, []).append(seconds)
    builtin_medians = [statistics.median(v) for n, v in durations.items()
                       if n.startswith("vm.builtin.") and not n.startswith(ATTENTION_BUILTIN)]
    floor = min(builtin_medians, default=0.0)

    def is_kernel(name: str) -> bool:  # a compiled kernel, the KV cache's attention, or an NPU kernel on the DSP
        return name in primfuncs or name.startswith((ATTENTION_BUILTIN, NPU_FUNCTION))

    matched = all(sites.get(fn) is not None and [s.name for s in sites[fn]] == [n for n, _ in calls]
                  for step in recorded for fn, calls in step.items())
    # Per step: seconds per (function, kernel, category) row; the rows' calls and weight bytes per step.
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    row_seconds: list[dict[tuple[str, str, str], float]] = []
    builtin_calls = 0
    model = artifact.config["model"]["config"]
    kv_layer_token = kv_cache_dtype.bytes_per_token_layer(kv_cache_dtype.of_artifact(artifact.config),
                                                          model["num_key_value_heads"], model["head_dim"])
    for step, position in zip(recorded, positions, strict=True):
        seconds_of: dict[tuple[str, str, str], float] = {}
        builtin_calls = 0
        for fn, calls in step.items():
            for i, (name, seconds) in enumerate(calls):
                corrected = max(seconds - floor, 0.0)
                if not is_kernel(name):
                    builtin_calls += 1
                    continue
                read = sites[fn][i].params if matched else ()
                key = (fn, name, _category(fn, name, [tensors[p]["name"] for p in read]))
                row = rows.setdefault(key, {"calls": 0, "bytes_read": 0})
                row["calls"] += 1
                # embed reads one row of the embedding table (its tensors' first axis is the vocabulary);
                # attention, one layer's KV cache including the token being decoded
                row["bytes_read"] += sum(tensors[p]["nbytes"] // (tensors[p]["shape"][0] if fn == "embed" else 1)
                                         for p in read)
                if key[2] == "attention":
                    row["bytes_read"] += kv_layer_token * (position + 1)
                seconds_of[key] = seconds_of.get(key, 0.0) + corrected
        row_seconds.append(seconds_of)

    # The split and the kernels' times: the fastest of the steps (noise only adds time, and a step disturbed
    # in one measurement but not in another would make their differences meaningless); wall_ms: the median.
    best = min
    wall_s = best(wall)
    phase_s = {k: best(p[k] for p in phases) for k in phases[0]}
    row_best = {key: best(step.get(key, 0.0) for step in row_seconds) for key in rows}
    # The kernels part: the fastest step's kernels together, comparable with the fastest VM calls. The rows'
    # own fastest times add up to less when the noise hit different kernels in different steps.
    kernels_s = best(sum(step.values()) for step in row_seconds)
    vm_s = phase_s["embed_call"] + phase_s["decode_call"] - kernels_s
    host_s = phase_s["input"] + phase_s["kv_begin_forward"] + phase_s["kv_end_forward"] + phase_s["logits_to_numpy"]

    def ms(seconds: float) -> float:
        return seconds * 1e3

    kernels = []
    for (fn, name, category), row in rows.items():
        seconds = row_best[(fn, name, category)]
        per_step_bytes = row["bytes_read"] // steps
        kernels.append({
            "name": name, "function": fn, "category": category,
            "kind": "primfunc" if name in primfuncs else "npu kernel" if name.startswith(NPU_FUNCTION) else
                    "kv_cache builtin",
            "calls_per_step": row["calls"] / steps, "ms": ms(seconds), "pct_of_step": 100 * seconds / wall_s,
            "bytes_read": per_step_bytes, "gbs": _rate(category, per_step_bytes, seconds),
        })
    kernels.sort(key=lambda k: -k["ms"])
    categories: dict[str, dict[str, Any]] = {}
    for k in kernels:
        c = categories.setdefault(k["category"], {"category": k["category"], "calls_per_step": 0, "ms": 0.0,
                                                   "bytes_read": 0})
        c["calls_per_step"] += k["calls_per_step"]
        c["ms"] += k["ms"]
        c["bytes_read"] += k["bytes_read"]
    for c in categories.values():
        c["pct_of_step"] = 100 * c["ms"] / ms(wall_s)
        c["gbs"] = _rate(c["category"], c["bytes_read"], c["ms"] / 1e3)

    cfg = artifact.config
    layers = int(cfg["model"]["config"]["num_hidden_layers"])
    kernel_calls = sum(k["calls_per_step"] for k in kernels)
    return {
        "artifact": str(artifact.path), "model": cfg["model"]["name"], "quant": cfg["quantization"]["name"],
        "target": cfg["target"]["name"], "threads": os.environ.get("TVM_NUM_THREADS"),
        "context_len": context_len, "steps": steps,
        "wall_ms": ms(statistics.median(wall)), "tok_s": 1.0 / statistics.median(wall),
        "wall_ms_best": ms(wall_s), "wall_ms_p90": ms(float(np.percentile(wall, 90))),
        "split_ms": {"kernels": ms(kernels_s), "vm_overhead": ms(vm_s), "host": ms(host_s),
                     "unattributed": ms(wall_s - kernels_s - vm_s - host_s)},
        "phases_ms": {k: ms(v) for k, v in phase_s.items()},
        "kernel_calls_per_step": kernel_calls,
        "kernel_calls_per_layer": kernel_calls / layers,
        "vm_builtin_calls_per_step": builtin_calls,  # alloc, tuple, shape and check builtins: in vm_overhead
        "instrument_floor_us": floor * 1e6,
        "kernels_ms_rows_best": ms(sum(row_best.values())),  # the sum of the kernel rows (each its fastest)
        "kernels_ms_uncorrected": ms(best(sum(s for calls in step.values() for n, s in calls if is_kernel(n))
                                          for step in recorded)),
        "instrumented_wall_ms": ms(best(instrumented_wall)),
        "call_sites_matched": matched,
        "categories": sorted(categories.values(), key=lambda c: -c["ms"]),
        "kernels": kernels,
        "device": device_times and _device_summary(device_times, layers),
    }


def _device_kernel_times(session: Session, steps: int) -> list[DeviceTimedStep] | None:
    """`steps` decode steps timed on the device (device_decode_s), every OpenCL kernel launch of their runs timed
    by the device (event profiling); None where the kernels do not run on our OpenCL device. The kernel times
    and the step time come from the same runs, so a busy machine slows both alike."""
    if session.device.description.get("opencl") is None:
        return None
    switch = session.device.function("mobilec.opencl.time_kernels")
    read = session.device.function("mobilec.opencl.kernel_times")

    def launches() -> list[tuple[str, float]]:
        return [(kernel, int(ns) / 1e9) for kernel, ns in (line.split("\t") for line in str(read()).splitlines())]

    switch(True)
    try:
        launches()  # anything launched before
        session.decode(1)
        step = launches()  # one step's launches in order
        per_step = collections.Counter(kernel for kernel, _ in step)
        timed = []
        for _ in range(steps):
            step_s = device_decode_s(session, 1)
            seconds: dict[str, float] = collections.defaultdict(float)
            count: collections.Counter = collections.Counter()
            for kernel, s in launches():
                seconds[kernel] += s
                count[kernel] += 1
            if missing := sorted(set(per_step) - set(count)):
                raise MobilecError(f"the timed decode steps launched no {', '.join(missing)}, which a decode step "
                                   f"launches: the device's kernel times cannot be matched to its steps")
            # each kernel's mean launch time the device measured, times its launches in one step
            timed.append(DeviceTimedStep(step_s, step, {k: seconds[k] / count[k] * n for k, n in per_step.items()}))
    finally:
        switch(False)
    return timed


@dataclasses.dataclass(frozen=True)
class DeviceTimedStep:
    """One device_decode_s measurement: its mean step time, one step's launches (kernel, seconds) in order, and
    each kernel's device seconds per step in the same runs."""

    step_s: float
    launches: list[tuple[str, float]]
    kernel_s: dict[str, float]

    @property
    def busy_s(self) -> float:
        return sum(self.kernel_s.values())


def _device_summary(timed: list[DeviceTimedStep], layers: int) -> dict[str, Any]:
    """The device's own times: per OpenCL kernel (its fastest measurement), and the kernels' sum against the step
    time of the same runs (the measurement whose step was fastest)."""
    fastest = min(timed, key=lambda t: t.step_s)
    launches = len(fastest.launches)
    kernels = [{"name": kernel, "launches_per_step": sum(k == kernel for k, _ in fastest.launches),
                "ms": min(t.kernel_s[kernel] for t in timed) * 1e3,
                "pct_of_step": 100 * min(t.kernel_s[kernel] for t in timed) / fastest.step_s}
               for kernel in fastest.kernel_s]
    return {"launches_per_step": launches, "launches_per_layer": launches / layers,
            "kernels_ms": fastest.busy_s * 1e3, "step_ms": fastest.step_s * 1e3,
            "fraction_of_step": fastest.busy_s / fastest.step_s,
            "kernels": sorted(kernels, key=lambda k: -k["ms"])}


# ---------------------------------------------------------------------------------------------------------
# The whole report: `mobilec profile`


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """What `mobilec profile` is asked."""

    artifact: str  # the directory `mobilec compile` wrote
    threads: int | None = None
    context_len: int = 128  # tokens in the KV cache before the profiled decode steps
    steps: int = DEFAULT_STEPS  # decode steps measured
    bandwidth_mb: float | None = None  # the buffer the bandwidth is measured with (default: host.py's)
    rpc: str | None = None  # HOST:PORT of a TVM RPC server: profile there (remote_profile)
    tracker: str | None = None  # HOST:PORT of a TVM RPC tracker, with key
    key: str | None = None
    session_timeout_s: float = 600  # how long an RPC session may last

    @property
    def local(self) -> bool:
        return self.rpc is None and self.tracker is None


def profile_report(options: ProfileOptions) -> dict[str, Any]:
    """Per-kernel, VM and host time of one decode step of the artifact on this CPU, against the floor the
    measured memory bandwidth sets; over RPC, the device's own times (remote_profile). Options are checked
    before the library loads."""
    threads, context_len, steps = options.threads, options.context_len, options.steps
    check_device_options(None, options.rpc, options.tracker, options.key, options.session_timeout_s)
    validate.threads(threads, local=options.local)
    artifact = load_artifact(options.artifact)
    _check_room(artifact.config, context_len, steps)  # before the library loads
    if not options.local:
        return remote_profile(artifact, options)
    set_threads(threads)
    session = Session(artifact)
    bandwidth = measure_read_bandwidth(threads, options.bandwidth_mb)
    read = artifact_read_bytes(artifact, context_len)
    profile = profile_decode_step(session, context_len, steps)
    return {**profile, "bandwidth_gbs": bandwidth, "read_bytes": read.to_json(),
            **floor_figures(read, bandwidth, profile["tok_s"])}


def remote_profile(artifact: Artifact, options: ProfileOptions) -> dict[str, Any]:
    """A decode step of the artifact on an RPC device, timed there: the step by time_evaluator (RPC round trips
    excluded) and, on an OpenCL device, every kernel's device time (event profiling). The host-side split of
    the local profile needs the VM's instrument, which calls back into this process: not over RPC."""
    device = connect(options.rpc, options.tracker, options.key, options.session_timeout_s)
    try:
        with device.bounded():
            if options.threads is not None:
                with device.errors("setting the thread count"):
                    device.set_threads(options.threads)
            session = Session(artifact, device)
            with device.errors("profiling the decode step"):
                _fill(session, options.context_len)
                step_s = [device_decode_s(session, 1) for _ in range(options.steps)]
                device_times = _device_kernel_times(session, options.steps)
    finally:
        device.close()
    cfg = artifact.config
    best = min(step_s)
    layers = int(cfg["model"]["config"]["num_hidden_layers"])
    return {
        "artifact": str(artifact.path), "model": cfg["model"]["name"], "quant": cfg["quantization"]["name"],
        "target": cfg["target"]["name"], "remote": device.description, "threads": options.threads,
        "context_len": options.context_len, "steps": options.steps,
        "wall_ms": statistics.median(step_s) * 1e3, "wall_ms_best": best * 1e3,
        "tok_s": 1.0 / statistics.median(step_s),
        "device": device_times and _device_summary(device_times, layers),
    }


def format_remote_profile(profile: dict[str, Any], top: int = 12) -> str:
    """remote_profile's figures as a table for people."""
    remote = profile["remote"]
    lines = [f"{profile['artifact']} ({profile['model']}, {profile['quant']}) on {remote['name']}: decode step at "
             f"context {profile['context_len']}, {profile['steps']} steps",
             f"step on the device {profile['wall_ms']:.3f} ms median (fastest {profile['wall_ms_best']:.3f}) = "
             f"{profile['tok_s']:.1f} tok/s (time_evaluator there, RPC round trips excluded)"]
    device = profile["device"]
    if not device:
        lines.append("  per-kernel times need the OpenCL device over RPC (a CPU device: run profile on the device "
                     "itself for its kernels)")
        return "\n".join(lines)
    return "\n".join(lines + _device_table(device, top))


def _device_table(device: dict[str, Any], top: int) -> list[str]:
    """_device_summary's figures as table lines."""
    lines = [f"  OpenCL device times (event profiling): {device['launches_per_step']} launches per step "
             f"({device['launches_per_layer']:.1f} per layer), {device['kernels_ms']:.3f} ms busy = "
             f"{device['fraction_of_step']:.1%} of the {device['step_ms']:.3f} ms step they ran in",
             f"  {'OpenCL kernel (top ' + str(top) + ')':52s} {'launches':>8s} {'ms':>8s} {'% step':>7s}"]
    for k in device["kernels"][:top]:
        lines.append(f"  {k['name'][:52]:52s} {k['launches_per_step']:8d} {k['ms']:8.3f} {k['pct_of_step']:6.1f}%")
    return lines


def format_profile(profile: dict[str, Any], top: int = 12) -> str:
    """A decode-step profile (profile_decode_step, or profile_report with the floor) as a table for people."""
    if "remote" in profile:
        return format_remote_profile(profile, top)
    wall = profile["wall_ms_best"]
    split, phases = profile["split_ms"], profile["phases_ms"]
    title = (f"{profile['artifact']} ({profile['model']}, {profile['quant']}): decode step at context "
             f"{profile['context_len']}, threads {profile['threads'] or 'default'}, {profile['steps']} steps")
    lines = [title]
    head = (f"step {profile['wall_ms']:.3f} ms median (p90 {profile['wall_ms_p90']:.3f}) = {profile['tok_s']:.1f} "
            f"tok/s")
    if "floor_tok_s" in profile:
        head += (f"; reads {profile['bytes_per_token'] / 1e6:.1f} MB/token, at {profile['bandwidth_gbs']:.1f} GB/s "
                 f"the floor is {profile['floor_ms']:.3f} ms = {profile['floor_tok_s']:.1f} tok/s: "
                 f"{profile['floor_fraction']:.1%} of the floor")
    lines += [head, f"fastest step {wall:.3f} ms, split (each part the fastest of the steps):"]

    def part(label: str, value: float, note: str) -> str:
        return f"  {label:13s} {value:8.3f} ms {100 * value / wall:6.1f}%  {note}"

    lines += [
        part("kernels", split["kernels"], f"{profile['kernel_calls_per_step']:.0f} calls "
             f"({profile['kernel_calls_per_layer']:.1f} per layer), less the instrument's "
             f"{profile['instrument_floor_us']:.2f} us per call; table: each kernel's fastest step"),
        part("VM overhead", split["vm_overhead"], f"embed + decode VM calls ({phases['embed_call']:.3f} + "
             f"{phases['decode_call']:.3f} ms) less their kernels; {profile['vm_builtin_calls_per_step']} "
             f"builtin calls"),
        part("host", split["host"], f"input {phases['input']:.3f}, begin_forward {phases['kv_begin_forward']:.3f}, "
             f"end_forward {phases['kv_end_forward']:.3f}, logits to numpy {phases['logits_to_numpy']:.3f} ms"),
        part("unattributed", split["unattributed"], "Python in Session.decode, noise"),
        "",
        f"  {'category':32s} {'calls':>6s} {'ms':>8s} {'% step':>7s} {'MB read':>8s} {'GB/s':>7s}",
    ]

    def gbs(value) -> str:
        return "" if value is None else f"{value:7.1f}"

    for c in profile["categories"]:
        lines.append(f"  {c['category']:32s} {c['calls_per_step']:6.0f} {c['ms']:8.3f} {c['pct_of_step']:6.1f}% "
                     f"{c['bytes_read'] / 1e6:8.2f} {gbs(c['gbs'])}")
    header = (f"  {'kernel (top ' + str(top) + ')':44s} {'function':8s} {'calls':>5s} {'ms':>8s} {'% step':>7s} "
              f"{'GB/s':>7s}  category")
    lines += ["", header]
    for k in profile["kernels"][:top]:
        lines.append(f"  {k['name'][:44]:44s} {k['function']:8s} {k['calls_per_step']:5.0f} {k['ms']:8.3f} "
                     f"{k['pct_of_step']:6.1f}% {gbs(k['gbs'])}  {k['category']}")
    device = profile.get("device")
    if device:
        lines += ["", *_device_table(device, top)]
        lines.append("  (the host-side kernel rows above time the enqueue calls; the device runs kernels after them)")
    # (on OpenCL the host-side split holds the wait for the device, and enqueue times are too short to compare)
    host_split_off = not device and (split["vm_overhead"] < 0 or abs(split["unattributed"]) > 0.05 * wall
                                     or profile["kernels_ms_rows_best"] < 0.9 * split["kernels"])
    noisy = host_split_off or profile["wall_ms_p90"] > 1.5 * profile["wall_ms"]
    if noisy:
        lines.append(f"  note: the machine was noisy: step p90 {profile['wall_ms_p90']:.3f} vs median "
                     f"{profile['wall_ms']:.3f} ms; the kernels' fastest calls add up to "
                     f"{profile['kernels_ms_rows_best']:.3f} ms vs {split['kernels']:.3f} ms in the fastest step. "
                     f"Rerun on a quiet machine, or with more --steps")
    if not profile["call_sites_matched"]:
        lines.append("  (calls did not match the VM bytecode: categories by kernel name only, no bytes read)")
    return "\n".join(lines)
