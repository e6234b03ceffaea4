"""The serving engine: several sequences of one loaded artifact in one paged KV cache, stepped together.

Each step feeds one prompt chunk of a newly admitted sequence (so streams keep flowing while a long prompt is read)
and then decodes every sequence that is generating in ONE model call over their last tokens, one per sequence
(begin_forward with lengths [1] * B), so the weights are read once for all of them: `batch_decode`, whose integer-dot
GEMVs take a row per sequence, or `prefill_logits` where the decode GEMVs are float ones (Engine._decode says which).
Finished sequences stay in the cache as prefixes; a request whose tokens start with one forks it and prefills only
the rest. Not thread-safe except submit() and cancel(); one thread calls step() (run() loops it)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil

from ..errors import MobilecError
from ..kernels import integer_dot_gemv
from ..model_import import kv_cache_dtype
from ..runtime.generate import log_probabilities, sample
from ..runtime.session import LoadedArtifact, device_tensor
from .metrics import Metrics

MAX_SESSIONS = 8  # sequences decoded together at most: beyond ~4, decode is bandwidth-bound and memory grows


def kv_cache_bytes(model: LoadedArtifact, tokens: int) -> int:
    """What the paged KV cache for `tokens` allocates when it is created: every layer's pages (one more than the
    tokens need, as the runtime allocates them) at the artifact's KV dtype."""
    cfg = model.artifact.config["model"]["config"]
    dtype = kv_cache_dtype.of_artifact(model.artifact.config)
    return cfg["num_hidden_layers"] * kv_cache_dtype.layer_bytes(dtype, cfg["num_key_value_heads"], cfg["head_dim"],
                                                                 tokens, model.page_size)


def check_memory(model: LoadedArtifact, max_sessions: int) -> None:
    """Refuse a session count whose KV cache (allocated whole, up front) does not fit the memory available now."""
    need = kv_cache_bytes(model, max_sessions * model.context_window)
    available = psutil.virtual_memory().available
    if need > available:
        fits = max(n for n in range(0, MAX_SESSIONS + 1)
                   if n == 0 or kv_cache_bytes(model, n * model.context_window) <= available)
        fix = (f"pass --max-sessions {fits} or less" if fits
               else "free memory or recompile with a smaller --context-window")
        raise MobilecError(f"--max-sessions {max_sessions} needs {need / 2**30:.2f} GiB of KV cache ({max_sessions} x "
                           f"the context window of {model.context_window} tokens), but {available / 2**30:.2f} GiB "
                           f"of memory is available; {fix}")


