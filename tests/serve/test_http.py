"""`mobilec serve` as a real process on a free port, driven by the official `openai` client, curl and raw HTTP:
responses equal the engine's greedy tokens, streams are SSE ending in `data: [DONE]`, four clients at once, and
every bad-input and overload case answers an OpenAI error object without harming the server."""

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from compiler.artifacts.artifact import load_artifact
from compiler.runtime.session import Session
from tests.serve.conftest import CONTEXT_WINDOW

pytestmark = pytest.mark.slow  # a tiny compile (~20 s) and three server processes
REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-model"
KEY = "sekret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, artifact, *args):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "compiler", "serve", str(artifact), "--port", str(self.port), "--model-name",
             MODEL, "--json", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TVM_NUM_THREADS": "1"})
        line = self.proc.stdout.readline()  # printed once the socket listens
        assert line, self.proc.stderr.read()
        self.ready = json.loads(line)
        self.url = f"http://127.0.0.1:{self.port}"

    def post(self, path, body, headers=None, raw=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()

    def get(self, path, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read().decode()

    def metric(self, name, headers=None):
        _, text = self.get("/metrics", headers)
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tiny_artifact):
    process = ServerProcess(tiny_artifact, "--max-sessions", "4")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_artifact):
    """(prompt ids -> greedy text of n tokens by the one-sequence Session, stopped at end of sequence), tokenizer."""
    session = Session(load_artifact(tiny_artifact))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_artifact / "tokenizer"))

    def greedy_text(prompt_ids, n):
        session.reset()
        token, tokens = int(np.argmax(session.prefill(prompt_ids))), []
        while True:
            tokens.append(token)
            if token == tokenizer.eos_token_id or len(tokens) == n:
                break
            token = int(np.argmax(session.decode(token)))
        return tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id], skip_special_tokens=True)

    return greedy_text, tokenizer


def chat_ids(tokenizer, messages):
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)


MESSAGES = [{"role": "user", "content": "the cat sat on a mat"}]


def test_chat_whole_and_streamed_equal_the_greedy_reference(server, client, reference):
    greedy_text, tokenizer = reference
    want = greedy_text(chat_ids(tokenizer, MESSAGES), 10)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == want
    assert whole.usage.prompt_tokens == len(chat_ids(tokenizer, MESSAGES))
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_negative_control_other_messages_give_other_text(client, reference):
    greedy_text, tokenizer = reference
    want = greedy_text(chat_ids(tokenizer, MESSAGES), 10)
    other = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "dog ran and ran"}],
                                           max_tokens=10, temperature=0)
    assert other.choices[0].message.content != want


def test_four_concurrent_streaming_clients_each_get_their_greedy_text(server, client, reference):
    greedy_text, _ = reference
    prompts = [[2, 3, 4, 5], [9, 10, 2], [4, 4, 8, 2, 5, 6, 7, 3], [11, 2, 6]]

    def stream(prompt):
        pieces = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in pieces)

    before = server.metric("mobilec_requests_total")
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(stream, prompts))
    assert texts == [greedy_text(p, 24) for p in prompts]
    assert server.metric("mobilec_requests_total") == before + 4


def test_completion_logprobs_and_stop(client, reference):
    greedy_text, _ = reference
    want = greedy_text([2, 3, 4, 5], 24)
    stop = " ".join(want.split()[2:4])
    out = client.completions.create(model=MODEL, prompt=[2, 3, 4, 5], max_tokens=24, temperature=0, stop=[stop],
                                    logprobs=0)
    assert out.choices[0].text == want[:want.index(stop)] and out.choices[0].finish_reason == "stop"
    assert all(lp <= 0 for lp in out.choices[0].logprobs.token_logprobs)


