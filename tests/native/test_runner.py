"""The native runtime (native/runtime: mobilec.h's C API, mobilec-run) against `mobilec generate` on SmolLM2 compiled
for this machine: the same greedy tokens and text, the same --json fields, and the same one-line refusals (exit
code 2) for bad artifacts, bad options, prompts past the context window and CPU features this machine lacks.

The runtime is built once per session with the system compiler (compiler/artifacts/native_runtime.py) into a packaged
layout (bin/, lib/, include/), and run from there."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.artifacts.artifact import load_artifact
from compiler.artifacts.native_runtime import build_runtime
from compiler.commands.cli import main
from compiler.loaders.tokenizer import load_tokenizer
from compiler.target.isa import feature_flags
from tests.helpers.assertions import strict_json
from tests.native.conftest import COMPILER, c_client
from tests.test_chat_prompt import TEMPLATES, _config

pytestmark = pytest.mark.skipif(shutil.which(COMPILER) is None,
                                reason=f"no C++ compiler ({COMPILER}) to build the native runtime")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
JSON_FIELDS = {"text", "token_ids", "prompt_tokens", "ttft_ms", "prefill_tok_s", "decode_tok_s", "peak_rss_mb"}


def run_native(runner: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(runner), *map(str, args)], capture_output=True, text=True, timeout=600, check=False)


def run_python(*args: str):
    result = CliRunner().invoke(main, ["generate", *map(str, args)])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def native_json(runner: Path, artifact: Path, *args: str) -> dict:
    done = run_native(runner, artifact, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def python_json(artifact: Path, *args: str) -> dict:
    result = run_python(artifact, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def native_error(done: subprocess.CompletedProcess) -> str:
    """The one error line of a refused run, without its prefix."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("mobilec-run: error: ")
    return lines[0].removeprefix("mobilec-run: error: ")


def python_error(result) -> str:
    assert result.exit_code == 2, result.output
    return result.stderr.strip().removeprefix("mobilec: error: ")


def linked_copy(artifact: Path, dest: Path) -> Path:
    """A copy of the artifact whose library and weight shards are links to the original's (cheap); the rest is
    copied so that a test may edit it."""
    for path in artifact.rglob("*"):
        target = dest / path.relative_to(artifact)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.parent.name in ("lib", "params") and path.suffix in (".so", ".bin"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path.resolve())
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return dest


def edit_config(artifact: Path, edit) -> None:
    config_path = artifact / "mobilec-config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_json_equal_python(runner, smollm2_gguf_exact, prompt):
    native = native_json(runner, smollm2_gguf_exact, "--prompt", prompt, "--max-new-tokens", "32", "--ignore-eos")
    python = python_json(smollm2_gguf_exact, "--prompt", prompt, "--max-new-tokens", "32", "--ignore-eos")
    assert set(native) == set(python) == JSON_FIELDS
    assert native["token_ids"] == python["token_ids"]
    assert len(native["token_ids"]) == 32
    assert native["text"] == python["text"]
    assert native["prompt_tokens"] == python["prompt_tokens"]
    assert all(native[key] > 0 for key in ("ttft_ms", "prefill_tok_s", "decode_tok_s", "peak_rss_mb"))


def test_one_token_has_a_null_decode_rate_as_python(runner, smollm2_gguf_exact):
    """One generated token has no decode step to time: null in --json (it was NaN, not JSON), "n/a" in the text."""
    args = ("--prompt", PROMPTS[0], "--max-new-tokens", "1")
    native = strict_json(run_native(runner, smollm2_gguf_exact, *args, "--json").stdout)
    python = strict_json(run_python(smollm2_gguf_exact, *args, "--json").stdout)
    assert native["decode_tok_s"] is None and python["decode_tok_s"] is None
    assert native["token_ids"] == python["token_ids"] and len(native["token_ids"]) == 1
    assert "decode n/a (one token)" in run_native(runner, smollm2_gguf_exact, *args).stdout


