"""The C API's engine (mobilec.h: several sessions in one paged KV cache, stepped together) and `mobilec-run
--parallel`, on a tiny random Llama with a byte-level tokenizer compiled once for this module (prefill chunk 8, so
prompts are read in several chunks between the other sessions' decode steps): a prompt's greedy tokens are the same
alone, as one of 3 parallel sessions, and from Python's `mobilec generate`; the engine batches decode exactly where
the Python engine does (batch_decode where the artifact has it, prefill_logits for float GEMVs, one decode call
each for integer-dot GEMVs without batch_decode); prefix reuse prefills only the new tokens; bad inputs get
the documented status and one-line message."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from compiler.artifacts.artifact import load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.runtime.session import LoadedArtifact
from compiler.serve.engine import Engine
from compiler.target.build_plan import resolve_plan
from tests.helpers.tiny_models import build_model, save_hf
from tests.helpers.tiny_tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer
from tests.native.conftest import c_client
from tests.native.test_runner import native_error, native_json, python_json, run_native

pytestmark = pytest.mark.slow  # a tiny compile (~20 s) and the native runtime's build

CONTEXT_WINDOW = 128
PREFILL_CHUNK = 8
PROMPTS = ["the cat sat on the mat", "a dog ran", "1, 2, 3, 4, 5, 6, 7, 8, 9"]
NEW_TOKENS = ("--max-new-tokens", "12", "--ignore-eos")


def compile_tiny(root: Path, quant: str) -> Path:
    save_hf(build_model("llama_gqa", vocab_size=BYTE_VOCAB_SIZE), root / "hf")
    save_byte_tokenizer(root / "hf")
    compile_model(CompileOptions(str(root / "hf"), "host", quant, str(root / "artifact"),
                                 context_window=CONTEXT_WINDOW, progress=False))
    config_path = root / "artifact" / "mobilec-config.json"
    config = json.loads(config_path.read_text())
    assert config["prefill_chunk"] == CONTEXT_WINDOW  # the whole window by default: smaller chunks show interleaving
    config["prefill_chunk"] = PREFILL_CHUNK
    config_path.write_text(json.dumps(config))
    return root / "artifact"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return compile_tiny(tmp_path_factory.mktemp("engine"), "q0f32")


def python_batch_function(artifact: Path) -> str | None:
    """The function the Python serving engine decodes this artifact's sequences together with (None: one decode call
    each)."""
    model = LoadedArtifact(load_artifact(artifact))
    batch = Engine(model, str, max_sessions=1).batch_function
    functions = {"batch_decode": model.batch_decode_function, "prefill_logits": model.prefill_logits_function}
    return next((name for name, function in functions.items() if batch is not None and batch is function), None)


def test_parallel_sessions_give_each_prompt_its_tokens_alone_and_pythons(runner, artifact):
    alone = [native_json(runner, artifact, "--prompt", p, *NEW_TOKENS)["token_ids"] for p in PROMPTS]
    python = [python_json(artifact, "--prompt", p, *NEW_TOKENS)["token_ids"] for p in PROMPTS]
    assert alone == python
    assert len({tuple(t) for t in alone}) == 3  # negative control: the prompts' tokens differ, rows cannot mix unseen
    args = [a for p in PROMPTS for a in ("--prompt", p)]
    parallel = native_json(runner, artifact, *args, "--parallel", "3", *NEW_TOKENS)
    assert [s["token_ids"] for s in parallel["sessions"]] == alone
    assert [s["prompt_tokens"] for s in parallel["sessions"]] == [len(p) for p in PROMPTS]  # one byte a token
    assert [s["prefilled_tokens"] for s in parallel["sessions"]] == [len(p) for p in PROMPTS]
    assert parallel["decode_tok_s"] > 0 and parallel["peak_rss_mb"] > 0
    # float GEMVs: one prefill_logits call per step
    assert parallel["batched_decode"] is True and python_batch_function(artifact) == "prefill_logits"
    same = native_json(runner, artifact, "--prompt", PROMPTS[0], "--parallel", "3", *NEW_TOKENS)
    assert [s["token_ids"] for s in same["sessions"]] == [alone[0]] * 3


@pytest.fixture(scope="module")
def integer_artifact(tmp_path_factory) -> Path:
    if not resolve_plan("host").integer_decode:
        pytest.skip("this CPU has no integer dot product: the artifact's GEMVs are float ones")
    return compile_tiny(tmp_path_factory.mktemp("engine_int"), "q4f16_g32")


def test_integer_gemv_artifacts_decode_sessions_together_with_batch_decode(runner, integer_artifact):
    """The Python engine's rule: batch_decode's integer-dot GEMVs take a row per session (each quantized alone), so
    3 parallel sessions decode in one call per step and each keeps the tokens it gets alone, which are Python's."""
    assert python_batch_function(integer_artifact) == "batch_decode"
    alone = [native_json(runner, integer_artifact, "--prompt", p, *NEW_TOKENS)["token_ids"] for p in PROMPTS]
    assert alone == [python_json(integer_artifact, "--prompt", p, *NEW_TOKENS)["token_ids"] for p in PROMPTS]
    assert len({tuple(t) for t in alone}) == 3  # negative control: the prompts' tokens differ, rows cannot mix unseen
    args = [a for p in PROMPTS for a in ("--prompt", p)]
    parallel = native_json(runner, integer_artifact, *args, "--parallel", "3", *NEW_TOKENS)
    assert parallel["batched_decode"] is True
    assert [s["token_ids"] for s in parallel["sessions"]] == alone


