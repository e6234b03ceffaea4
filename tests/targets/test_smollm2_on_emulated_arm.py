"""SmolLM2 cross-compiled for linux-arm64 and benched through the RPC tracker on the emulated arm64 device: its
greedy tokens must equal the host build's. Timings under qemu mean nothing; the aarch64 code path's numerics do."""

import json
import subprocess
import sys

import pytest

from compiler.artifact import load_artifact
from compiler.compile_model import compile_model
from compiler.runtime.bench import prompt_ids
from compiler.runtime.session import Session

PROMPT_LEN, GEN_LEN = 8, 6  # qemu runs SmolLM2 at a few tokens per second


@pytest.mark.slow
def test_arm64_build_on_emulated_device_generates_the_host_tokens(tmp_path, smollm2_gguf, smollm2_gguf_exact,
                                                                   emulated_arm_device):
    arm = tmp_path / "smollm2-arm64"
    compile_model(str(smollm2_gguf), "linux-arm64", "gguf", str(arm), context_window=512, progress=False)
    report = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "compiler", "bench", str(arm),
           "--tracker", f"{emulated_arm_device.tracker_host}:{emulated_arm_device.tracker_port}",
           "--key", emulated_arm_device.key, "--prompt-len", str(PROMPT_LEN), "--gen-len", str(GEN_LEN),
           "--repeat", "1", "--session-timeout", "600", "--json", str(report)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["target"] == "linux-arm64" and result["device"]["key"] == emulated_arm_device.key
    assert result["upload"]["uploaded"] > 0 and result["decode_tok_s"] > 0

    vocab = int(load_artifact(arm).config["model"]["config"]["vocab_size"])
    host = Session(load_artifact(smollm2_gguf_exact))

    def greedy(ids):
        host.reset()
        tokens = [int(host.prefill(ids).argmax())]
        while len(tokens) < GEN_LEN:
            tokens.append(int(host.decode(tokens[-1]).argmax()))
        return tokens

    expected = greedy(prompt_ids(vocab, PROMPT_LEN, result["prompt_seed"]))
    assert result["tokens"] == expected
    # Negative control: another prompt gives other tokens, so the equality above is not vacuous.
    assert greedy(prompt_ids(vocab, PROMPT_LEN, result["prompt_seed"] + 1)) != expected