class QueueFull(MobilecError):
    """More requests wait than the engine's queue holds; the client should retry later."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # text that ends the output (not included in it)
    stop_ids: frozenset[int] = frozenset()  # token ids that end the output (the tokenizer's end of sequence)
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: the most likely tokens at each position, this many (OpenAI allows 20)
    # makes the sequence's token mask (structured.TokenMask: the tokens a grammar allows next); None: every token
    mask: Callable[[], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Token:
    """A generated token and the text it completes (empty while a multi-byte character or a possible stop string
    is incomplete); with logprobs, the model's log-probability of it and of the most likely tokens (each token's own
    text, most likely first)."""
    token_id: int
    text: str
    logprob: float | None
    top_logprobs: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of sequence or a stop string), "length" (max_tokens), "cancelled"
    prompt_tokens: int
    completion_tokens: int
    prefilled_tokens: int  # prompt tokens run through the model (the rest came from a cached prefix)


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str


Event = Token | Finished | Failed


class Request:
    """One generation asked of the engine; `emit` receives its events (from the engine's thread), the last one a
    Finished or a Failed."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Event], None]):
        self.id = next(self._ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.emit = emit
        self.cancelled = False
        self.submitted_at = time.perf_counter()


class _StopText:
    """The text of the generated tokens so far, released as far as it cannot be the start of a stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
        self.released = 0  # characters of the text already emitted
        self.stopped = False

    def advance(self, generated: list[int], final: bool = False) -> str:
        text = self.decode(generated)
        if text.endswith("\ufffd") and not final:  # wait for the rest of a multi-byte character
            return ""
        search_from = max(0, self.released - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(text)
        else:  # hold back a tail that a later token could complete into a stop string
            held = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            end = len(text) - held
        piece = text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return piece


class _Sequence:
    """A request's sequence in the KV cache."""

    def __init__(self, request: Request, seq_id: int, reused: list[int], decode_text: Callable[[list[int]], str]):
        self.request = request
        self.seq_id = seq_id
        self.kv_tokens = list(reused)  # the tokens whose keys and values are in the cache
        self.reused = len(reused)  # prompt tokens taken from a cached prefix
        self.pending = request.prompt_ids[len(reused):]  # prompt tokens still to prefill
        self.generated: list[int] = []
        self.rng = np.random.default_rng(request.params.seed)
        self.text = _StopText(decode_text, request.params.stop)
        self.mask = request.params.mask() if request.params.mask else None
        self.last_token_at = 0.0

    def finished(self, reason: str) -> Finished:
        prompt = len(self.request.prompt_ids)
        return Finished(reason, prompt, len(self.generated), prompt - self.reused)

    @property
    def final_length(self) -> int:
        """Tokens in the cache when the sequence ends at max_tokens (the last token is never fed back)."""
        return len(self.request.prompt_ids) + self.request.params.max_tokens - 1


class Engine:
    """Up to `max_sessions` sequences generating together over one loaded artifact."""

    def __init__(self, model: LoadedArtifact, decode_text: Callable[[list[int]], str], max_sessions: int = 4,
                 max_queue: int = 16, metrics: Metrics | None = None):
        if not 1 <= max_sessions <= MAX_SESSIONS:
            raise MobilecError(f"--max-sessions must be 1 to {MAX_SESSIONS}, got {max_sessions}")
        self.model = model
        self.decode_text = decode_text
        self.max_sessions = max_sessions
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.context_window = model.context_window
        kernels = model.artifact.config.get("call_sites", {}).get("kernels", [])
        integer_gemvs = any(name.startswith(integer_dot_gemv.KERNEL_PREFIX) for name in kernels)
        self.batch_function = model.batch_decode_function or (None if integer_gemvs else model.prefill_logits_function)
        self.page_size = model.page_size
        # room for every session to fill the context window; cached prefixes live in what they leave free
        check_memory(model, max_sessions)
        self.kv_cache = model.create_kv_cache(max_sessions, max_sessions * model.context_window)
        dev = model.device
        self._add = dev.function("vm.builtin.kv_state_add_sequence")
        self._remove = dev.function("vm.builtin.kv_state_remove_sequence")
        self._fork = dev.function("vm.builtin.kv_state_fork_sequence")
        self._free_pages = dev.function("vm.builtin.attention_kv_cache_get_num_available_pages")
        self.total_pages = int(self._free_pages(self.kv_cache))
        self.metrics.kv_pages_total.set(self.total_pages)
        self._seq_ids = itertools.count()
        self._waiting: deque[Request] = deque()
        self._lock = threading.Condition()
        self.active: list[_Sequence] = []
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # seq id -> its tokens, least recently used first
        self.prefilled_tokens = 0  # over the engine's life: prompt tokens run through the model

    # --- called from any thread ---

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request whose prompt and output cannot fit one sequence of the context window."""
        if prompt_tokens < 1:
            raise MobilecError("the prompt is empty; send at least one token of text")
        if max_tokens < 1:
            raise MobilecError(f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_tokens + max_tokens - 1 > self.context_window:
            room = self.context_window - prompt_tokens + 1
            fix = f"ask for max_tokens {room} or less" if room > 0 else "shorten the prompt"
            raise MobilecError(f"the prompt's {prompt_tokens} tokens + max_tokens {max_tokens} exceed the model's "
                               f"context window of {self.context_window} tokens; {fix}")

    def submit(self, request: Request) -> None:
        self.check_fits(len(request.prompt_ids), request.params.max_tokens)
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (the queue holds "
                                f"{self.max_queue}); retry later")
            self._waiting.append(request)
            self.metrics.requests.inc()
            self._lock.notify()

    def cancel(self, request: Request) -> None:
        """Stop the request; its sequence is freed at the engine's next step."""
        with self._lock:
            request.cancelled = True
            self._lock.notify()

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    def run(self, stopping: threading.Event) -> None:
        """Step until `stopping` is set, sleeping while there is nothing to do."""
        while not stopping.is_set():
            if not self.step():
                with self._lock:
                    if not self._waiting and not self.active and not stopping.is_set():
                        self._lock.wait(0.05)

    def wake(self) -> None:
        with self._lock:
            self._lock.notify()

    def fail_all(self, why: str) -> None:
        """End every waiting and active request, each told `why` and how far it got (the server is stopping)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for request in waiting:
            request.emit(Failed(f"{why} before the request started; send it again"))
        for seq in list(self.active):
            self._end(seq, None)
            seq.request.emit(Failed(f"{why} and cancelled the request after {len(seq.generated)} of its "
                                    f"{seq.request.params.max_tokens} tokens"))

    # --- the engine's thread ---

    def step(self) -> bool:
        """Admit waiting requests, prefill one chunk, decode every generating sequence once. False when idle."""
        for seq in [s for s in self.active if s.request.cancelled]:
            self._end(seq, seq.finished("cancelled"), keep=False)
            self.metrics.cancelled.inc()
        self._admit()
        prefilling = next((s for s in self.active if s.pending), None)
        if prefilling is not None:
            self._guarded([prefilling], self._prefill_chunk)
        decoding = [s for s in self.active if not s.pending and s.generated]
        if decoding:
            self._guarded(decoding, self._decode)
        self.metrics.sequences_active.set(len(self.active))
        self.metrics.sequences_cached.set(len(self.cached))
        self.metrics.kv_pages_used.set(self.total_pages - int(self._free_pages(self.kv_cache)))
        self.metrics.queue_length.set(self.queue_length)
        return prefilling is not None or bool(decoding)

    def _guarded(self, seqs: list[_Sequence], run: Callable[[list[_Sequence]], None]) -> None:
        """A model call that fails ends the requests in it, never the engine."""
        try:
            run(seqs)
        except Exception as err:  # noqa: BLE001 (TVM raises its own error types)
            for seq in seqs:
                if seq in self.active:
                    self._end(seq, None, keep=False)
                    seq.request.emit(Failed(f"the model failed: {' '.join(str(err).split())[:300]}"))

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _reserved_pages(self) -> int:
        """Pages the active sequences may still claim before they end."""
        return sum(self._pages(s.final_length) - self._pages(len(s.kv_tokens)) for s in self.active)

    def _admit(self) -> None:
        with self._lock:  # a cancelled request leaves the queue at once, even while every session is busy
            gone = [r for r in self._waiting if r.cancelled]
            self._waiting = deque(r for r in self._waiting if not r.cancelled)
        for request in gone:
            request.emit(Finished("cancelled", len(request.prompt_ids), 0, 0))
        while len(self.active) < self.max_sessions:
            with self._lock:
                if not self._waiting:
                    return
                request = self._waiting[0]
            parent, reused = self._longest_cached_prefix(request.prompt_ids)
            need = self._pages(len(request.prompt_ids) + request.params.max_tokens - 1)
            # a fork shares the parent's whole pages (the cache copies only a partly filled last one)
            if not self._make_room(need - reused // self.page_size, keep=parent):
                return  # wait for an active sequence to end
            if parent is not None and parent not in self.cached:  # evicted for room after all: nothing shared
                parent = None
                if not self._make_room(need, keep=None):
                    return
            with self._lock:
                self._waiting.popleft()
            seq_id = next(self._seq_ids)
            if parent is not None and parent in self.cached:
                self._fork(self.kv_cache, parent, seq_id, reused)
                self.cached.move_to_end(parent)
            else:
                reused = 0
                self._add(self.kv_cache, seq_id)
            seq = _Sequence(request, seq_id, request.prompt_ids[:reused], self.decode_text)
            self.metrics.prefix_reused_tokens.inc(reused)
            self.active.append(seq)

    def _longest_cached_prefix(self, prompt: list[int]) -> tuple[int | None, int]:
        """The cached sequence sharing the longest start with `prompt`, and how many tokens to reuse: at most all but
        the prompt's last token, whose logits the first output token is sampled from."""
        best, best_len = None, 0
        for seq_id, tokens in self.cached.items():
            n = 0
            for a, b in zip(tokens, prompt[:-1]):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = seq_id, n
        return best, best_len

    def _make_room(self, need: int, keep: int | None) -> bool:
        """Evict cached prefixes, least recently used first (`keep` last), until `need` pages are free beyond what
        the active sequences have reserved."""
        def free() -> int:
            return int(self._free_pages(self.kv_cache)) - self._reserved_pages()

        for seq_id in [s for s in self.cached if s != keep] + ([keep] if keep in self.cached else []):
            if free() >= need:
                return True
            self._remove(self.kv_cache, seq_id)
            del self.cached[seq_id]
        return free() >= need

    def _forward(self, func, seqs: list[_Sequence], chunks: list[list[int]]):
        ids = np.concatenate([np.asarray(c, "int32") for c in chunks])
        dev = self.model.device
        out = self.model.forward(func, device_tensor(ids, dev.dev), self.kv_cache,
                                 dev.shape(*[s.seq_id for s in seqs]), dev.shape(*[len(c) for c in chunks]))
        for seq, chunk in zip(seqs, chunks):
            seq.kv_tokens.extend(chunk)
        return self.model.first_output(out)

    def _prefill_chunk(self, seqs: list[_Sequence]) -> None:
        (seq,) = seqs
        chunk, seq.pending = seq.pending[:self.model.prefill_chunk], seq.pending[self.model.prefill_chunk:]
        logits = self._forward(self.model.prefill_function, [seq], [chunk]).reshape(-1)
        self.prefilled_tokens += len(chunk)
        self.metrics.prefilled_tokens.inc(len(chunk))
        if not seq.pending:
            now = time.perf_counter()
            self.metrics.ttft_s.observe(now - seq.request.submitted_at)
            self._take(seq, logits, now)

    def _decode(self, seqs: list[_Sequence]) -> None:
        # Several sequences in one call (each token with its own sequence's cache: the weights read once):
        # batch_decode, whose integer-dot GEMVs quantize each row alone (a request's tokens do not depend on its
        # neighbours), or prefill_logits where the decode GEMVs are float ones. An artifact whose integer-dot GEMVs
        # have no batched form decodes each sequence alone: the float prefill kernels at 2-8 rows are far slower
        # (SmolLM2 gguf, Zen 4: 27 tok/s per stream at 2 streams, 102 alone).
        if len(seqs) > 1 and self.batch_function is not None:
            rows = self._forward(self.batch_function, seqs, [[s.generated[-1]] for s in seqs])
            logits = list(rows.reshape(len(seqs), -1))
        else:
            logits = [self._forward(self.model.decode_function, [s], [[s.generated[-1]]]).reshape(-1) for s in seqs]
        now = time.perf_counter()
        for seq, row in zip(seqs, logits):
            self.metrics.token_latency_s.observe(now - seq.last_token_at)
            self._take(seq, row, now)

    def _take(self, seq: _Sequence, logits: np.ndarray, now: float) -> None:
        """Sample the sequence's next token from `logits`, emit it, and end the sequence when it is done."""
        params = seq.request.params
        allowed = logits if seq.mask is None else np.where(seq.mask.allowed(), logits, -np.inf)
        token = sample(allowed, params.temperature, params.top_p, seq.rng, params.top_k)
        if seq.mask is not None:
            seq.mask.accept(token)
        seq.generated.append(token)
        seq.last_token_at = now
        self.metrics.generated_tokens.inc()
        done_by_id = token in params.stop_ids or (seq.mask is not None and seq.mask.done)
        done_by_length = len(seq.generated) >= params.max_tokens
        visible = seq.generated[:-1] if done_by_id else seq.generated
        text = seq.text.advance(visible, final=done_by_id or done_by_length)
        logprob, top = None, ()
        if params.logprobs:
            logprobs = log_probabilities(logits)
            logprob = float(logprobs[token])
            if params.top_logprobs:
                ids = np.argpartition(-logprobs, params.top_logprobs - 1)[:params.top_logprobs]
                top = tuple((self.decode_text([int(i)]), float(logprobs[i]))
                            for i in sorted(ids, key=lambda i: -logprobs[i]))
        seq.request.emit(Token(token, text, logprob, top))
        if done_by_id or seq.text.stopped or done_by_length:
            reason = "length" if done_by_length and not (done_by_id or seq.text.stopped) else "stop"
            self._end(seq, seq.finished(reason))

    def _end(self, seq: _Sequence, finished: Finished | None, keep: bool = True) -> None:
        """Take the sequence out of the batch; keep its tokens as a cached prefix (dropping cached prefixes it
        extends) or free it."""
        self.active.remove(seq)
        if keep:
            for seq_id, tokens in list(self.cached.items()):
                if seq.kv_tokens[:len(tokens)] == tokens:
                    self._remove(self.kv_cache, seq_id)
                    del self.cached[seq_id]
            self.cached[seq.seq_id] = seq.kv_tokens
        else:
            self._remove(self.kv_cache, seq.seq_id)
        if finished is not None:
            seq.request.emit(finished)
