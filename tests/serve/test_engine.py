"""The serving engine on a tiny model: batched decode gives each request the tokens it gets alone, prompts are
prefilled in chunks between decode steps, sampling options, cancellation, room checks, and prefix reuse."""

import threading
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import tvm

from compiler.artifacts.artifact import load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.errors import MobilecError
from compiler.runtime.session import LoadedArtifact, Session
from compiler.serve.engine import Engine, Failed, Finished, QueueFull, Request, SamplingParams, Token, kv_cache_bytes
from compiler.target.build_plan import resolve_plan
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint
from tests.serve.conftest import CONTEXT_WINDOW

pytestmark = pytest.mark.slow  # a tiny compile (~20 s)

PROMPTS = [[2, 3, 4, 5, 6, 7], [9, 10, 2, 3], [4, 4, 4, 8, 2, 5, 6, 7, 3, 2, 9], [11, 2]]
WORDS = ["<unk>", "</s>", "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "."]


def words(ids):
    return "".join(f" {WORDS[i]}" for i in ids)


@pytest.fixture(scope="module")
def model(tiny_artifact):
    return LoadedArtifact(load_artifact(tiny_artifact))


@pytest.fixture(scope="module")
def session(tiny_artifact):
    return Session(load_artifact(tiny_artifact))


def session_greedy(session, prompt, n):
    """Greedy tokens by the one-sequence Session: the reference the engine must reproduce."""
    session.reset()
    token = int(np.argmax(session.prefill(prompt)))
    tokens = [token]
    while len(tokens) < n:
        token = int(np.argmax(session.decode(token)))
        tokens.append(token)
    return tokens


class Collector:
    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    @property
    def tokens(self):
        return [e.token_id for e in self.events if isinstance(e, Token)]

    @property
    def text(self):
        return "".join(e.text for e in self.events if isinstance(e, Token))

    @property
    def end(self):
        return self.events[-1] if self.events and not isinstance(self.events[-1], Token) else None


def run(engine, *requests, limit=2000):
    for request in requests:
        engine.submit(request)
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("the engine did not finish")


def request(prompt, collector, **params):
    return Request(prompt, SamplingParams(**{"max_tokens": 12, **params}), collector)


def test_four_batched_greedy_streams_equal_each_alone(model, session):
    engine = Engine(model, words, max_sessions=4)
    engine.model.prefill_chunk = 4  # the 11-token prompt takes three chunks, between others' decode steps
    calls = []  # (function, sequences, tokens) of every model call
    forward = engine._forward
    engine._forward = lambda func, seqs, chunks: calls.append((func, len(seqs), sum(map(len, chunks)))) or forward(
        func, seqs, chunks)
    try:
        collectors = [Collector() for _ in PROMPTS]
        run(engine, *[request(p, c) for p, c in zip(PROMPTS, collectors)])
    finally:
        engine.model.prefill_chunk = int(model.artifact.config["prefill_chunk"])
    assert max(n for func, n, _ in calls if func is model.prefill_logits_function) == 4  # one model call decoded all four
    chunks_of_long = [i for i, (func, _, tokens) in enumerate(calls) if func is model.prefill_function][3:6]  # the 11 tokens
    assert [calls[i][2] for i in chunks_of_long] == [4, 4, 3]
    between = calls[chunks_of_long[0]:chunks_of_long[-1]]
    assert any(func is model.prefill_logits_function for func, _, _ in between)  # others kept decoding meanwhile
    for prompt, collector in zip(PROMPTS, collectors):
        assert collector.tokens == session_greedy(session, prompt, 12)
        assert collector.end == Finished("length", len(prompt), 12, len(prompt))
        assert collector.text == words(collector.tokens)


def test_negative_control_wrong_sequence_ids_change_the_tokens(model, session):
    """The equality above can fail: decoding each row against another sequence's cache gives other tokens."""
    engine = Engine(model, words, max_sessions=4)
    forward = engine._forward

    def swapped(func, seqs, chunks):
        if func is model.prefill_logits_function and len(seqs) > 1:
            return forward(func, seqs[1:] + seqs[:1], chunks)  # row i's token goes into sequence i + 1's cache
        return forward(func, seqs, chunks)

    engine._forward = swapped
    collectors = [Collector() for _ in PROMPTS]
    run(engine, *[request(p, c) for p, c in zip(PROMPTS, collectors)])
    assert any(c.tokens != session_greedy(session, p, 12) for p, c in zip(PROMPTS, collectors))


def test_sampling_is_seeded_and_top_k_1_is_greedy(model, session):
    engine = Engine(model, words)
    a, b, c, k1 = Collector(), Collector(), Collector(), Collector()
    run(engine, request(PROMPTS[0], a, temperature=1.5, seed=7), request(PROMPTS[0], b, temperature=1.5, seed=7),
        request(PROMPTS[0], c, temperature=1.5, seed=8), request(PROMPTS[0], k1, temperature=1.5, top_k=1))
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert k1.tokens == session_greedy(session, PROMPTS[0], 12)


def test_stop_ids_stop_strings_and_logprobs(model, session):
    greedy = session_greedy(session, PROMPTS[1], 12)
    engine = Engine(model, words)
    by_id, by_text, with_logprobs = Collector(), Collector(), Collector()
    stop_word = WORDS[greedy[3]]
    run(engine, request(PROMPTS[1], by_id, stop_ids=frozenset([greedy[2]])),
        request(PROMPTS[1], by_text, stop=(f" {stop_word}",)), request(PROMPTS[1], with_logprobs, logprobs=True))
    assert by_id.tokens == greedy[:3] and by_id.end.reason == "stop"
    assert by_id.text == words(greedy[:2])  # the stop token's own text is not output
    first = greedy.index(greedy[3])
    assert by_text.text == words(greedy[:first]) and by_text.end.reason == "stop"
    logprobs = [e.logprob for e in with_logprobs.events if isinstance(e, Token)]
    assert all(lp <= 0 for lp in logprobs) and max(logprobs) > -3  # greedy picks likely tokens


def test_cancel_frees_the_sequence_at_the_next_step(model):
    engine = Engine(model, words, max_sessions=2)
    collector = Collector()
    req = request(PROMPTS[0], collector, max_tokens=100)
    engine.submit(req)
    for _ in range(3):
        engine.step()
    pages_before = engine.total_pages - int(engine._free_pages(engine.kv_cache))
    assert len(engine.active) == 1 and pages_before > 0
    engine.cancel(req)
    engine.step()
    assert collector.end.reason == "cancelled" and not engine.active and not engine.cached
    assert int(engine._free_pages(engine.kv_cache)) == engine.total_pages


def test_room_checks_refuse_with_the_limit(model):
    engine = Engine(model, words, max_queue=1)
    with pytest.raises(MobilecError, match=f"context window of {CONTEXT_WINDOW} tokens; ask for max_tokens 119"):
        engine.submit(request(PROMPTS[2][:10], Collector(), max_tokens=CONTEXT_WINDOW))
    with pytest.raises(MobilecError, match="empty"):
        engine.submit(request([], Collector()))
    engine.submit(request(PROMPTS[0], Collector()))
    with pytest.raises(QueueFull, match="queue holds 1"):
        engine.submit(request(PROMPTS[0], Collector()))
    with pytest.raises(MobilecError, match="1 to 8"):
        Engine(model, words, max_sessions=9)


def test_a_failing_model_call_fails_its_requests_not_the_engine(model, session):
    engine = Engine(model, words)
    real = engine._forward
    engine._forward = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    broken = Collector()
    run(engine, request(PROMPTS[0], broken))
    assert isinstance(broken.end, Failed) and "boom" in broken.end.message and not engine.active
    engine._forward = real
    fine = Collector()
    run(engine, request(PROMPTS[0], fine))
    assert fine.tokens == session_greedy(session, PROMPTS[0], 12)


def test_second_chat_turn_prefills_only_new_tokens_and_matches(model, session):
    engine = Engine(model, words)
    turn1 = Collector()
    run(engine, request(PROMPTS[2], turn1))
    history = PROMPTS[2] + turn1.tokens + [2, 3, 4]  # the answer, then the user's next message
    turn2 = Collector()
    before = engine.prefilled_tokens
    run(engine, request(history, turn2))
    # the cache holds the prompt and all generated tokens but the last, which the second turn prefills
    assert engine.prefilled_tokens - before == 1 + 3
    assert turn2.end.prefilled_tokens == 4
    assert turn2.tokens == session_greedy(session, history, 12)
    # without reuse (a fresh engine) the same tokens, all prefilled
    fresh = Engine(model, words)
    alone = Collector()
    run(fresh, request(history, alone))
    assert alone.tokens == turn2.tokens and fresh.prefilled_tokens == len(history)


def test_negative_control_forking_the_wrong_prefix_changes_tokens(model, session):
    """Prefix reuse is what makes turn 2 right: forking a cached sequence whose tokens differ breaks it."""
    engine = Engine(model, words)
    run(engine, request(PROMPTS[2], Collector()))
    (seq_id, tokens), = engine.cached.items()
    engine.cached[seq_id] = [t + 1 if i == 2 else t for i, t in enumerate(tokens)]  # a lie about one token
    history = engine.cached[seq_id] + [2, 3]
    reused = Collector()
    run(engine, request(history, reused))
    assert reused.end.prefilled_tokens == 2
    assert reused.tokens != session_greedy(session, history, 12)


def test_cached_prefixes_are_evicted_least_recently_used(model):
    engine = Engine(model, words, max_sessions=1)  # 128 tokens of cache: 8 pages of 16, plus one
    for i in range(3):
        run(engine, request([2 + i] * 40, Collector(), max_tokens=2))
    # each finished sequence holds 41 tokens (3 pages); the third's admission needed its 3 pages (plus reserve)
    assert len(engine.cached) >= 1
    newest = list(engine.cached.values())[-1]
    assert newest[:40] == [4] * 40
    run(engine, request([9] * 100, Collector(), max_tokens=20))  # needs every page: evicts all cached
    assert list(engine.cached.values())[0][:100] == [9] * 100 and len(engine.cached) == 1


def test_a_prefix_over_half_the_cache_is_forked_not_evicted(model, session):
    """A fork shares the parent's whole pages: a next turn whose history fills most of the cache still reuses it
    (counting the fork's pages in full would evict the history and prefill it all again)."""
    engine = Engine(model, words, max_sessions=1)  # 128 tokens of cache: 8 pages of 16, plus one
    turn1 = Collector()
    prompt = (PROMPTS[0] * 12)[:70]
    run(engine, request(prompt, turn1, max_tokens=4))
    history = prompt + turn1.tokens + [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    turn2 = Collector()
    run(engine, request(history, turn2, max_tokens=4))
    # the cache held the prompt and the answer but its last token (73 tokens: 4 whole pages and 9 tokens)
    assert turn2.end.prefilled_tokens == len(history) - 73
    assert turn2.tokens == session_greedy(session, history, 4)


def test_run_thread_serves_submissions(model, session):
    engine = Engine(model, words)
    stopping = threading.Event()
    thread = threading.Thread(target=engine.run, args=(stopping,))
    thread.start()
    try:
        done = threading.Event()
        collector = Collector()
        engine.submit(request(PROMPTS[3], lambda e: (collector(e), isinstance(e, Finished) and done.set())))
        assert done.wait(30)
    finally:
        stopping.set()
        engine.wake()
        thread.join(10)
    assert collector.tokens == session_greedy(session, PROMPTS[3], 12)


def test_cancelled_waiting_request_leaves_the_queue_while_sessions_are_busy(model):
    engine = Engine(model, words, max_sessions=1, max_queue=1)
    busy, waiting = Collector(), Collector()
    engine.submit(request(PROMPTS[0], busy, max_tokens=50))
    engine.step()
    waiting_request = request(PROMPTS[1], waiting)
    engine.submit(waiting_request)
    engine.step()
    assert engine.queue_length == 1 and len(engine.active) == 1
    engine.cancel(waiting_request)
    engine.step()
    assert engine.queue_length == 0 and waiting.end.reason == "cancelled" and busy.end is None
    engine.submit(request(PROMPTS[2], Collector()))  # the queue has room again


def test_kv_cache_that_does_not_fit_memory_is_refused(model, monkeypatch):
    need_two = kv_cache_bytes(model, 2 * CONTEXT_WINDOW)
    assert need_two > kv_cache_bytes(model, CONTEXT_WINDOW) > 0
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=need_two))
    Engine(model, words, max_sessions=2)  # fits exactly
    with pytest.raises(MobilecError, match="--max-sessions 3 needs .* GiB of KV cache .*; pass --max-sessions 2 or "):
        Engine(model, words, max_sessions=3)


