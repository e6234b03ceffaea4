"""A multi-turn chat through the serving engine alone (no HTTP), one session: each turn's prompt is the whole history
(earlier turns and their answers) plus --turn-tokens new random token ids, greedy --answer-tokens tokens each; prints
each turn's TTFT (submission to first token: the prefill of the tokens not in the cached prefix) and turn N over
turn 1. Several artifacts (e.g. before and after a kernel change) run side by side in one process, their turns
interleaved chat by chat, --repeat chats each; the median of each turn is printed, and whether each artifact's
greedy tokens were the same in every chat. With TVM_NUM_THREADS=1 the kernels run on the thread that steps the
engine, whose CPU time to the first token (also printed) is then the prefill's work whatever else the machine runs
(a shared machine's wall times swing by +-30%).

    PYTHONPATH=$PWD .venv/bin/python bench/chat_turns.py ARTIFACT [ARTIFACT ...] --turns 5 --turn-tokens 300 \\
        --answer-tokens 32 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from compiler.artifacts.artifact import load_artifact
from compiler.runtime.session import LoadedArtifact
from compiler.serve.engine import Engine, Finished, Request, SamplingParams, Token


def chat(engine: Engine, turns: list[list[int]], answer_tokens: int) -> tuple[list[float], list[int], list[int],
                                                                            list[float]]:
    """TTFT of each turn (s), the cached history before it (tokens), every greedy token and this thread's CPU time
    to each turn's first token (s), on a fresh engine."""
    history: list[int] = []
    ttfts, cached, tokens, cpu = [], [], [], []
    for new in turns:
        events: list = []
        request = Request(history + new, SamplingParams(max_tokens=answer_tokens), events.append)
        cpu_start = time.thread_time()
        engine.submit(request)
        first = None
        while engine.step():
            if first is None and any(isinstance(e, Token) for e in events):
                first = time.perf_counter()
                cpu.append(time.thread_time() - cpu_start)
        done = events[-1]
        assert isinstance(done, Finished), done
        ttfts.append(first - request.submitted_at)
        cached.append(done.prompt_tokens - done.prefilled_tokens)
        answer = [e.token_id for e in events if isinstance(e, Token)]
        tokens += answer
        history = history + new + answer
    return ttfts, cached, tokens, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    models = [LoadedArtifact(load_artifact(path)) for path in args.artifacts]
    vocab = min(int(m.artifact.config["model"]["config"]["vocab_size"]) for m in models)
    rng = np.random.default_rng(args.seed)
    turns = [[int(t) for t in rng.integers(100, vocab, args.turn_tokens)] for _ in range(args.turns)]
    results: list[list[tuple[list[float], list[int], list[int], list[float]]]] = [[] for _ in models]
    for _ in range(args.repeat):
        for model, runs in zip(models, results):  # each chat on a fresh engine: an empty cache
            runs.append(chat(Engine(model, lambda ids: "", max_sessions=1), turns, args.answer_tokens))
    for path, runs in zip(args.artifacts, results):
        medians = [statistics.median(r[0][i] for r in runs) * 1e3 for i in range(args.turns)]
        print(path)
        print("  cached history:", runs[0][1])
        for k, r in enumerate(runs):
            print(f"  chat {k + 1} TTFT ms:", " ".join(f"{t * 1e3:.0f}" for t in r[0]))
        print("  median TTFT ms:", " ".join(f"{m:.0f}" for m in medians),
              f"| turn {args.turns} / turn 1 = {medians[-1] / medians[0]:.2f}x")
        cpu = [statistics.median(r[3][i] for r in runs) * 1e3 for i in range(args.turns)]
        print("  median CPU ms of this thread to the first token:", " ".join(f"{m:.0f}" for m in cpu),
              f"| turn {args.turns} / turn 1 = {cpu[-1] / cpu[0]:.2f}x")
        print("  same greedy tokens in every chat:", all(r[2] == runs[0][2] for r in runs))
    if len(results) > 1:
        print("greedy tokens equal across artifacts:", all(r[0][2] == results[0][0][2] for r in results))


if __name__ == "__main__":
    main()
