"""Time one model step of `decode` (one sequence) against `batch_decode` (B sequences, one model call: what `mobilec
serve` runs for B streams) in one process, for one or more artifacts side by side: each artifact gets its own paged
KV cache of 8 sequences with --prompt-tokens prefilled each, then every round times one step at each batch size,
interleaved between the artifacts, so that two versions of the kernels meet the same machine load. Prints per
artifact and batch size the median step (with its range) and the aggregate decode over one sequence's, B x the
one-sequence step over the B-sequence step (the serving goal's `aggregate_decode_over_our_one_stream`, without the
server). Each step appends a token to the sequences it decodes.

    PYTHONPATH=$PWD python bench/batch_decode_steps.py BEFORE_ARTIFACT AFTER_ARTIFACT --threads 2 --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import tvm

from compiler.artifacts.artifact import load_artifact
from compiler.runtime.session import LoadedArtifact
from compiler.target.host import set_threads

SEQUENCES = 8


def prepared(path: str, prompt_tokens: int) -> tuple[LoadedArtifact, object]:
    """The artifact at `path` and its KV cache of SEQUENCES sequences, each with `prompt_tokens` random ids prefilled."""
    model = LoadedArtifact(load_artifact(path))
    dev = model.device
    kv = model.create_kv_cache(SEQUENCES, SEQUENCES * (prompt_tokens + 384))
    add = dev.function("vm.builtin.kv_state_add_sequence")
    rng = np.random.default_rng(0)
    for seq in range(SEQUENCES):
        add(kv, seq)
        ids = rng.integers(10, 40000, prompt_tokens).astype("int32")
        model.forward(model.prefill_function, tvm.runtime.tensor(ids, dev.dev), kv, dev.shape(seq),
                      dev.shape(prompt_tokens))
    return model, kv


def step_seconds(model: LoadedArtifact, kv, batch: int) -> float:
    """One step of sequences 0 .. batch - 1 (`decode` for one), its wall time."""
    dev = model.device
    func = model.decode_function if batch == 1 else model.batch_decode_function
    ids = tvm.runtime.tensor(np.full(batch, 42, "int32"), dev.dev)
    start = time.perf_counter()
    model.first_output(model.forward(func, ids, kv, dev.shape(*range(batch)), dev.shape(*[1] * batch)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    args = parser.parse_args()
    if 1 not in args.batches or max(args.batches) > SEQUENCES:
        parser.error(f"--batches must include 1 (the baseline) and stay within {SEQUENCES}")
    set_threads(args.threads)
    models = [prepared(path, args.prompt_tokens) for path in args.artifacts]
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in args.batches:
            for index, (model, kv) in enumerate(models):
                times.setdefault((index, batch), []).append(step_seconds(model, kv, batch))
    for index, path in enumerate(args.artifacts):
        one = statistics.median(times[(index, 1)])
        print(path)
        for batch in args.batches:
            runs = times[(index, batch)]
            step = statistics.median(runs)
            print(f"  B={batch}: step {1e3 * step:.2f} ms ({1e3 * min(runs):.2f}-{1e3 * max(runs):.2f}), "
                  f"{step / one:.2f}x the one-sequence step, aggregate {batch * one / step:.2f}x one sequence")


if __name__ == "__main__":
    main()