def test_integer_gemv_artifacts_without_batch_decode_decode_each_session_with_its_own_call(runner, integer_artifact,
                                                                                           tmp_path):
    """An artifact compiled before batch_decode (its config lists no such function): one decode call per session, as
    the Python engine does (its float prefill kernels at 2-8 rows are far slower than the integer GEMVs)."""
    old = tmp_path / "artifact"
    shutil.copytree(integer_artifact, old)
    config = json.loads((old / "mobilec-config.json").read_text())
    del config["call_sites"]["functions"]["batch_decode"]
    (old / "mobilec-config.json").write_text(json.dumps(config))
    assert python_batch_function(old) is None
    args = [a for p in PROMPTS for a in ("--prompt", p)]
    parallel = native_json(runner, old, *args, "--parallel", "3", *NEW_TOKENS)
    assert parallel["batched_decode"] is False
    alone = [native_json(runner, old, "--prompt", p, *NEW_TOKENS)["token_ids"] for p in PROMPTS]
    assert [s["token_ids"] for s in parallel["sessions"]] == alone


def test_parallel_prints_each_sessions_text_and_the_aggregate_rate(runner, artifact):
    done = run_native(runner, artifact, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--parallel", "2",
                      *NEW_TOKENS)
    assert done.returncode == 0, done.stderr
    texts = [native_json(runner, artifact, "--prompt", p, *NEW_TOKENS)["text"] for p in PROMPTS[:2]]
    lines = done.stdout.splitlines()
    assert lines[:2] == [f"[session {i}] {text}" for i, text in enumerate(texts)]
    assert lines[-1].startswith(f"[2 sessions, {len(PROMPTS[0]) + len(PROMPTS[1])} prompt tokens, 24 generated] "
                                "aggregate decode ")
    assert "tok/s (one model call per step) | peak RSS" in lines[-1]


@pytest.mark.parametrize("args, message", [
    (("--parallel", "0"), "--parallel must be 1 to 8, got 0"),
    (("--parallel", "9"), "--parallel must be 1 to 8, got 9"),
    (("--prompt", "b"), "--prompt is given 2 times; pass --parallel 2 to run them together, or one --prompt"),
    (("--prompt", "b", "--parallel", "3"),
     "--parallel 3 runs 3 prompts, got 2 --prompt values; pass one (run 3 times) or 3"),
])
def test_bad_parallel_options(runner, artifact, args, message):
    assert native_error(run_native(runner, artifact, "--prompt", "a", *args)) == message