def test_chat_prompt_and_eos_stop_equal_python(runner, smollm2_gguf_exact):
    """--chat renders SmolLM2's ChatML template (with its default system message) as transformers does, and the
    answer stops at <|im_end|> as `mobilec generate` stops it."""
    args = ("--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "48")
    native, python = native_json(runner, smollm2_gguf_exact, *args), python_json(smollm2_gguf_exact, *args)
    assert native["prompt_tokens"] == python["prompt_tokens"]
    assert native["token_ids"] == python["token_ids"]
    assert native["text"] == python["text"]


@pytest.mark.parametrize("template", ["meta-llama-Llama-3.2-3B-Instruct", "google-gemma-2-2b-it"])
def test_other_chat_templates_equal_python(runner, smollm2_gguf_exact, template, tmp_path):
    """Another family's template (Llama 3.2: a dated system message and a stripped message; Gemma 2): the prompt the
    native runtime renders from the artifact's chat_prompt entry is the one `mobilec generate --chat` tokenizes."""
    artifact = linked_copy(smollm2_gguf_exact, tmp_path / "art")
    entry = _config((TEMPLATES / f"{template}.jinja").read_text())["chat_prompt"]
    edit_config(artifact, lambda config: config.update(chat_prompt=entry))
    args = ("--prompt", "  Name three colours.  ", "--chat", "--max-new-tokens", "8")
    native, python = native_json(runner, artifact, *args), python_json(artifact, *args)
    assert native["prompt_tokens"] == python["prompt_tokens"]
    assert native["token_ids"] == python["token_ids"]
    smollm2 = native_json(runner, smollm2_gguf_exact, *args)
    assert native["prompt_tokens"] != smollm2["prompt_tokens"]  # negative control: the entry is what was rendered


def test_unsplittable_chat_template_refused_as_python_refuses(runner, smollm2_gguf_exact, tmp_path):
    artifact = linked_copy(smollm2_gguf_exact, tmp_path / "art")
    edit_config(artifact, lambda config: config.update(chat_prompt={"unsupported": "a reason"}))
    args = (artifact, "--prompt", "hi", "--chat")
    native = native_error(run_native(runner, *args))
    assert native == python_error(run_python(*args))
    assert native.startswith("--chat cannot render this model's prompts: a reason; render the prompt")


def test_verify_sizes_skips_the_sha256_not_the_sizes(runner, smollm2_gguf_exact, tmp_path):
    """--verify sizes (mobilec_open_verified, MOBILEC_VERIFY_SIZES) opens an artifact whose recorded sha256 no longer
    matches, which the default refuses; a wrong size is refused by both."""
    artifact = linked_copy(smollm2_gguf_exact, tmp_path / "art")
    name = "tokenizer/tokenizer.json"
    edit_config(artifact, lambda config: config["files"][name].update(sha256="0" * 64))
    message = native_error(run_native(runner, artifact, "--prompt", "hi"))
    assert message == f"file {artifact / name} fails its sha256 check (corrupted or modified); recompile the artifact"
    done = run_native(runner, artifact, "--prompt", "hi", "--max-new-tokens", "2", "--verify", "sizes", "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 2
    edit_config(artifact, lambda config: config["files"][name].update(bytes=config["files"][name]["bytes"] + 1))
    assert "(truncated or modified)" in native_error(run_native(runner, artifact, "--prompt", "hi", "--verify",
                                                                "sizes"))
    assert native_error(run_native(runner, artifact, "--prompt", "hi", "--verify", "md5")) == (
        "--verify must be sha256 or sizes, got 'md5'")


def test_streamed_text_is_the_json_text(runner, smollm2_gguf_exact):
    args = ("--prompt", PROMPTS[0], "--max-new-tokens", "16")
    streamed = run_native(runner, smollm2_gguf_exact, *args)
    assert streamed.returncode == 0, streamed.stderr
    text, stats = streamed.stdout.rsplit("\n\n[", 1)
    assert text == native_json(runner, smollm2_gguf_exact, *args)["text"]
    assert stats.startswith("5 prompt tokens, 16 generated] TTFT ")


def test_sampling_is_reproducible_by_seed(runner, smollm2_gguf_exact):
    args = ("--prompt", PROMPTS[0], "--max-new-tokens", "24", "--temperature", "1.0", "--top-p", "0.95")
    first = native_json(runner, smollm2_gguf_exact, *args, "--seed", "7")["token_ids"]
    assert native_json(runner, smollm2_gguf_exact, *args, "--seed", "7")["token_ids"] == first
    assert native_json(runner, smollm2_gguf_exact, *args, "--seed", "8", "--threads", "1")["token_ids"] != first


C_PROGRAM = r"""
#include <stdio.h>
#include <string.h>
#include "mobilec.h"

static int count_tokens(void* user_data, int32_t token_id, const char* text, size_t text_len) {
  (void)token_id; (void)text; (void)text_len;
  return ++*(int*)user_data >= 3;  /* stop after the third token */
}

int main(int argc, char** argv) {
  mobilec_model* model = NULL;
  if (mobilec_open("/nonexistent/artifact", &model) != MOBILEC_ERROR_ARTIFACT || model != NULL) return 10;
  if (strstr(mobilec_last_error(), "does not exist") == NULL) return 11;
  if (mobilec_open_verified(argv[1], (mobilec_verify)7, &model) != MOBILEC_ERROR_INVALID_ARGUMENT || model) return 21;
  if (mobilec_open_verified(argv[1], MOBILEC_VERIFY_SIZES, &model) != MOBILEC_OK) return 22;
  mobilec_close(model);
  if (mobilec_open(argv[1], &model) != MOBILEC_OK) { fprintf(stderr, "%s\n", mobilec_last_error()); return 12; }
  const int32_t* ids; size_t count;
  if (mobilec_tokenize(model, "The capital of France is", 1, &ids, &count) != MOBILEC_OK || count != 5) return 13;
  int32_t prompt[5];
  memcpy(prompt, ids, sizeof(prompt));
  mobilec_generation_config config;
  mobilec_generation_config_init(&config);
  config.top_p = 2;
  mobilec_result result;
  if (mobilec_generate(model, prompt, 5, &config, NULL, NULL, &result) != MOBILEC_ERROR_INVALID_ARGUMENT) return 14;
  config.top_p = 1;
  int seen = 0;
  if (mobilec_generate(model, prompt, 5, &config, count_tokens, &seen, &result) != MOBILEC_OK) return 15;
  if (seen != 3 || result.num_tokens != 3) return 16;
  /* the same greedy tokens by hand: prefill, argmax, decode */
  const float* logits;
  int32_t token;
  if (mobilec_reset(model) || mobilec_prefill(model, prompt, 5, &logits) ||
      mobilec_sample(model, logits, 0.0, 1.0, &token) || token != result.token_ids[0]) return 17;
  if (mobilec_decode(model, token, &logits) || mobilec_sample(model, logits, 0.0, 1.0, &token) ||
      token != result.token_ids[1] || mobilec_sequence_length(model) != 6) return 18;
  if (mobilec_decode(model, -1, &logits) != MOBILEC_ERROR_INVALID_ARGUMENT) return 19;
  const char* text;
  if (mobilec_detokenize(model, result.token_ids, result.num_tokens, 1, &text) || strcmp(text, result.text)) return 20;
  printf("%s|%d %d %d\n", text, result.token_ids[0], result.token_ids[1], result.token_ids[2]);
  mobilec_close(model);
  return 0;
}
"""


def test_c_api_from_c(runner, smollm2_gguf_exact, tmp_path):
    """mobilec.h is plain C: a C program opens the artifact, is refused a bad argument with a status (no abort),
    stops generation from its callback, and gets the same greedy tokens by prefill/decode/sample by hand."""
    program = c_client(runner, C_PROGRAM, tmp_path)
    done = subprocess.run([str(program), str(smollm2_gguf_exact)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, (done.returncode, done.stderr)
    python = python_json(smollm2_gguf_exact, "--prompt", PROMPTS[0], "--max-new-tokens", "3")
    assert done.stdout == f"{python['text']}|{' '.join(map(str, python['token_ids']))}\n"


def test_missing_artifact_directory(runner, tmp_path):
    args = (tmp_path / "none", "--prompt", "hi")
    assert native_error(run_native(runner, *args)) == python_error(run_python(*args))


@pytest.mark.parametrize("damage", ["missing library", "corrupt config", "truncated shard"])
def test_damaged_artifact_is_refused_as_python_refuses_it(runner, smollm2_gguf_exact, tmp_path, damage):
    artifact = linked_copy(smollm2_gguf_exact, tmp_path / "art")
    if damage == "missing library":
        (artifact / "lib" / "model.so").unlink()
        needle = "model.so is missing"
    elif damage == "corrupt config":
        (artifact / "mobilec-config.json").write_text('{"format_version": 2, "files": ')
        needle = "is corrupt (not JSON)"
    else:
        shard = artifact / "params" / "shard_000.bin"
        data = shard.read_bytes()
        shard.unlink()
        shard.write_bytes(data[: len(data) // 2])
        needle = "truncated"
    args = (artifact, "--prompt", "hi", "--max-new-tokens", "2")
    native = native_error(run_native(runner, *args))
    assert needle in native
    assert native == python_error(run_python(*args))


def test_versions_other_than_the_runtimes_are_refused(runner, smollm2_gguf_exact, tmp_path):
    artifact = linked_copy(smollm2_gguf_exact, tmp_path / "art")
    edit_config(artifact, lambda config: config["versions"].update({"apache-tvm": "0.0.1"}))
    message = native_error(run_native(runner, artifact, "--prompt", "hi"))
    assert "apache-tvm 0.0.1" in message and "recompile" in message


@pytest.mark.parametrize("args, option", [
    (("--frob",), "--frob"),
    (("--max-new-tokens", "0"), "--max-new-tokens"),
    (("--max-new-tokens", "-4"), "--max-new-tokens"),
    (("--top-p", "2"), "--top-p"),
    (("--temperature", "-1"), "--temperature"),
    (("--max-new-tokens", "many"), "--max-new-tokens"),
])
def test_bad_options(runner, smollm2_gguf_exact, args, option):
    native = native_error(run_native(runner, smollm2_gguf_exact, "--prompt", "hi", *args))
    assert option in native
    if option in ("--max-new-tokens", "--top-p", "--temperature") and args[1] != "many":
        assert native == python_error(run_python(smollm2_gguf_exact, "--prompt", "hi", *args))


def test_prompt_ids_are_fed_as_they_are(runner, smollm2_gguf_exact):
    """--prompt-ids (bench's prompts, other runtimes' token ids) gives what --prompt gives for the same ids."""
    by_text = native_json(runner, smollm2_gguf_exact, "--prompt", PROMPTS[0], "--max-new-tokens", "8")
    prompt = load_tokenizer(load_artifact(smollm2_gguf_exact).tokenizer_dir).encode(PROMPTS[0])
    by_ids = native_json(runner, smollm2_gguf_exact, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                         "8")
    assert by_ids["token_ids"] == by_text["token_ids"] and by_ids["prompt_tokens"] == len(prompt)
    other = native_json(runner, smollm2_gguf_exact, "--prompt-ids", ",".join(map(str, prompt[::-1])),
                        "--max-new-tokens", "8")
    assert other["token_ids"] != by_text["token_ids"]  # negative control


@pytest.mark.parametrize("args, message", [
    (("--prompt-ids", "1,x"), "--prompt-ids must be a whole number, got 'x'"),
    (("--prompt-ids", "1,-2"), "--prompt-ids holds -2, not a token id"),
    (("--prompt-ids", "1,99999999"), "--prompt-ids holds 99999999; the model's vocabulary has ids 0 to 49151"),
    (("--prompt-ids", "1", "--prompt", "hi"), "pass --prompt or --prompt-ids, not both"),
    (("--prompt-ids", "1", "--chat"), "--chat renders a --prompt text; --prompt-ids are fed as they are"),
])
def test_bad_prompt_ids(runner, smollm2_gguf_exact, args, message):
    assert native_error(run_native(runner, smollm2_gguf_exact, *args)) == message


@pytest.mark.parametrize("prompt_words, new_tokens", [(600, 4), (3, 600)])
def test_context_window_refusal_equals_python(runner, smollm2_gguf_exact, prompt_words, new_tokens):
    args = (smollm2_gguf_exact, "--prompt", " ".join(["word"] * prompt_words), "--max-new-tokens", str(new_tokens))
    native = native_error(run_native(runner, *args))
    assert "context window of 512" in native
    assert native == python_error(run_python(*args))


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    key = "flags" if platform.machine() == "x86_64" else "Features"
    line = next(line for line in text.splitlines() if line.startswith(key))
    return set(line.split(":", 1)[1].split())


def test_cpu_features_are_read_as_proc_cpuinfo_lists_them(runner, smollm2_gguf_exact, tmp_path):
    """Every feature compiler/target/isa.py knows: one this machine lacks (by /proc/cpuinfo) is refused by name before
    the library loads (it would be SIGILL); all those it has together run."""
    arch = {"x86_64": "x86_64", "aarch64": "aarch64"}.get(platform.machine())
    if arch is None:
        pytest.skip(f"no CPU features recorded for {platform.machine()}")
    flags = cpu_flags()
    known = feature_flags(arch)
    artifact = linked_copy(smollm2_gguf_exact, tmp_path / "art")
    missing = sorted(name for name, flag in known.items() if flag not in flags)
    for name in missing:
        edit_config(artifact, lambda config, name=name: config["cpu"].update({"required_features": [name]}))
        message = native_error(run_native(runner, artifact, "--prompt", "hi"))
        assert f"built for a CPU with {name} (target host); this CPU lacks it" in message
    present = sorted(name for name, flag in known.items() if flag in flags)
    edit_config(artifact, lambda config: config["cpu"].update({"required_features": present}))
    done = run_native(runner, artifact, "--prompt", "hi", "--max-new-tokens", "1")
    assert done.returncode == 0, done.stderr
    if not missing:
        pytest.skip("this CPU has every feature compiler/target/isa.py knows: no refusal to check")


def test_another_architecture_is_refused(runner, smollm2_gguf_exact, tmp_path):
    artifact = linked_copy(smollm2_gguf_exact, tmp_path / "art")
    other = "aarch64" if platform.machine() == "x86_64" else "x86_64"
    edit_config(artifact, lambda config: config["cpu"].update({"arch": other}))
    message = native_error(run_native(runner, artifact, "--prompt", "hi"))
    assert f"is built for {other} (target host) but this CPU is {platform.machine()}" in message


def test_aarch64_build_reads_the_cpu_features_from_hwcaps(smollm2_gguf_exact, tmp_path):
    """The runtime cross-compiled for aarch64, run under QEMU: a CPU model without dotprod (Cortex-A53) is refused
    naming the features it lacks (read with getauxval), one with them all goes on to load the library."""
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64-static")
    if cross is None or qemu is None or not Path("/usr/aarch64-linux-gnu/lib").is_dir():
        pytest.skip("needs aarch64-linux-gnu-g++, qemu-aarch64-static and the aarch64 libc in /usr/aarch64-linux-gnu")
    from compiler.artifacts.tvm_runtime_libraries import tvm_libraries
    from compiler.errors import MobilecError

    try:
        libraries = tvm_libraries("aarch64")
    except MobilecError as err:
        pytest.skip(f"no aarch64 TVM runtime: {err}")
    arm_runner = build_runtime(tmp_path / "arm", compiler=cross, tvm_libs=libraries).runner
    artifact = linked_copy(smollm2_gguf_exact, tmp_path / "art")
    needed = ["dotprod", "fullfp16", "lse", "neon", "rdm"]
    edit_config(artifact, lambda config: config["cpu"].update({"arch": "aarch64", "required_features": needed}))

    def run_on(cpu: str) -> subprocess.CompletedProcess:
        return subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", "-cpu", cpu, str(arm_runner), str(artifact),
                               "--prompt", "hi"], capture_output=True, text=True, timeout=300, check=False)

    message = native_error(run_on("cortex-a53"))
    assert "built for a CPU with dotprod, fullfp16, lse, rdm (target host); this CPU lacks them" in message
    message = native_error(run_on("max"))  # past the CPU check: the x86_64 library itself is refused
    assert message.startswith(f"cannot load {artifact / 'lib' / 'model.so'}")


def test_no_cpu_count_reads_per_kernel_launch(runner, smollm2_gguf_exact, tmp_path):
    """Without TVM_NUM_THREADS, TVM asks glibc for the CPU count at every parallel kernel launch, which reads
    /sys/devices/system/cpu/online (~185 times per decode step, a fifth of decode time); the runtime pins the
    variable to TVM's own count so that decoding reads it no more."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("needs strace to count the file opens")
    trace = tmp_path / "opens.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    done = subprocess.run([strace, "-f", "-e", "trace=openat", "-o", str(trace), str(runner), str(smollm2_gguf_exact),
                           "--prompt", PROMPTS[0], "--max-new-tokens", "16", "--ignore-eos", "--json"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert trace.read_text().count("/sys/devices/system/cpu/online") < 10


def strace_threads(trace: str) -> tuple[int, dict[int, set[int]]]:
    """From `strace -f -e trace=clone,clone3,sched_setaffinity` output: the threads created and each thread's CPUs
    as last set."""
    created = sum("CLONE_THREAD" in line for line in trace.splitlines() if not line.split()[1].startswith("<..."))
    cpus: dict[int, set[int]] = {}
    for caller, tid, listed in re.findall(r"^(\d+)\s+sched_setaffinity\((\d+), \d+, \[([\d ]*)\]\) = 0", trace, re.M):
        cpus[int(tid) or int(caller)] = {int(cpu) for cpu in listed.split()}
    return created, cpus


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores for a pool of two threads")
@pytest.mark.parametrize("args", [("--threads", "2"), ()], ids=["threads-2", "default"])
def test_thread_pool_has_the_threads_asked_for_on_shared_cores(runner, smollm2_gguf_exact, tmp_path, args):
    """mobilec_open sized TVM's pool before any count was set, to TVM's default (half of an x86 machine's CPUs: one
    thread on a 2-core VM), which mobilec_set_threads cannot grow: `--threads 2` decoded on one thread there (SmolLM2
    gguf: 70-91 tok/s, against 130-153 with the pool of two). Now the pool gets the count asked for, else one thread per
    physical core, and its threads share its cores (TVM pins each worker to one and lets the calling thread roam)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("needs strace (scripts/setup.sh installs it) to see the threads")
    trace = tmp_path / "threads.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "TVM_BIND_THREADS")}
    done = subprocess.run([strace, "-f", "-e", "trace=clone,clone3,sched_setaffinity", "-o", str(trace), str(runner),
                           str(smollm2_gguf_exact), "--prompt", PROMPTS[0], "--max-new-tokens", "4", "--verify",
                           "sizes", *args], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    created, cpus = strace_threads(trace.read_text())
    assert created >= 1  # TVM's worker: the calling thread runs the first share
    assert cpus and all(len(listed) >= 2 for listed in cpus.values()), cpus
