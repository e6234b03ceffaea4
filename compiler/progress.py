"""What a long command reports on stderr as it goes: one line per step (with its time and peak memory) and counts
within a step, a bar with time left on a terminal, a line every few seconds otherwise (a CI log, `2> file`).
stdout is never written here, so `--json` output stays one object."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
LINE_EVERY_S = 10.0  # off a terminal: a count line at most this often (and at the end)
_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory since it started (VmHWM); None off Linux."""
    return _status_bytes("VmHWM")


def rss_bytes() -> int | None:
    """This process's resident memory now (VmRSS); None off Linux."""
    return _status_bytes("VmRSS")


class _StepPeak:
    """A step's own peak resident memory, without resetting the kernel's high-water mark (which `time -v` and a
    parent's wait4 read): where the step raised the process's peak, that peak, exact; else the most a thread
    polling VmRSS every SAMPLE_S saw."""

    SAMPLE_S = 0.02

    def __init__(self):
        self.start_rss, self._start_peak = rss_bytes(), peak_rss_bytes()
        self._seen = self.start_rss or 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(self.SAMPLE_S):
            self._seen = max(self._seen, rss_bytes() or 0)

    def stop(self) -> int | None:
        self._done.set()
        self._thread.join()
        peak = peak_rss_bytes()
        if peak is None:
            return None
        return peak if peak > (self._start_peak or 0) else max(self._seen, rss_bytes() or 0)


class Steps:
    """Numbered steps of one command: `with steps.step("build"):` prints the step as it starts and its seconds and
    peak resident memory as it ends; `steps.counted(items, sizes, what)` and `steps.reporter(what)` report progress
    inside it. `record` holds each step's figures for the command's summary."""

    def __init__(self, command: str, total: int, enabled: bool = True):
        self.command, self.total, self.enabled = command, total, enabled
        self.tty = sys.stderr.isatty()
        self.record: dict[str, dict[str, Any]] = {}
        self._index = 0

    def log(self, message: str) -> None:
        if self.enabled:
            print(f"{self.command}: {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def step(self, name: str, detail: str = "") -> Iterator[None]:
        self._index += 1
        self.log(f"[{self._index}/{self.total}] {name}{': ' + detail if detail else ''}")
        memory = _StepPeak()
        start = time.perf_counter()
        try:
            yield
        finally:
            peak = memory.stop()
        seconds = time.perf_counter() - start
        self.record[name] = {"seconds": round(seconds, 2), "start_rss_bytes": memory.start_rss,
                             "peak_rss_bytes": peak}
        figure = f", peak memory {peak / 2**30:.2f} GiB" if peak is not None else ""
        self.log(f"[{self._index}/{self.total}] {name} done in {seconds:.1f} s{figure}")

    def reporter(self, what: str) -> Callable[[int, int], None]:
        """A (done, total) callback for work in equal parts (eval's windows): a line at most every LINE_EVERY_S
        seconds and at the end, with the time left."""
        start = time.perf_counter()
        last = [start]

        def report(done: int, total: int) -> None:
            now = time.perf_counter()
            if self.enabled and done and (now - last[0] >= LINE_EVERY_S or done == total):
                self.log(f"  {what} {done}/{total}, {(now - start) / done * (total - done):.0f} s left")
                last[0] = now

        return report

    def counted(self, items: Iterable[T], sizes: list[int], what: str) -> Iterator[T]:
        """`items` passed through, `sizes` their shares of the work (the time left is the rest's share at the rate so
        far): a bar on a terminal, else a line every LINE_EVERY_S seconds and at the end."""
        total, whole = len(sizes), sum(sizes) or 1
        if not self.enabled:
            yield from items
            return
        if self.tty:
            yield from tqdm(items, total=total, desc=f"{self.command}: {what}", file=sys.stderr, leave=False)
            return
        start = last = time.perf_counter()
        done_size = 0
        for done, (item, size) in enumerate(zip(items, sizes, strict=True), 1):
            yield item
            done_size += size
            now = time.perf_counter()
            if now - last >= LINE_EVERY_S or done == total:
                left = (now - start) / max(done_size, 1) * (whole - done_size)
                self.log(f"  {what} {done}/{total} ({100 * done_size / whole:.0f}% of the bytes), {left:.0f} s left")
                last = now