def test_n_choices_each_a_sequence_of_its_own(client, reference):
    greedy_text, _ = reference
    want = greedy_text([2, 3, 4, 5], 12)
    greedy = client.completions.create(model=MODEL, prompt=[2, 3, 4, 5], max_tokens=12, temperature=0, n=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in greedy.choices] == [0, 1, 2] and {c.text for c in greedy.choices} == {want}
    assert greedy.usage.prompt_tokens == 4 and greedy.usage.completion_tokens == 3 * 12
    # sampled with one seed: choice i draws with seed + i, so the choices differ (negative control: n = 1 with
    # seed + 1 gives choice 1's text)
    sampled = client.completions.create(model=MODEL, prompt=[2, 3, 4, 5], max_tokens=12, temperature=1.0, seed=7,
                                        n=3, extra_body={"ignore_eos": True})
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) > 1
    alone = client.completions.create(model=MODEL, prompt=[2, 3, 4, 5], max_tokens=12, temperature=1.0, seed=8,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == texts[1]
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    by_index = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert by_index[0] == by_index[1] and by_index[0]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 2 * chunks[-1].usage.completion_tokens // 2 > 0


def test_top_logprobs_list_the_likeliest_tokens_with_the_chosen_first_when_greedy(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) >= 1
    for token in content:
        top = [t.logprob for t in token.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and sum(math.exp(lp) for lp in top) <= 1 + 1e-6
        # greedy: the chosen token is the likeliest (negative control: the others are less likely)
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob) and top[2] < top[0]
    completion = client.completions.create(model=MODEL, prompt=[2, 3, 4, 5], max_tokens=6, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.top_logprobs) == len(logprobs.tokens) == 6
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(chosen)


@pytest.mark.parametrize("extra,words", [({"top_logprobs": 3}, "top_logprobs needs logprobs: true"),
                                         ({"logprobs": True, "top_logprobs": 21}, "from 0 to 20")])
def test_bad_top_logprobs_answer_an_openai_error(server, extra, words):
    got, _, data = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **extra})
    assert got == 400 and words in json.loads(data)["error"]["message"]


def test_curl_sees_sse_framing(server):
    body = json.dumps({"model": MODEL, "prompt": "the cat", "max_tokens": 5, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    out = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json", "-d", body,
                          server.url + "/v1/completions"], capture_output=True, text=True, timeout=30).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "length"
    assert all(p["object"] == "text_completion" for p in payloads)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    status, text = server.get("/health")
    assert status == 200 and json.loads(text)["status"] == "ok"
    status, text = server.get("/metrics")
    for name in ("mobilec_requests_total", "mobilec_generated_tokens_total", "mobilec_queue_length",
                 "mobilec_kv_pages_used", "mobilec_sequences_active", "mobilec_time_to_first_token_seconds_bucket",
                 "mobilec_time_per_output_token_seconds_count"):
        assert name in text
    assert server.metric("mobilec_time_to_first_token_seconds_count") >= 1


@pytest.mark.parametrize("body,raw,status,words", [
    (None, b'{"model": "tiny-model", "prompt": ', 400, "not valid JSON"),
    (None, b'[1, 2]', 400, "JSON object"),
    ({"model": "gpt-4", "prompt": "the"}, None, 404, "does not exist"),
    ({"model": MODEL, "prompt": "the", "max_tokens": CONTEXT_WINDOW + 5}, None, 400,
     f"context window of {CONTEXT_WINDOW} tokens"),
    ({"model": MODEL, "prompt": "the", "temperature": "hot"}, None, 400, "'temperature' must be a number"),
    ({"model": MODEL, "prompt": "the", "n": 9}, None, 400, "'n' must be an integer from 1 to 8"),
    ({"model": MODEL, "prompt": "the", "logprobs": 6}, None, 400, "'logprobs' must be an integer from 0 to 5"),
    ({"model": MODEL, "prompt": [99999]}, None, 400, "token ids must be"),
    ({"model": MODEL, "prompt": ""}, None, 400, "empty"),
    ({"model": MODEL, "prompt": "the " * 300000}, None, 413, "exceeds"),
])
def test_bad_input_answers_an_openai_error(server, body, raw, status, words):
    got, _, data = server.post("/v1/completions", body, raw=raw)
    error = json.loads(data)["error"]
    assert got == status and words in error["message"] and error["type"]
    assert server.get("/health")[0] == 200  # the server lives on


