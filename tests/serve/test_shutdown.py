"""SIGTERM on `mobilec serve` while a stream is generating: the server stops accepting at once (a new connection is
refused, or answered 503), cancels the stream at the --shutdown-timeout deadline, and the stream still ends with its
final chunk and `data: [DONE]`; the server says on stderr what it cancelled, then exits. The tiny model's context
window is long (4096 tokens) so that the stream outlasts the deadline."""

import http.client
import json
import signal
import time

import pytest

from compiler.commands.compile_model import CompileOptions, compile_model
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint
from tests.serve.test_http import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # a tiny compile (~20 s) and a server process

DEADLINE_S = 1.5
MAX_TOKENS = 4000  # seconds of decoding, far past the deadline


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_long")
    save_compilable_checkpoint(build_model("llama_gqa", vocab_size=12), root / "hf")
    compile_model(CompileOptions(str(root / "hf"), "host", "q0f32", str(root / "artifact"), context_window=4096,
                                 progress=False))
    return root / "artifact"


def test_sigterm_stops_accepting_and_ends_the_stream_with_its_final_chunk_by_the_deadline(long_artifact):
    process = ServerProcess(long_artifact, "--shutdown-timeout", str(DEADLINE_S))
    conn = http.client.HTTPConnection("127.0.0.1", process.port, timeout=30)
    body = {"model": MODEL, "prompt": [2, 3], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    signalled = time.monotonic()
    process.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the server checks for the signal every 0.1 s
    try:
        status = process.post("/v1/completions", {"model": MODEL, "prompt": [2], "max_tokens": 1})[0]
    except ConnectionRefusedError:
        status = "refused"
    assert status in ("refused", 503)
    rest = response.read().decode()
    ended_after = time.monotonic() - signalled
    assert DEADLINE_S - 0.2 < ended_after < DEADLINE_S + 1.0, ended_after  # cancelled at the deadline, not before
    assert rest.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line.removeprefix("data: ")) for line in rest.splitlines() if line.startswith("data: {")]
    assert not any("error" in chunk for chunk in chunks)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["cancelled"]
    generated = chunks[-1]["usage"]["completion_tokens"]
    assert 0 < generated < MAX_TOKENS
    assert process.proc.wait(10) in (-signal.SIGTERM, 128 + signal.SIGTERM)
    log = process.proc.stderr.read()
    assert (f"SIGTERM: the {DEADLINE_S} s shutdown deadline passed; cancelled a streamed completion after "
            f"{generated} of its {MAX_TOKENS} tokens") in log, log
