"""The server's counters, gauges and histograms, written as Prometheus text (no client library: a few dozen lines)."""

from __future__ import annotations

import bisect
import threading

# seconds: time to first token and time between tokens, from a fast CPU to a slow board
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Counter:
    def __init__(self, name: str, help_text: str):
        self.name, self.help, self.value = name, help_text, 0.0
        self._lock = threading.Lock()

    def inc(self, amount: float = 1) -> None:
        with self._lock:
            self.value += amount

    def text(self) -> str:
        return f"# HELP {self.name} {self.help}\n# TYPE {self.name} counter\n{self.name} {self.value:g}\n"


class Gauge(Counter):
    def set(self, value: float) -> None:
        self.value = value

    def text(self) -> str:
        return f"# HELP {self.name} {self.help}\n# TYPE {self.name} gauge\n{self.name} {self.value:g}\n"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf only)
        self.sum, self.count = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def text(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {cumulative}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:g}",
                  f"{self.name}_count {self.count}"]
        return "\n".join(lines) + "\n"


class Metrics:
    def __init__(self):
        self.requests = Counter("mobilec_requests_total", "Generation requests accepted by the engine.")
        self.cancelled = Counter("mobilec_cancelled_requests_total",
                                 "Requests stopped before their end (a client that went away), sequences freed.")
        self.generated_tokens = Counter("mobilec_generated_tokens_total", "Tokens generated.")
        self.prefilled_tokens = Counter("mobilec_prefilled_tokens_total", "Prompt tokens run through the model.")
        self.prefix_reused_tokens = Counter("mobilec_prefix_reused_tokens_total",
                                            "Prompt tokens taken from a cached prefix instead of prefilled.")
        self.queue_length = Gauge("mobilec_queue_length", "Requests waiting for a session.")
        self.sequences_active = Gauge("mobilec_sequences_active", "Sequences generating.")
        self.sequences_cached = Gauge("mobilec_sequences_cached", "Finished sequences kept as reusable prefixes.")
        self.kv_pages_used = Gauge("mobilec_kv_pages_used", "KV-cache pages in use.")
        self.kv_pages_total = Gauge("mobilec_kv_pages_total", "KV-cache pages in all.")
        self.ttft_s = Histogram("mobilec_time_to_first_token_seconds", "From a request's arrival to its first token.")
        self.token_latency_s = Histogram("mobilec_time_per_output_token_seconds", "Between a sequence's tokens.")

    def text(self) -> str:
        return "".join(m.text() for m in vars(self).values())
