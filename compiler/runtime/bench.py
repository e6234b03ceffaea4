"""`mobilec bench`: time to first token, prefill and decode speed, memory and the share of the memory-bandwidth
roofline an artifact reaches on a device (this process, or one reached through TVM RPC).

Host timings are wall clock around the calls, RPC round trips included: what an app driving the model from
another machine would see. The decode step is also timed on the device by TVM's time_evaluator, without
round trips. Greedy tokens are picked on the host from the logits, whose transfer is timed on its own: the
runtime's builtins that could pick them on the device (vm.builtin.sample_top_p_from_logits and friends) take
a Tensor, which RPC cannot pass (a remote tensor arrives as a bare DLTensor*), and the compiled model has no
argmax function.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from .. import validate
from ..artifacts.artifact import Artifact, load_artifact
from ..errors import MobilecError
from ..roofline import artifact_read_bytes
from ..target.targets import load_target
from .generate import peak_rss_mb
from .remote import Device, check_device_options, check_runs_on, connect
from .session import Session

SUSTAINED_INTERVAL_S = 1.0
DEVICE_TIMING_STEPS = 8  # decode steps time_evaluator averages after each run
SAVED_DECODE = "mobilec_bench_decode"  # the name the VM keeps the bound decode step under for time_evaluator


@dataclasses.dataclass(frozen=True)
class BenchOptions:  # pylint: disable=too-many-instance-attributes
    """What `mobilec bench` is asked: the artifact, the device (this process, an RPC server, or a tracker's device
    under a key) and the measurement."""

    artifact: str  # the directory `mobilec compile` wrote
    device: str | None = None  # "local": this process (also the default without rpc or tracker)
    rpc: str | None = None  # HOST:PORT of a TVM RPC server
    tracker: str | None = None  # HOST:PORT of a TVM RPC tracker, with key
    key: str | None = None
    prompt_len: int = 128
    gen_len: int = 64
    repeat: int = 3
    sustained_s: float | None = None  # then decode this long, tok/s per second
    threads: int | None = None
    session_timeout_s: float = 600  # how long an RPC session may last
    device_ram_mb: float | None = None  # default: the target's ram_gb
    plot_file: str | None = None  # PNG of the sustained run
    seed: int = 0
    progress: bool = True  # progress bars on stderr (only when it is a terminal)

    @property
    def local(self) -> bool:
        return self.rpc is None and self.tracker is None

    def check(self, context_window: int | None = None) -> None:
        """Every option, address and output path by itself and, given the artifact's context window, against it;
        the threads are this machine's when local (else the device's)."""
        check_device_options(self.device, self.rpc, self.tracker, self.key, self.session_timeout_s)
        if self.plot_file and self.sustained_s is None:
            raise MobilecError("--plot draws the --sustained run; add --sustained SECONDS")
        validate.output_file(self.plot_file, "--plot", "png")
        validate.tokens(self.prompt_len, "--prompt-len")
        validate.tokens(self.gen_len, "--gen-len", least=2)
        validate.count(self.repeat, "--repeat")
        validate.threads(self.threads, local=self.local)
        validate.seconds(self.sustained_s, "--sustained")
        if self.device_ram_mb is not None:
            validate.positive_number(self.device_ram_mb, "--device-ram-mb")
        validate.seed(self.seed, "the prompt seed")
        if context_window is not None and self.prompt_len + self.gen_len > context_window:
            raise MobilecError(f"--prompt-len {self.prompt_len} + --gen-len {self.gen_len} exceeds the artifact's "
                               f"context window of {context_window}; shorten them or recompile with a larger --context-window")


def bench(options: BenchOptions) -> dict[str, Any]:
    """`mobilec bench`: every option checked before the artifact loads or a device is reached; the figures
    run_bench measures (and the --plot file written)."""
    options.check()
    artifact = load_artifact(options.artifact)
    options.check(int(artifact.config["context_window"]))
    device = connect(options.rpc, options.tracker, options.key, options.session_timeout_s)
    try:
        result = run_bench(artifact, device, options, progress=options.progress and sys.stderr.isatty())
    finally:
        device.close()
    if options.plot_file:
        plot_sustained(result, options.plot_file)
    return result


@dataclasses.dataclass
class Run:
    tokens: list[int]
    ttft_s: float  # prefill, logits transfer and the first greedy pick
    decode_s: float  # the remaining len(tokens) - 1 steps
    decode_fetch_s: float  # of decode_s: bringing logits to the host


def prompt_ids(vocab_size: int, n: int, seed: int) -> np.ndarray:
    """The benchmark prompt: token ids drawn uniformly from the vocabulary with a fixed seed."""
    return np.random.default_rng(seed).integers(0, vocab_size, n).astype("int32")


def generate(session: Session, ids: np.ndarray, n_tokens: int, on_token=lambda: None) -> Run:
    """A fresh sequence: the prompt, then greedy tokens (picked on the host) up to `n_tokens`, timed; `on_token`
    runs after each token."""
    session.reset()
    t0 = time.perf_counter()
    tokens = [int(np.argmax(session.prefill(ids)))]
    t1 = time.perf_counter()
    fetch_before = session.fetch_s
    on_token()
    while len(tokens) < n_tokens:
        tokens.append(int(np.argmax(session.decode(tokens[-1]))))
        on_token()
    return Run(tokens, t1 - t0, time.perf_counter() - t1, session.fetch_s - fetch_before)


def device_decode_s(session: Session, token: int) -> float:
    """One decode step timed on the device by time_evaluator, RPC round trips excluded. The step repeats at one
    position, rewriting the same KV entry, and is committed once at the end."""
    embedded = session.embed(session.token_tensor(token))
    session.begin_forward(session.kv_cache, session.seq_ids, session.one_token)
    session.vm.save_function("decode", SAVED_DECODE, embedded, session.kv_cache, session.params, include_return=False)
    seconds = session.vm.time_evaluator(SAVED_DECODE, session.device.dev, number=DEVICE_TIMING_STEPS)().mean
    session.end_forward(session.kv_cache)
    session.length += 1
    return seconds


def sustained(session: Session, ids: np.ndarray, seconds: float, progress: bool) -> dict[str, Any]:
    """Decode for `seconds`; tok/s per interval over decode time only (restarts at the context window and their
    prefill are left out, so a falling rate means the device slowed down)."""
    counts: dict[int, int] = collections.Counter()
    busy: dict[int, float] = collections.defaultdict(float)
    last = math.ceil(seconds / SUSTAINED_INTERVAL_S) - 1  # the step that ends past the deadline counts here

    def restart() -> int:
        session.device.step_inside_session("decoding (--sustained)")
        session.reset()
        return int(np.argmax(session.prefill(ids)))

    token = restart()
    start = time.perf_counter()
    with tqdm(total=round(seconds), desc="sustained", bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s",
              file=sys.stderr, disable=not progress) as bar:
        while (now := time.perf_counter()) - start < seconds:
            if session.length >= session.context_window:
                token = restart()
                continue
            session.device.step_inside_session("decoding (--sustained)")
            token = int(np.argmax(session.decode(token)))
            end = time.perf_counter()
            interval = min(int((end - start) // SUSTAINED_INTERVAL_S), last)
            counts[interval] += 1
            busy[interval] += end - now
            bar.update(min(round(end - start), bar.total) - bar.n)
    intervals = sorted(busy)
    return {"interval_s": SUSTAINED_INTERVAL_S, "t_s": [i * SUSTAINED_INTERVAL_S for i in intervals],
            "tok_s": [counts[i] / busy[i] for i in intervals]}


def _target_device_facts(artifact: Artifact) -> dict[str, Any] | None:
    """The [device] table of the target the artifact was built for, if its file is still in targets/."""
    try:
        return load_target(artifact.config["target"]["name"]).device
    except MobilecError:
        return None


def check_memory(artifact: Artifact, device_ram_mb: float | None, facts: dict[str, Any] | None) -> None:
    """Refuse, before anything is uploaded, an artifact whose estimated memory exceeds the device's RAM."""
    needed = artifact.config.get("memory_estimate", {}).get("total_bytes")
    if device_ram_mb is not None:
        limit_mb, source = device_ram_mb, "--device-ram-mb"
    elif facts is not None:
        limit_mb, source = facts["ram_gb"] * 1024, f"ram_gb of target {artifact.config['target']['name']}"
    else:
        return
    if needed is not None and needed / 2**20 > limit_mb:
        need_mb = needed / 2**20
        raise MobilecError(f"{artifact.path} needs an estimated {need_mb:.0f} MB but the device has {limit_mb:g} MB "
                           f"({source}): {need_mb - limit_mb:.0f} MB too many; use a smaller --quant or "
                           f"--context-window, or pass the device's real RAM with --device-ram-mb")


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def run_bench(artifact: Artifact, device: Device, options: BenchOptions, progress: bool) -> dict[str, Any]:
    """Stage the artifact on the device, then time `repeat` generations (after one warm-up) and, if asked, a
    sustained decode; returns the figures `mobilec bench --json` writes. `options` were checked by bench()."""
    facts = _target_device_facts(artifact)
    check_memory(artifact, options.device_ram_mb, facts)
    check_runs_on(artifact, device)  # before anything is uploaded
    with device.bounded():  # nothing on a device waits past its session
        return _run_bench(artifact, device, options, progress, facts)


