"""Decode-path accuracy: perplexity of artifacts whose tokens all go through decode steps, against the float model.

    mobilec compile --model default --target host --quant gguf -o build/acc-int16
    mobilec compile --model default --target host --quant gguf --decode-activations int8 -o build/acc-int8
    .venv/bin/python bench/decode_perplexity.py --artifact build/acc-int16 --artifact build/acc-int8

`mobilec eval` scores prefill windows, which never run the decode GEMVs (kernels/integer_dot_gemv) and so cannot
show what `--decode-activations` costs. Here the first --tokens tokens of --text (default CPython's LICENSE, as
`mobilec eval`), tokenized by the first artifact's tokenizer, are fed one at a time after a one-token prefill
(teacher-forced), and each step's logits score the next token (compiler/runtime/evaluate.py's _nll); the float
reference (transformers, from the first artifact's checkpoint) scores the same ids in one forward pass. Printed
per artifact: its decode activations, perplexity and change against the float model's, the share of steps whose
top token is the float model's, and the largest logit difference from it. The x86 build's int8 activations round
as ARM's (the same activation kernel), so a host artifact measures what the ARM targets' default costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compiler.artifacts.artifact import load_artifact
from compiler.errors import MobilecError
from compiler.loaders.tokenizer import load_tokenizer
from compiler.runtime.evaluate import _nll, load_reference
from compiler.runtime.session import Session
from compiler.target.host import set_threads

DEFAULT_TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def decode_logits(session: Session, ids: list[int]) -> np.ndarray:
    """The logits [len(ids) - 1, vocab] after each of ids[:-1]: the first from a one-token prefill, the rest from
    one decode step each."""
    rows = [session.prefill(ids[:1])]
    rows += [session.decode(token) for token in ids[1:-1]]
    return np.stack(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, action="append", help="an artifact this machine runs")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text (default: CPython's LICENSE)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens scored, from the start (default 512)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--json", dest="as_json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be at least 2")
    set_threads(args.threads)
    try:
        artifacts = [load_artifact(path) for path in args.artifact]
        ids = load_tokenizer(artifacts[0].tokenizer_dir).encode(Path(args.text).read_text())[:args.tokens]
        for artifact in artifacts:
            if int(artifact.config["context_window"]) < len(ids):
                parser.error(f"{artifact.path} holds {artifact.config['context_window']} tokens; pass --tokens "
                             f"{artifact.config['context_window']} or compile it with --context-window {len(ids)}")
        targets = np.array(ids[1:])
        with torch.no_grad():
            reference = load_reference(artifacts[0].config["model"]["path"])(torch.tensor([ids])).logits[0, :-1]
        reference = reference.numpy()
        results = {"float reference": {"perplexity": float(np.exp(_nll(reference, targets).mean()))}}
        for artifact in artifacts:
            print(f"decoding {len(ids) - 1} steps of {artifact.path}", file=sys.stderr)
            logits = decode_logits(Session(artifact), ids)
            results[str(artifact.path)] = {
                "decode_activations": artifact.config.get("decode_activations"),
                "perplexity": float(np.exp(_nll(logits, targets).mean())),
                "top_token_as_float": float((logits.argmax(1) == reference.argmax(1)).mean()),
                "max_logit_difference": float(np.abs(logits - reference).max())}
    except MobilecError as err:
        parser.exit(2, f"{Path(sys.argv[0]).name}: error: {err}\n")
    if args.as_json:
        print(json.dumps(results))
        return 0
    base = results["float reference"]["perplexity"]
    print(f"\n{len(ids)} tokens of {Path(args.text).name}, each scored after a decode step "
          f"(float reference {base:.3f})")
    print(f"{'artifact':40s} {'activations':>11s} {'perplexity':>10s} {'vs float':>8s} {'top = float':>11s} "
          f"{'max |dlogit|':>12s}")
    for name, row in results.items():
        if "decode_activations" in row:
            print(f"{name:40s} {str(row['decode_activations']):>11s} {row['perplexity']:10.3f} "
                  f"{100 * (row['perplexity'] / base - 1):+7.2f}% {100 * row['top_token_as_float']:10.1f}% "
                  f"{row['max_logit_difference']:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
