"""`mobilec eval`: perplexity of a compiled model against its float reference, and per-layer cosine similarity."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from .. import validate
from ..artifacts.artifact import Artifact, load_artifact
from ..errors import MobilecError
from ..loaders.tokenizer import load_tokenizer
from ..target.host import set_threads
from .session import Session


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under the logits [n, vocab] (float64 for a stable log-sum-exp)."""
    logits = logits.astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return log_z - logits[np.arange(len(targets)), targets]


def load_reference(path: str | Path):
    """The float model transformers builds from the checkpoint (dequantized if it is a GGUF)."""
    import torch  # pylint: disable=import-outside-toplevel
    from transformers import AutoModelForCausalLM  # pylint: disable=import-outside-toplevel

    path = check_reference(path)
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    root = path.parent if path.is_file() else path
    try:
        return AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32, **kwargs).eval()
    except Exception as err:  # noqa: BLE001  transformers raises many types for a checkpoint it cannot read
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MobilecError(f"transformers cannot load the reference model {path} ({first}); pass --reference with "
                           f"the float checkpoint the artifact was built from") from None


def check_reference(path: str | Path) -> Path:
    """The reference checkpoint exists (checked before loading anything)."""
    path = Path(path)
    if not path.exists():
        raise MobilecError(f"reference model {path} not found; pass --reference with the checkpoint the artifact was built from")
    return path


def _window_cap(artifact: Artifact, window: int) -> int:
    """--window, capped by the artifact (its context window and prefill chunk: one prefill call per window)."""
    return min(window, int(artifact.config["context_window"]), int(artifact.config["prefill_chunk"]))


def eval_windows(artifact: Artifact, text: str, max_tokens: int, window: int) -> list[list[int]]:
    """The token windows `evaluate` measures: the options and the text checked, and tokenized with the artifact's
    tokenizer (fast), so that a bad value is refused before the reference model loads (~30 s)."""
    validate.tokens(max_tokens, "--max-tokens", least=2)
    validate.tokens(window, "--window", least=2)
    validate.text(text, "the --text file's contents")
    window = _window_cap(artifact, window)
    ids = load_tokenizer(artifact.tokenizer_dir).encode(text)[:max_tokens]
    if len(ids) < 2:
        raise MobilecError(f"the text has {len(ids)} token(s); perplexity needs at least 2: pass a longer --text file")
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) >= 2]


def _reference_logits_and_layers(model, ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    import torch  # pylint: disable=import-outside-toplevel

    captured: list[np.ndarray] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(
        (out[0] if isinstance(out, tuple) else out)[0].float().numpy())) for layer in model.model.layers]
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, captured


def _mean_token_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    dots = (a * b).sum(axis=-1)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return float(np.mean(dots / np.maximum(norms, 1e-30)))


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """What `mobilec eval` is asked."""

    artifact: str  # the directory `mobilec compile` wrote
    text_file: str  # UTF-8 text to measure perplexity on
    reference: str | None = None  # the float checkpoint to compare with (default: the one compiled)
    max_tokens: int = 1024  # evaluate the first N tokens
    window: int = 512  # tokens per window (capped by the artifact)
    threads: int | None = None
    compare: bool = True  # False: the artifact's perplexity alone (no reference model loaded, no layer cosines)


def evaluate(options: EvalOptions, progress=lambda done, total: None) -> dict[str, Any]:
    """Perplexity over non-overlapping windows of the text, compiled vs reference; layer cosines on window one.
    Every option, the text and the reference's path are checked before the reference model loads (~30 s)."""
    validate.threads(options.threads)
    validate.tokens(options.max_tokens, "--max-tokens", least=2)
    validate.tokens(options.window, "--window", least=2)
    text = validate.read_text_file(options.text_file, "--text")
    artifact = load_artifact(options.artifact)
    max_tokens, window = options.max_tokens, options.window
    windows = eval_windows(artifact, text, max_tokens, window)
    if options.compare:
        reference_path = check_reference(options.reference or artifact.config["model"]["path"])
    elif options.reference is not None:
        raise MobilecError("--reference names the model to compare with, which --no-reference skips; drop one")
    set_threads(options.threads)
    reference = load_reference(reference_path) if options.compare else None
    window = _window_cap(artifact, window)
    session = Session(artifact)
    nll, ref_nll, layer_cosine = [], [], []
    for n, chunk in enumerate(windows):
        targets = np.asarray(chunk[1:])
        session.reset()
        if n == 0 and reference is not None:
            hidden = session.prefill_hidden_states(chunk)
            session.reset()
        logits = session.prefill_all_logits(chunk)
        nll.append(_nll(logits[:-1], targets))
        if reference is not None:
            ref_logits, ref_layers = _reference_logits_and_layers(reference, chunk)
            if n == 0:
                layer_cosine = [_mean_token_cosine(h, r) for h, r in zip(hidden, ref_layers)]
            ref_nll.append(_nll(ref_logits[:-1], targets))
        progress(n + 1, len(windows))
    ppl = float(np.exp(np.concatenate(nll).mean()))
    ref_ppl = float(np.exp(np.concatenate(ref_nll).mean())) if reference is not None else None
    return {
        "ppl": ppl,
        "ref_ppl": ref_ppl,
        "ppl_delta_pct": 100.0 * (ppl - ref_ppl) / ref_ppl if reference is not None else None,
        "layer_cosine": layer_cosine,
        "tokens": sum(len(w) for w in windows),
        "window": window,
        "quant": artifact.config["quantization"]["name"],
    }