C_PROGRAM = r"""
#include <stdio.h>
#include <string.h>
#include "mobilec.h"

#define CHECK(condition, code) \
  do { if (!(condition)) { fprintf(stderr, "check %d: %s\n", code, mobilec_last_error()); return code; } } while (0)

static int run(mobilec_engine* engine, mobilec_session_callback callback, void* user_data) {
  int32_t busy = 1;
  while (busy) {
    if (mobilec_engine_step(engine, callback, user_data, &busy) != MOBILEC_OK) return 0;
  }
  return 1;
}

static void print_ids(const char* name, const mobilec_session_result* result) {
  printf("%s", name);
  for (size_t i = 0; i < result->num_tokens; ++i) printf(" %d", result->token_ids[i]);
  printf("\n");
}

static int stop_at_third(void* user_data, int32_t session, int32_t token_id, const char* text, size_t text_len) {
  (void)token_id; (void)text; (void)text_len;
  return ++((int*)user_data)[session] >= 3;
}

int main(int argc, char** argv) {
  (void)argc;
  mobilec_model* model;
  CHECK(mobilec_open(argv[1], &model) == MOBILEC_OK, 1);
  mobilec_engine* engine = (mobilec_engine*)&model;
  CHECK(mobilec_engine_create(model, 0, &engine) == MOBILEC_ERROR_INVALID_ARGUMENT && engine == NULL, 2);
  printf("error %s\n", mobilec_last_error());
  CHECK(mobilec_engine_create(model, 9, &engine) == MOBILEC_ERROR_INVALID_ARGUMENT, 3);
  printf("error %s\n", mobilec_last_error());
  CHECK(mobilec_engine_create(model, 3, &engine) == MOBILEC_OK, 4);

  const int32_t* ids;
  size_t n;
  int32_t prompt[64], other[64], longer[64], too_long[200];
  CHECK(mobilec_tokenize(model, "a dog ran", 1, &ids, &n) == MOBILEC_OK, 5);
  const size_t other_count = n;
  memcpy(other, ids, n * sizeof(int32_t));
  CHECK(mobilec_tokenize(model, "the cat sat on the mat", 1, &ids, &n) == MOBILEC_OK && n == 22, 6);
  memcpy(prompt, ids, n * sizeof(int32_t));
  mobilec_generation_config config;
  mobilec_generation_config_init(&config);
  config.max_new_tokens = 6;
  config.ignore_eos = 1;
  mobilec_session_result a_result, b_result, result;

  /* Prefix reuse: session b's prompt is a's cached sequence (its prompt and the 5 tokens fed back) and 4 more. */
  int32_t a, b, c;
  CHECK(mobilec_session_open(engine, &a) == MOBILEC_OK && mobilec_session_open(engine, &b) == MOBILEC_OK, 10);
  CHECK(mobilec_session_feed(engine, a, prompt, n, &config) == MOBILEC_OK && run(engine, NULL, NULL), 11);
  CHECK(mobilec_session_get_result(engine, a, &a_result) == MOBILEC_OK, 12);
  printf("first %d %d %d %d\n", a_result.state, (int)a_result.num_tokens, a_result.reused_tokens,
         a_result.prefilled_tokens);
  memcpy(longer, prompt, n * sizeof(int32_t));
  memcpy(longer + n, a_result.token_ids, 5 * sizeof(int32_t));
  memcpy(longer + n + 5, prompt, 4 * sizeof(int32_t));
  const size_t longer_count = n + 5 + 4;
  CHECK(mobilec_session_feed(engine, b, longer, longer_count, &config) == MOBILEC_OK && run(engine, NULL, NULL), 13);
  CHECK(mobilec_session_get_result(engine, b, &b_result) == MOBILEC_OK, 14);
  printf("reuse %d %d %d\n", b_result.prompt_tokens, b_result.reused_tokens, b_result.prefilled_tokens);
  print_ids("reused_ids", &b_result);
  /* The same prompt in an engine with nothing cached: all of it prefilled, the same tokens. */
  mobilec_engine* fresh;
  int32_t f;
  CHECK(mobilec_engine_create(model, 1, &fresh) == MOBILEC_OK && mobilec_session_open(fresh, &f) == MOBILEC_OK, 15);
  CHECK(mobilec_session_feed(fresh, f, longer, longer_count, &config) == MOBILEC_OK && run(fresh, NULL, NULL), 16);
  CHECK(mobilec_session_get_result(fresh, f, &result) == MOBILEC_OK, 17);
  printf("fresh %d %d\n", result.reused_tokens, result.prefilled_tokens);
  print_ids("fresh_ids", &result);
  mobilec_engine_destroy(fresh);
  /* Negative control: a prompt that starts otherwise reuses nothing. */
  CHECK(mobilec_session_open(engine, &c) == MOBILEC_OK, 18);
  CHECK(mobilec_session_feed(engine, c, other, other_count, &config) == MOBILEC_OK && run(engine, NULL, NULL), 19);
  CHECK(mobilec_session_get_result(engine, c, &result) == MOBILEC_OK, 20);
  printf("other %d %d %d\n", result.prompt_tokens, result.reused_tokens, result.prefilled_tokens);

  /* Bad inputs: each refused with its status, nothing changed. */
  int32_t d;
  CHECK(mobilec_session_open(engine, &d) == MOBILEC_ERROR_BUSY, 30);
  printf("error %s\n", mobilec_last_error());
  CHECK(mobilec_session_close(engine, c) == MOBILEC_OK, 31);
  CHECK(mobilec_session_feed(engine, c, prompt, n, &config) == MOBILEC_ERROR_INVALID_ARGUMENT, 32);
  printf("error %s\n", mobilec_last_error());
  CHECK(mobilec_session_close(engine, c) == MOBILEC_ERROR_INVALID_ARGUMENT, 33);
  CHECK(mobilec_session_get_result(engine, 7, &result) == MOBILEC_ERROR_INVALID_ARGUMENT, 34);
  for (int i = 0; i < 200; ++i) too_long[i] = prompt[i % n];
  CHECK(mobilec_session_feed(engine, a, too_long, 129, &config) == MOBILEC_ERROR_CONTEXT_FULL, 35);
  printf("error %s\n", mobilec_last_error());
  config.max_new_tokens = 120;
  CHECK(mobilec_session_feed(engine, a, prompt, n, &config) == MOBILEC_ERROR_CONTEXT_FULL, 36);
  printf("error %s\n", mobilec_last_error());
  config.max_new_tokens = 6;
  too_long[0] = 100000;
  CHECK(mobilec_session_feed(engine, a, too_long, 4, &config) == MOBILEC_ERROR_INVALID_ARGUMENT, 37);
  printf("error %s\n", mobilec_last_error());
  CHECK(mobilec_session_get_result(engine, a, &result) == MOBILEC_OK && result.num_tokens == 6 &&
        result.state == MOBILEC_SESSION_FINISHED, 38);  /* the refused feeds left a's result alone */

  /* Cancellation: a generating session stops at once; feeding it while it generates is refused. */
  CHECK(mobilec_session_feed(engine, a, prompt, n, &config) == MOBILEC_OK, 40);
  do {
    CHECK(mobilec_engine_step(engine, NULL, NULL, NULL) == MOBILEC_OK, 41);
    CHECK(mobilec_session_get_result(engine, a, &result) == MOBILEC_OK, 42);
  } while (result.num_tokens < 2);
  CHECK(mobilec_session_feed(engine, a, prompt, n, &config) == MOBILEC_ERROR_INVALID_ARGUMENT, 43);
  printf("error %s\n", mobilec_last_error());
  CHECK(mobilec_session_cancel(engine, a) == MOBILEC_OK, 44);
  CHECK(mobilec_session_get_result(engine, a, &result) == MOBILEC_OK, 45);
  printf("cancelled %d %d\n", result.state, (int)result.num_tokens);
  int32_t busy = 1;
  CHECK(mobilec_engine_step(engine, NULL, NULL, &busy) == MOBILEC_OK && busy == 0, 46);

  /* A callback that asks to stop ends its session after that token (each of two at its third). */
  int seen[3] = {0, 0, 0};
  CHECK(mobilec_session_feed(engine, a, prompt, n, &config) == MOBILEC_OK, 50);
  CHECK(mobilec_session_feed(engine, b, other, other_count, &config) == MOBILEC_OK, 51);
  CHECK(run(engine, stop_at_third, seen), 52);
  CHECK(mobilec_session_get_result(engine, a, &a_result) == MOBILEC_OK, 53);
  CHECK(mobilec_session_get_result(engine, b, &b_result) == MOBILEC_OK, 54);
  printf("stopped %d %d %d %d\n", a_result.state, (int)a_result.num_tokens, b_result.state,
         (int)b_result.num_tokens);

  /* Seeded sampling per session, side by side: seed 7 twice gives mobilec_generate's tokens; seed 8 others. */
  config.temperature = 1.0;
  config.top_p = 0.95;
  config.seed = 7;
  CHECK(mobilec_session_feed(engine, a, other, other_count, &config) == MOBILEC_OK, 60);
  CHECK(mobilec_session_open(engine, &c) == MOBILEC_OK, 61);
  CHECK(mobilec_session_feed(engine, c, other, other_count, &config) == MOBILEC_OK, 62);
  config.seed = 8;
  CHECK(mobilec_session_feed(engine, b, other, other_count, &config) == MOBILEC_OK, 63);
  CHECK(run(engine, NULL, NULL), 64);
  CHECK(mobilec_session_get_result(engine, a, &result) == MOBILEC_OK, 65);
  print_ids("seed7", &result);
  CHECK(mobilec_session_get_result(engine, c, &result) == MOBILEC_OK, 66);
  print_ids("seed7", &result);
  CHECK(mobilec_session_get_result(engine, b, &result) == MOBILEC_OK, 67);
  print_ids("seed8", &result);
  mobilec_result generated;
  config.seed = 7;
  CHECK(mobilec_generate(model, other, other_count, &config, NULL, NULL, &generated) == MOBILEC_OK, 68);
  printf("generate7");
  for (size_t i = 0; i < generated.num_tokens; ++i) printf(" %d", generated.token_ids[i]);
  printf("\n");

  mobilec_engine_destroy(engine);
  mobilec_close(model);
  return 0;
}
"""


