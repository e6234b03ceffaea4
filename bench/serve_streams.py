"""Aggregate and per-stream decode tok/s and TTFT of `mobilec serve` at several concurrent streaming clients, and how
long /health takes to answer meanwhile (the event loop must not wait for model calls).

    .venv/bin/python bench/serve_streams.py ARTIFACT --streams 1 4 --prompt-tokens 128 --new-tokens 64

Starts the server on a free port with --max-sessions = the largest --streams; every client asks the same number of
tokens (ignore_eos) after its own random prompt of token ids. Prints one JSON object per stream count."""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(port: int, prompt: list[int], new_tokens: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    arrivals = []
    for line in response:
        if line.startswith(b"data: {"):
            arrivals.append(time.perf_counter())
    first, last = arrivals[0], arrivals[-1]
    return {"ttft_s": first - start, "decode_s": last - first, "events": len(arrivals)}


def health_latency(port: int, stop: threading.Event, samples: list[float]) -> None:
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        start = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        samples.append(time.perf_counter() - start)
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    vocab = json.loads((Path(args.artifact) / "mobilec-config.json").read_text())["model"]["config"]["vocab_size"]
    port = free_port()
    command = [sys.executable, "-m", "compiler", "serve", args.artifact, "--port", str(port), "--json",
               "--max-sessions", str(max(args.streams))] + (["--threads", str(args.threads)] if args.threads else [])
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        if not server.stdout.readline():
            sys.exit("the server did not start")
        rng = random.Random(0)
        stream(port, [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)], 4)  # warm up
        for n in args.streams:
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for _ in range(n)]
            results: list[dict] = [{}] * n
            stop, health = threading.Event(), []
            watcher = threading.Thread(target=health_latency, args=(port, stop, health))
            watcher.start()

            def run(i: int) -> None:
                results[i] = stream(port, prompts[i], args.new_tokens)

            clients = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            started = time.perf_counter()
            for c in clients:
                c.start()
            for c in clients:
                c.join()
            wall = time.perf_counter() - started
            stop.set()
            watcher.join()
            per_stream = [(args.new_tokens - 1) / r["decode_s"] for r in results]
            ttfts = sorted(r["ttft_s"] for r in results)
            print(json.dumps({
                "streams": n, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "aggregate_tok_s": round(n * args.new_tokens / wall, 2),
                "per_stream_decode_tok_s": round(statistics.mean(per_stream), 2),
                "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_max_s": round(ttfts[-1], 3),
                "health_p50_ms": round(1e3 * statistics.median(health), 1) if health else None,
                "health_max_ms": round(1e3 * max(health), 1) if health else None}), flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    main()
