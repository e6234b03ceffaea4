"""The machine mobilec runs on: its CPU as an LLVM target (LLVM's name for it, cut to the features the kernel
reports), its cores and RAM, its thread pool, and its memory read bandwidth (measured once per machine, cached)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm.target.codegen import llvm_get_cpu_features, llvm_get_system_cpu, llvm_is_valid_cpu

from ..device_server import core_of, physical_cores
from ..errors import MobilecError
from ..user_cache import cache_path
from ..validate import USABLE_CORES, USABLE_CPUS
from .isa import arch_of_triple, feature_flags

# TVM's ThreadGroup::AffinityMode kSpecifyThreadShareAllCore: every thread of the pool may run on each of the given CPUs
SHARE_ALL_CORES = -3
TRIPLES = {"x86_64": "x86_64-unknown-linux-gnu", "aarch64": "aarch64-linux-gnu"}
# When LLVM does not know the CPU's name: a baseline the features from /proc/cpuinfo are added to.
BASELINE_CPU = {"x86_64": "x86-64", "aarch64": "generic"}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, ARM `Features`); empty when unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    match = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def cpu_model_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    match = re.search(r"^(?:model name|Hardware|CPU part)\s*:\s*(.*)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.machine()


def usable_cores() -> int:
    """The cores this process may use, as they were when it started (validate.USABLE_CORES): TVM's thread pool
    narrows the calling thread's affinity once sized, and a count read after it (1 instead of 2 here) gave
    another target (num-cores) and another cached bandwidth than the same machine's earlier in the process."""
    return USABLE_CORES