def test_c_api_engine(runner, artifact, tmp_path):
    program = c_client(runner, C_PROGRAM, tmp_path)
    done = subprocess.run([str(program), str(artifact)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    lines: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, rest = line.partition(" ")
        lines.setdefault(key, []).append(rest)
    finished, cancelled = "3", "4"
    # prefix reuse: b reuses a's 27 cached tokens and prefills its 4 new ones; a fresh engine prefills all 31 and
    # gives the same tokens; a prompt starting otherwise reuses nothing
    assert lines["first"] == [f"{finished} 6 0 22"]
    assert lines["reuse"] == ["31 27 4"]
    assert lines["fresh"] == ["0 31"]
    assert lines["reused_ids"] == lines["fresh_ids"]
    assert lines["other"] == ["9 0 9"]
    assert lines["error"] == [
        "--max-sessions must be 1 to 8, got 0",
        "--max-sessions must be 1 to 8, got 9",
        "all 3 sessions of the engine are open; close one first, or create the engine with more (at most 8)",
        "session 2 is not open in this engine (it holds sessions 0 to 2); open one with mobilec_session_open",
        "the prompt has 129 tokens, more than the artifact's context window of 128; shorten it or recompile with a "
        "larger --context-window",
        "the prompt's 22 tokens + --max-new-tokens 120 exceed the artifact's context window of 128; pass "
        "--max-new-tokens 107 or less, or recompile with a larger --context-window",
        "token id 100000 is outside the vocabulary (0 to 256)",
        "session 0 is still generating; feed it after it has finished, or cancel it first",
    ]
    assert lines["cancelled"] == [f"{cancelled} 2"]
    assert lines["stopped"] == [f"{finished} 3 {finished} 3"]
    seed7, seed8 = lines["seed7"], lines["seed8"]
    assert seed7[0] == seed7[1] == lines["generate7"][0]
    assert seed8[0] != seed7[0]  # negative control: the seed is what made them equal
