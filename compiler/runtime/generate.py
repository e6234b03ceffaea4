"""Text generation on a Session: sampling, streaming, and the timings users compare runtimes by."""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable

import numpy as np

from .. import validate
from ..artifacts.artifact import load_artifact
from ..errors import MobilecError
from ..loaders.tokenizer import load_tokenizer
from ..model_import import chat_prompt
from ..target.cpu_check import check_cpu, this_cpu
from ..target.host import set_threads
from .session import Session


@dataclasses.dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float | None  # None when only one token was generated (no decode step to time)
    peak_rss_mb: float


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator, top_k: int = 0) -> int:
    """Greedy when temperature is 0; otherwise nucleus sampling among the `top_k` likeliest tokens (0: all)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    scaled = (logits - logits.max()) / temperature
    probs = np.exp(scaled)
    probs /= probs.sum()
    order = np.argsort(-probs)
    if top_k > 0:
        order = order[:top_k]
    cumulative = np.cumsum(probs[order]) / probs[order].sum()
    keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]
    return int(rng.choice(keep, p=probs[keep] / probs[keep].sum()))


def log_probabilities(logits: np.ndarray) -> np.ndarray:
    """The model's log-probabilities (before temperature and truncation): what OpenAI's logprobs report."""
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def check_fits(prompt_tokens: int, new_tokens: int, context_window: int) -> None:
    """The prompt and every token asked for must fit the context window together: refused before generating, with
    the figures, rather than stopped mid-stream (the last token generated is not fed back, hence the - 1)."""
    if not prompt_tokens:
        raise MobilecError("the prompt is empty; pass a non-empty --prompt")
    if prompt_tokens > context_window:
        raise MobilecError(f"the prompt has {prompt_tokens} tokens, more than the artifact's context window of "
                           f"{context_window}; shorten it or recompile with a larger --context-window")
    if prompt_tokens + new_tokens - 1 > context_window:
        room = context_window - prompt_tokens + 1
        raise MobilecError(f"the prompt's {prompt_tokens} tokens + --max-new-tokens {new_tokens} exceed the artifact's "
                           f"context window of {context_window}; pass --max-new-tokens {room} or less, or recompile "
                           f"with a larger --context-window")


def generate(
    session: Session,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: frozenset[int] = frozenset(),
    on_token: Callable[[int], None] | None = None,
    decode_text: Callable[[list[int]], str] = lambda ids: "",
) -> GenerationResult:
    """Prefill the prompt, then decode token by token until max_new_tokens or a stop id. A prompt and output that
    do not fit the context window are refused before anything runs (check_fits)."""
    validate.tokens(max_new_tokens, "--max-new-tokens")
    validate.temperature(temperature)
    validate.probability(top_p, "--top-p")
    validate.seed(seed)
    check_fits(len(prompt_ids), max_new_tokens, session.context_window)
    rng = np.random.default_rng(seed)
    session.reset()
    t0 = time.perf_counter()
    token = sample(session.prefill(prompt_ids), temperature, top_p, rng)
    t_first = time.perf_counter()
    generated = [token]
    if on_token:
        on_token(token)
    while len(generated) < max_new_tokens and token not in stop_ids:
        token = sample(session.decode(token), temperature, top_p, rng)
        generated.append(token)
        if on_token:
            on_token(token)
    t_end = time.perf_counter()
    decode_steps = len(generated) - 1
    return GenerationResult(
        text=decode_text(generated),
        token_ids=generated,
        prompt_tokens=len(prompt_ids),
        ttft_ms=(t_first - t0) * 1e3,
        prefill_tok_s=len(prompt_ids) / (t_first - t0),
        decode_tok_s=decode_steps / (t_end - t_first) if decode_steps else None,
        peak_rss_mb=peak_rss_mb(),
    )


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """`mobilec generate`'s options."""

    artifact: str  # the directory `mobilec compile` wrote
    prompt: str
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False  # wrap the prompt in the tokenizer's chat template
    ignore_eos: bool = False
    threads: int | None = None

    def check(self) -> None:
        validate.threads(self.threads)
        validate.text(self.prompt, "--prompt")
        validate.tokens(self.max_new_tokens, "--max-new-tokens")
        validate.temperature(self.temperature)
        validate.probability(self.top_p, "--top-p")
        validate.seed(self.seed)


def prompt_token_ids(tokenizer, prompt: str, chat: bool, config: dict) -> list[int]:
    """The prompt's ids; with `chat`, the prompt rendered from the artifact config's chat prompt entry
    (chat_prompt.py) and tokenized as transformers tokenizes a rendered chat (no special tokens added)."""
    if not chat:
        return tokenizer.encode(prompt)
    return tokenizer.encode(chat_prompt.render(config, prompt), add_special_tokens=False)


def generate_text(options: GenerateOptions,
                  on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """`mobilec generate`: the artifact's text for the prompt; `on_text` gets each new piece as it comes (a
    multi-byte character once whole). Every option is checked before the artifact loads, the prompt's length
    before the library does; first, that this CPU can run the artifact."""
    options.check()
    artifact = load_artifact(options.artifact)
    check_cpu(artifact.path, artifact.config, this_cpu())  # code this CPU cannot run: the first thing to say
    tokenizer = load_tokenizer(artifact.tokenizer_dir)
    prompt_ids = prompt_token_ids(tokenizer, options.prompt, options.chat, artifact.config)
    check_fits(len(prompt_ids), options.max_new_tokens, int(artifact.config["context_window"]))
    set_threads(options.threads)
    session = Session(artifact)
    stop_ids = frozenset() if options.ignore_eos else frozenset(i for i in [tokenizer.eos_token_id] if i is not None)
    printed = ""
    generated: list[int] = []

    def stream(token: int) -> None:
        nonlocal printed
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            on_text(text[len(printed):])
            printed = text

    return generate(session, prompt_ids, options.max_new_tokens, temperature=options.temperature,
                    top_p=options.top_p, seed=options.seed, stop_ids=stop_ids, on_token=stream if on_text else None,
                    decode_text=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