def test_sdk_sees_the_context_window_error(client):
    with pytest.raises(openai.BadRequestError, match=f"context window of {CONTEXT_WINDOW}"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=CONTEXT_WINDOW * 2)


def test_unknown_route_is_an_openai_404(server):
    status, text = server.get("/v1/engines")
    assert status == 404 and json.loads(text)["error"]["code"] == "not_found"


def test_client_gone_mid_stream_frees_its_sequence(server):
    before = server.metric("mobilec_cancelled_requests_total")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": MODEL, "prompt": [2, 3], "max_tokens": CONTEXT_WINDOW - 2, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 10
    while server.metric("mobilec_cancelled_requests_total") == before and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("mobilec_cancelled_requests_total") == before + 1
    assert server.metric("mobilec_sequences_active") == 0


@pytest.fixture(scope="module")
def guarded(tiny_artifact):
    """One session, a queue of one, an API key."""
    process = ServerProcess(tiny_artifact, "--max-sessions", "1", "--max-queue", "1", "--api-key", KEY)
    yield process
    process.stop()


def test_api_key_is_required(guarded):
    body = {"model": MODEL, "prompt": "the", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, _, data = guarded.post("/v1/completions", body, headers)
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    assert guarded.post("/v1/completions", body, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert guarded.get("/health")[0] == 200  # no key needed


def test_full_queue_answers_429_with_retry_after(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": [2, 3], "max_tokens": CONTEXT_WINDOW - 2, "ignore_eos": True}
    results = []

    def post():
        results.append(guarded.post("/v1/completions", body, auth))

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(60)
    statuses = sorted(r[0] for r in results)
    assert statuses.count(200) >= 2 and 429 in statuses  # one generating, one waiting, the rest refused
    refused = next(r for r in results if r[0] == 429)
    assert refused[1]["retry-after"] == "1" and json.loads(refused[2])["error"]["type"] == "rate_limit_error"


def test_sigterm_lets_the_stream_finish_then_exits(tiny_artifact):
    process = ServerProcess(tiny_artifact, "--shutdown-timeout", "20")
    conn = http.client.HTTPConnection("127.0.0.1", process.port, timeout=30)
    body = {"model": MODEL, "prompt": [2, 3], "max_tokens": 60, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    first = response.readline()
    process.proc.send_signal(signal.SIGTERM)
    rest = response.read().decode()
    assert first.startswith(b"data: ") and rest.rstrip().endswith("data: [DONE]")
    assert '"finish_reason": "length"' in rest
    assert process.proc.wait(30) in (-signal.SIGTERM, 128 + signal.SIGTERM)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", process.port), timeout=2)


def test_second_chat_turn_reuses_the_first_turns_cache(server, client, reference):
    greedy_text, tokenizer = reference
    first = [{"role": "user", "content": "a dog sat on the mat and ran"}]
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6, temperature=0)
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "the cat ran"}]
    reused_before = server.metric("mobilec_prefix_reused_tokens_total")
    prefilled_before = server.metric("mobilec_prefilled_tokens_total")
    reply = client.chat.completions.create(model=MODEL, messages=second, max_tokens=6, temperature=0)
    reused = server.metric("mobilec_prefix_reused_tokens_total") - reused_before
    assert reused >= len(chat_ids(tokenizer, first))  # at least the whole first prompt came from the cache
    assert server.metric("mobilec_prefilled_tokens_total") - prefilled_before == reply.usage.prompt_tokens - reused
    assert reply.choices[0].message.content == greedy_text(chat_ids(tokenizer, second), 6)