@pytest.fixture(scope="module")
def integer_artifact(tmp_path_factory):
    """The tiny model at q4f16_g32: on a CPU with an integer dot product (x86 AVX2+, ARM dotprod) its decode GEMVs are
    integer-dot kernels."""
    root = tmp_path_factory.mktemp("serve_int")
    save_compilable_checkpoint(build_model("llama_gqa", vocab_size=12), root / "hf")
    compile_model(CompileOptions(str(root / "hf"), "host", "q4f16_g32", str(root / "artifact"),
                                 context_window=CONTEXT_WINDOW, progress=False))
    return root / "artifact"


def test_integer_gemv_artifacts_decode_sequences_together_with_batch_decode(integer_artifact):
    """batch_decode's integer GEMVs take a row per sequence (each quantized alone): 4 requests decode in one call a
    step, and each gets the tokens the decode function gives it alone."""
    if not resolve_plan("host").integer_decode:
        pytest.skip("this CPU has no integer dot product: the artifact's GEMVs are float ones")
    model = LoadedArtifact(load_artifact(integer_artifact))
    engine = Engine(model, words, max_sessions=4)
    assert engine.batch_function is model.batch_decode_function is not None
    calls = []
    forward = engine._forward
    engine._forward = lambda func, seqs, chunks: calls.append((func, len(seqs))) or forward(func, seqs, chunks)
    collectors = [Collector() for _ in PROMPTS]
    run(engine, *[request(p, c) for p, c in zip(PROMPTS, collectors)])
    assert 4 in {n for func, n in calls if func is model.batch_decode_function}
    assert not any(func is model.prefill_logits_function for func, _ in calls)
    session = Session(load_artifact(integer_artifact))
    for prompt, collector in zip(PROMPTS, collectors):
        assert collector.tokens == session_greedy(session, prompt, 12)