def target_json_for(arch: str, cpu: str, flags: set[str], cores: int) -> dict[str, Any]:
    """An LLVM target for a CPU that LLVM calls `cpu` and Linux describes by `flags`. A CPU name alone can promise
    more than the machine has (a VM that hides AVX-512 from a Zen 4 or an Ice Lake): every instruction-set feature
    the name implies but the flags lack is turned off. Features are added from the flags only to a CPU LLVM does
    not know (then a baseline): under an emulator the flags are the real machine's, not the emulated CPU's."""
    triple = TRIPLES[arch]
    known = cpu != "generic" and llvm_is_valid_cpu(cpu, triple)
    cpu = cpu if known else BASELINE_CPU[arch]
    implied = {str(f) for f in llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mtriple": triple, "mcpu": cpu}))}
    mattr = []
    if flags:
        for feature, flag in feature_flags(arch).items():
            if feature in implied and flag not in flags:
                mattr.append(f"-{feature}")
            elif not known and feature not in implied and flag in flags:
                mattr.append(f"+{feature}")
    target = {"kind": "llvm", "mtriple": triple, "mcpu": cpu, "num-cores": cores}
    if mattr:
        target["mattr"] = mattr
    return target


@functools.lru_cache(maxsize=1)
def host_target_json() -> dict[str, Any]:
    """This machine's CPU as a TVM target (JSON); the cores this process may use become num-cores."""
    arch = arch_of_triple(platform.machine().lower())
    if arch not in TRIPLES:
        raise MobilecError(f"mobilec's host target knows x86_64 and aarch64 machines, not {platform.machine()}; "
                           "pick a target file with --target")
    return target_json_for(arch, llvm_get_system_cpu(), cpu_flags(), usable_cores())


def host_features() -> frozenset[str]:
    """The LLVM features this machine's CPU has (its host target's)."""
    return frozenset(str(f) for f in llvm_get_cpu_features(tvm.target.Target(host_target_json())))


def _meminfo_kib(field: str) -> int | None:
    """A /proc/meminfo field in KiB; None off Linux."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    return int(re.search(rf"^{field}:\s*(\d+) kB", text, re.MULTILINE).group(1))


def ram_gb() -> float:
    total = _meminfo_kib("MemTotal")
    if total is None:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30
    return total / 2**20


def available_bytes() -> int | None:
    """Memory this machine can give a new process now (MemAvailable); None off Linux."""
    kib = _meminfo_kib("MemAvailable")
    return None if kib is None else kib * 1024


def pool_cpus(threads: int) -> list[int]:
    """The CPUs a pool of `threads` runs on: one per physical core first, the highest capacity first (a phone's
    big cores: /sys cpu_capacity, else cpufreq's maximum; equal where Linux says neither), then lower numbers; SMT
    siblings only once every core has one."""
    def number(path: str) -> int:
        try:
            return int(Path(path).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def rank(cpu: int) -> tuple[int, int, int]:
        base = f"/sys/devices/system/cpu/cpu{cpu}"
        return -number(f"{base}/cpu_capacity"), -number(f"{base}/cpufreq/cpuinfo_max_freq"), cpu

    firsts, siblings, seen = [], [], set()
    for cpu in sorted(USABLE_CPUS, key=rank):
        core = core_of(cpu)
        (siblings if core in seen else firsts).append(cpu)
        seen.add(core)
    return (firsts + siblings)[:threads]


def set_threads(threads: int | None) -> None:
    """Size TVM's thread pool and let its threads share its cores; None keeps TVM_NUM_THREADS (or OMP_NUM_THREADS)
    where set, else one thread per physical core this process may use (TVM's own default halves x86's CPUs whether
    or not they are SMT siblings: 1 thread on a 2-core VM). A count not read from those goes into TVM_NUM_THREADS:
    without either TVM asks glibc for the CPU count at every parallel kernel launch, which reads
    /sys/devices/system/cpu/online (~185 times per SmolLM2 decode step).

    TVM pins each worker to a core of its own and lets the calling thread, which runs a launch's first share, roam
    over all of them: when Linux leaves it on a worker's core, each launch runs its shares one after the other (a
    2-core VM, SmolLM2's o_proj GEMV: the worker started its share ~14 us late instead of ~0.8, in 2 of 6 processes).
    So the pool's threads, the calling one included, share the pool's cores (pool_cpus) and Linux spreads them.
    TVM_BIND_THREADS, where set, keeps TVM's own placement."""
    name = next((n for n in ("TVM_NUM_THREADS", "OMP_NUM_THREADS") if os.environ.get(n, "").strip()), None)
    users = threads is None and name is not None  # the user's count, which TVM reads as it is
    if users:
        if not re.fullmatch(r"\s*\d+\s*", os.environ[name]):
            raise MobilecError(f"{name}={os.environ[name]!r} is not a thread count; fix or unset it, or pass --threads")
        threads = int(os.environ[name])
    elif threads is None:
        threads = physical_cores(USABLE_CPUS)
    if threads < 1:
        raise MobilecError(f"--threads must be at least 1, got {threads}")
    if not users:
        os.environ["TVM_NUM_THREADS"] = str(threads)
    # TVM also sets the calling thread's cores (and never widens them again); undone, so that processes started
    # from this one later (bench's RPC server, tests' subprocesses) get every core this one had.
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    configure = tvm.get_global_func("runtime.config_threadpool")
    if "TVM_BIND_THREADS" in os.environ:
        configure(0, threads)  # mode 0: the placement as TVM made it
    else:
        configure(SHARE_ALL_CORES, threads, [str(cpu) for cpu in pool_cpus(threads)])
    if mask is not None:
        os.sched_setaffinity(0, mask)


# Memory bandwidth

DEFAULT_BANDWIDTH_MB = 256  # 8x the 32 MB L3 of the machines this was written on; see default_bandwidth_mb()
BANDWIDTH_REPEATS = 5
_LANES = 64  # floats per inner step: four independent 16-lane (AVX-512) or sixteen 4-lane (NEON) accumulators
_CHUNKS_PER_THREAD = 8


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of cpu0 as sysfs reports it (Linux), or None."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            sizes.append(int(match[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match[2]])
    return max(sizes, default=None)


def default_bandwidth_mb() -> int:
    """An array size well above the last-level cache: 8x it, at least DEFAULT_BANDWIDTH_MB."""
    cache = last_level_cache_bytes() or 0
    return max(DEFAULT_BANDWIDTH_MB, 8 * cache // 2**20)


def _read_kernels(chunks: int, per_chunk: int):
    """fill(a): a[...] = 1; read_sum(a, out): out[p, :] = the sum of chunk p, lane by lane."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    lanes = _LANES

    @T.prim_func
    def fill(a: T.Buffer((chunks, per_chunk, lanes), "float32")):
        T.func_attr({"global_symbol": "fill", "tir.noalias": True})
        for p in T.parallel(chunks):
            for m in range(per_chunk):
                for v in T.vectorized(lanes):
                    a[p, m, v] = T.float32(1)

    @T.prim_func
    def read_sum(a: T.Buffer((chunks, per_chunk, lanes), "float32"), out: T.Buffer((chunks, lanes), "float32")):
        T.func_attr({"global_symbol": "read_sum", "tir.noalias": True})
        for p in T.parallel(chunks):
            acc = T.alloc_buffer((lanes,), "float32", scope="local")
            for v in T.vectorized(lanes):
                acc[v] = T.float32(0)
            for m in range(per_chunk):
                for v in T.vectorized(lanes):
                    acc[v] = acc[v] + a[p, m, v]
            for v in T.vectorized(lanes):
                out[p, v] = acc[v]

    target = tvm.target.Target(host_target_json())  # never a CPU name alone: it may promise more than the CPU has
    return tvm.compile(tvm.IRModule({"fill": fill, "read_sum": read_sum}), target=target)


def measure_read_bandwidth(threads: int | None, size_mb: float | None = None,
                           repeats: int = BANDWIDTH_REPEATS) -> float:
    """Memory read bandwidth in GB/s (1e9 bytes/s) with `threads` TVM threads (None: the pool as it is; else
    the pool is resized, as `set_threads`): a float32 array of `size_mb` MiB (default: default_bandwidth_mb())
    summed by a TVM kernel, parallel over chunks and vectorized; the best of `repeats` runs."""
    if threads is not None:
        set_threads(threads)
    size_mb = default_bandwidth_mb() if size_mb is None else size_mb
    if size_mb <= 0 or repeats < 1:
        raise MobilecError(f"the bandwidth array needs a positive size and at least one repeat, got {size_mb:g} "
                           f"MiB and {repeats}")
    chunks = _CHUNKS_PER_THREAD * (threads or os.cpu_count() or 1)
    per_chunk = max(1, int(size_mb * 2**20) // (4 * _LANES * chunks))
    if per_chunk > 2**24:  # the float32 check sum below stays exact up to 2**24 per lane
        raise MobilecError(f"a bandwidth array of {size_mb:g} MiB is too large for {chunks} chunks of float32 sums")
    lib = _read_kernels(chunks, per_chunk)
    a = tvm.runtime.empty((chunks, per_chunk, _LANES), "float32", tvm.cpu())
    out = tvm.runtime.empty((chunks, _LANES), "float32", tvm.cpu())
    lib["fill"](a)  # also the first touch of every page, outside the timing
    read_sum = lib["read_sum"]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        read_sum(a, out)
        best = min(best, time.perf_counter() - start)
    total = out.numpy().sum(dtype=np.float64)
    if total != chunks * per_chunk * _LANES:  # a kernel that skipped data would look fast
        raise RuntimeError(f"the bandwidth kernel summed {total}, expected {chunks * per_chunk * _LANES}")
    return chunks * per_chunk * _LANES * 4 / best / 1e9


def numpy_read_bandwidth(size_mb: float | None = None, repeats: int = BANDWIDTH_REPEATS) -> dict[str, float]:
    """Cross-checks of measure_read_bandwidth with numpy (one thread): `a.sum()` (bytes read / time) and
    `np.copyto` (bytes read + bytes written / time), best of `repeats`."""
    size_mb = default_bandwidth_mb() if size_mb is None else size_mb
    a = np.ones(int(size_mb * 2**20) // 4, "float32")
    b = np.empty_like(a)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    return {"numpy_sum_gbs": a.nbytes / best(a.sum) / 1e9,
            "numpy_copy_gbs": 2 * a.nbytes / best(lambda: np.copyto(b, a)) / 1e9}


def host_bandwidth_gbs() -> float:
    """This machine's read bandwidth with every usable core (measure_read_bandwidth), measured once per CPU and
    core count and cached (user_cache.py): a target file cannot know the machine it is loaded on."""
    key = hashlib.sha256(json.dumps([cpu_model_name(), sorted(cpu_flags()), usable_cores()]).encode()).hexdigest()[:16]
    path = cache_path(f"host-bandwidth-{key}.json")
    try:
        return float(json.loads(path.read_text())["gbs"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    gbs = measure_read_bandwidth(None, repeats=3)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"gbs": gbs, "cpu": cpu_model_name(), "cores": usable_cores(),
                                   "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
        tmp.replace(path)
    except OSError:  # a read-only home: measure again next time
        pass
    return gbs