def _run_bench(artifact: Artifact, device: Device, options: BenchOptions, progress: bool,
               facts: dict[str, Any] | None) -> dict[str, Any]:
    cfg = artifact.config
    with device.errors("setting the thread count"):
        device.set_threads(options.threads)
    session = Session(artifact, device, progress)
    staged = session.staged
    ids = prompt_ids(int(cfg["model"]["config"]["vocab_size"]), options.prompt_len, options.seed)
    with device.errors("running the benchmark"):
        generate(session, ids, 2, lambda: device.step_inside_session("warming up"))  # sets up the VM's pools
        with tqdm(total=options.repeat * options.gen_len, desc="bench", unit="tok", file=sys.stderr,
                  disable=not progress) as bar:
            runs, device_step_s = [], []

            def on_token() -> None:
                bar.update()
                device.step_inside_session("running the benchmark")

            for _ in range(options.repeat):
                runs.append(generate(session, ids, options.gen_len, on_token))
                device_step_s.append(device_decode_s(session, runs[-1].tokens[-1]))
        device_tok_s = 1.0 / float(np.median(device_step_s))
        sustained_run = sustained(session, ids, options.sustained_s, progress) if options.sustained_s else None
    steps = options.gen_len - 1
    decode_rates = [_rate(steps, r.decode_s) for r in runs]
    decode_tok_s = float(np.median(decode_rates))
    # decode runs from prompt_len to prompt_len + gen_len tokens: its middle stands for the whole
    read = artifact_read_bytes(artifact, options.prompt_len + options.gen_len // 2)
    per_token, source = read.total, read.source
    bandwidth = facts["memory_bandwidth_gbs"] if facts else None

    def roofline(rate: float) -> float | None:
        return per_token * rate / 1e9 / bandwidth if bandwidth else None

    local = device.session is None
    return {
        "artifact": str(artifact.path),
        "model": cfg["model"]["name"],
        "quant": cfg["quantization"]["name"],
        "target": cfg["target"]["name"],
        "device": device.description,
        "cpu_check": session.cpu_check,
        "prompt_len": options.prompt_len,
        "gen_len": options.gen_len,
        "repeat": options.repeat,
        "threads": options.threads,
        "prompt_seed": options.seed,
        "upload": {"uploaded": len(staged.uploaded), "skipped": len(staged.skipped), "bytes": staged.upload_bytes,
                   "seconds": round(session.stage_s, 3), "uploaded_files": staged.uploaded,
                   "skipped_files": staged.skipped},
        "weights_loaded_by": "vm.builtin.tensor_cache.load on the device",
        "load_s": round(session.load_s, 3),
        "ttft_ms": float(np.median([r.ttft_s for r in runs])) * 1e3,
        "prefill_tok_s": float(np.median([_rate(options.prompt_len, r.ttft_s) for r in runs])),
        "decode_tok_s": decode_tok_s,
        # the rate 90% of runs reach: from the 90th percentile of decode time (the slow tail)
        "decode_tok_s_p90": _rate(steps, float(np.percentile([r.decode_s for r in runs], 90))),
        "decode_tok_s_device": device_tok_s,
        "logits_fetch_ms_per_token": float(np.median([r.decode_fetch_s / steps for r in runs])) * 1e3,
        "peak_mem_mb": peak_rss_mb() if local else None,
        "peak_mem_note": ("peak RSS of this process (Python and TVM included)" if local else
                          "not reported: TVM's RPC runtime gives no process memory for a CPU device"),
        "bytes_per_token": per_token,
        "bytes_per_token_source": source,
        "memory_bandwidth_gbs": bandwidth,
        "achieved_gbs": per_token * decode_tok_s / 1e9,
        "roofline_fraction": roofline(decode_tok_s),
        "roofline_fraction_device": roofline(device_tok_s),
        "tokens": runs[0].tokens,
        "sustained": sustained_run,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    """The figures as a table for people; --json has them all."""
    dev = result["device"]
    arch = f", {dev['triple'] or dev['arch']}" if dev["arch"] else ""
    if dev.get("opencl"):
        arch += f", OpenCL: {dev['opencl']['device']} ({dev['opencl']['platform']})"
    upload = result["upload"]
    staged = ("weights read in place" if dev["kind"] == "local" else
              f"upload: {upload['uploaded']} files sent ({upload['bytes'] / 1e6:.1f} MB), "
              f"{upload['skipped']} already there")
    lines = [
        f"{result['artifact']} ({result['model']}, {result['quant']}, target {result['target']}) on {dev['name']}{arch}",
        f"prompt {result['prompt_len']} tokens, {result['gen_len']} generated, {result['repeat']} runs after a warm-up; "
        f"{staged}",
        f"{'time to first token':34s} {result['ttft_ms']:10.1f} ms",
        f"{'prefill':34s} {result['prefill_tok_s']:10.1f} tok/s",
        f"{'decode (median / p90)':34s} {result['decode_tok_s']:10.1f} / {result['decode_tok_s_p90']:.1f} tok/s",
        f"{'decode step on the device':34s} {result['decode_tok_s_device']:10.1f} tok/s (no RPC round trips)",
        f"{'logits to the host':34s} {result['logits_fetch_ms_per_token']:10.2f} ms/token (part of decode)",
        f"{'peak memory':34s} {_fmt(result['peak_mem_mb'], '10.0f')} MB ({result['peak_mem_note']})",
        f"{'weights read per token':34s} {result['bytes_per_token'] / 1e6:10.1f} MB ({result['bytes_per_token_source']})",
        f"{'achieved bandwidth':34s} {result['achieved_gbs']:10.2f} GB/s = {_fmt(result['roofline_fraction'], '.1%')} "
        f"of {_fmt(result['memory_bandwidth_gbs'], 'g')} GB/s (device step alone: "
        f"{_fmt(result['roofline_fraction_device'], '.1%')})",
    ]
    if result.get("cpu_check", {}).get("note"):
        lines.append(f"note: {result['cpu_check']['note']}")
    if result["sustained"]:
        rates = result["sustained"]["tok_s"]
        lines.append(f"{'sustained decode':34s} {len(rates)} intervals: first {rates[0]:.1f}, last {rates[-1]:.1f}, "
                     f"min {min(rates):.1f} tok/s")
    return "\n".join(lines)


def plot_sustained(result: dict[str, Any], path: str | Path) -> None:
    """tok/s over time of the sustained run, as a PNG."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise MobilecError("--plot needs matplotlib; install it (pip install matplotlib) or drop --plot") from None
    sustained = result["sustained"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(sustained["t_s"], sustained["tok_s"], marker="o")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result['model']} {result['quant']} on {result['device']['name']}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as err:
        raise MobilecError(f"cannot write --plot {path}: {err.strerror}") from None
    finally:
        plt.close(fig)
