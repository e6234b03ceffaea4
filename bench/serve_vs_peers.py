"""`mobilec serve` beside llama.cpp's `llama-server` on the same GGUF, side by side in one run: for N concurrent
streaming clients, each asking --new-tokens (end of text ignored) after its own random --prompt-tokens prompt of token
ids, the aggregate tok/s (every stream's tokens over the wall time, prompts included), the mean per-stream decode
tok/s, TTFT p50/p99; and how long our /health takes to answer meanwhile (the event loop must not wait for the model).

    .venv/bin/python bench/serve_vs_peers.py ARTIFACT --gguf MODEL.gguf --llama-server BUILD/bin/llama-server \\
        --threads 2 --streams 1 2 4 8

Without --llama-server, ours only. llama-server is built beside the project, never committed, from the vendored
llama.cpp of llama-cpp-python's source package (the version the `bench` extra pins):

    .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp
    cmake -S /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/lcpp/build -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build /tmp/lcpp/build --target llama-server -j"$(nproc)"

Both servers get every stream count's slots at once (ours --max-sessions, llama-server -np with continuous batching)
and the same threads; each slot of llama-server has the artifact's context window. First, `mobilec bench` of the
artifact (no server, the same prompt length, tokens and threads) gives the decode rate one stream through the server
is held to. Prints one JSON object per (server, stream count), then the ratios: aggregate decode is the streams'
summed per-stream decode rates (prefill excluded), aggregate the tokens over the wall time (prompts included)."""

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
    """One streaming completion; the arrival time of every event that carries a token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        sys.exit(f"the server answered {response.status}: {response.read()[:300]!r}")
    arrivals = []
    for line in response:
        if line.startswith(b"data: {") and b'"text"' in line:
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


def wait_healthy(port: int, server: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode} before it answered")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit("the server did not answer /health in time")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(name: str, port: int, streams: int, prompts: list[list[int]], new_tokens: int, watch_health: bool) -> dict:
    results: list[dict] = [{}] * streams
    stop, health = threading.Event(), []
    watcher = threading.Thread(target=health_latency, args=(port, stop, health)) if watch_health else None
    if watcher:
        watcher.start()

    def run(i: int) -> None:
        results[i] = stream(port, prompts[i], new_tokens)

    clients = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.perf_counter() - started
    stop.set()
    if watcher:
        watcher.join()
    ttfts = [r["ttft_s"] for r in results]
    return {
        "server": name, "streams": streams, "prompt_tokens": len(prompts[0]), "new_tokens": new_tokens,
        "aggregate_tok_s": round(streams * new_tokens / wall, 2),
        "per_stream_decode_tok_s": round(statistics.mean((new_tokens - 1) / r["decode_s"] for r in results), 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        **({"health_p50_ms": round(1e3 * statistics.median(health), 1),
            "health_max_ms": round(1e3 * max(health), 1)} if health else {})}


def generate_decode_tok_s(args) -> float:
    """`mobilec bench`'s decode tok/s of the artifact in one process, no server: what `mobilec generate` decodes at."""
    run = subprocess.run([sys.executable, "-m", "compiler", "bench", args.artifact, "--prompt-len",
                          str(args.prompt_tokens), "--gen-len", str(args.new_tokens), "--repeat", "3", "--threads",
                          str(args.threads), "--json"], capture_output=True, text=True, check=False)
    if run.returncode != 0:
        sys.exit(f"mobilec bench failed: {run.stderr.strip().splitlines()[-1:]}")
    report = json.loads(run.stdout)
    print(json.dumps({"server": None, "mobilec_bench_decode_tok_s": round(report["decode_tok_s"], 2)}), flush=True)
    return report["decode_tok_s"]


def run_server(name: str, command: list[str], port: int, args, vocab: int) -> list[dict]:
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        wait_healthy(port, server)
        rng = random.Random(0)  # the same prompts for both servers
        stream(port, [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)], 4)  # warm up
        for n in args.streams:
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for _ in range(n)]
            rows.append(measure(name, port, n, prompts, args.new_tokens, watch_health=name == "mobilec"))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--gguf", help="the GGUF file the artifact was compiled from (for llama-server)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (see the top of this file)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    if args.llama_server and not args.gguf:
        sys.exit("--llama-server needs --gguf, the GGUF file the artifact was compiled from")
    config = json.loads((Path(args.artifact) / "mobilec-config.json").read_text())
    vocab, context = config["model"]["config"]["vocab_size"], int(config["context_window"])
    slots = max(args.streams)
    generate = generate_decode_tok_s(args)
    port = free_port()
    ours = run_server("mobilec", [sys.executable, "-m", "compiler", "serve", args.artifact, "--port", str(port),
                                  "--max-sessions", str(slots), "--threads", str(args.threads)], port, args, vocab)
    one = ours[0]["per_stream_decode_tok_s"] if ours[0]["streams"] == 1 else None
    for a in ours:
        print(json.dumps({"streams": a["streams"],
                          **({"one_stream_over_mobilec_bench": round(one / generate, 2)} if a["streams"] == 1 else {}),
                          **({"aggregate_decode_over_our_one_stream":
                              round(a["streams"] * a["per_stream_decode_tok_s"] / one, 2)} if one else {})}))
    if not args.llama_server:
        return
    port = free_port()
    peer = run_server("llama-server", [args.llama_server, "-m", args.gguf, "--port", str(port), "-np", str(slots),
                                       "-c", str(context * slots), "-t", str(args.threads), "-tb", str(args.threads),
                                       "--cont-batching"], port, args, vocab)
    for a, b in zip(ours, peer):
        print(json.dumps({"streams": a["streams"],
                          "aggregate_ours_over_llama_server": round(a["aggregate_tok_s"] / b["aggregate_tok_s"], 2),
                          "aggregate_over_our_one_stream": round(a["aggregate_tok_s"] / ours[0]["aggregate_tok_s"], 2),
                          "ttft_p50_ours_over_llama_server": round(a["ttft_p50_s"] / b["ttft_p50_s"], 2)}))


if __name__ == "__main__":
    main()