def test_batch_decode_rows_are_each_sequences_decode_logits(integer_artifact):
    """Three sequences with different histories: batch_decode's row i is what decode gives sequence i alone (integer
    sums exact; the float kernels around them within 1e-5), and not another sequence's (negative control)."""
    if not resolve_plan("host").integer_decode:
        pytest.skip("this CPU has no integer dot product: the artifact's GEMVs are float ones")
    model = LoadedArtifact(load_artifact(integer_artifact))
    dev = model.device
    add = dev.function("vm.builtin.kv_state_add_sequence")
    histories, last = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 1]], [2, 7, 4]

    def filled_cache():
        cache = model.create_kv_cache(3, 3 * CONTEXT_WINDOW)
        for seq, history in enumerate(histories):
            add(cache, seq)
            model.forward(model.prefill_function, tvm.runtime.tensor(np.array(history, "int32")), cache,
                          dev.shape(seq), dev.shape(len(history)))
        return cache

    batched = model.first_output(model.forward(model.batch_decode_function, tvm.runtime.tensor(np.array(
        last, "int32")), filled_cache(), dev.shape(0, 1, 2), dev.shape(1, 1, 1))).reshape(3, -1)
    cache = filled_cache()
    alone = np.stack([model.first_output(model.forward(model.decode_function, tvm.runtime.tensor(np.array(
        [token], "int32")), cache, dev.shape(seq), dev.shape(1))).reshape(-1) for seq, token in enumerate(last)])
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-5 * np.abs(alone).max())
    assert np.abs(batched[0] - alone[1]).max() > 100 * 1e-5 * np.abs(alone).max()