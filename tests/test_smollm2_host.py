"""SmolLM2-135M compiled for the host (q0f32) against transformers' float model from the same GGUF."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from compiler.artifacts.artifact import load_artifact
from compiler.commands.cli import main
from compiler.loaders.tokenizer import load_tokenizer
from compiler.runtime.generate import generate
from compiler.runtime.session import Session
from tests.helpers.reference import reference_greedy

pytestmark = pytest.mark.slow
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def session(smollm2_q0f32):
    return Session(load_artifact(smollm2_q0f32))


@pytest.fixture(scope="module")
def prompt_ids(smollm2_q0f32):
    return load_tokenizer(load_artifact(smollm2_q0f32).tokenizer_dir).encode(PROMPT)


def test_32_greedy_tokens_and_first_logits_match_transformers(session, prompt_ids, smollm2_reference):
    ref_tokens, ref_prefill, _ = reference_greedy(smollm2_reference, prompt_ids, 32)
    session.reset()
    logits = session.prefill(prompt_ids)
    assert np.abs(logits - ref_prefill[-1]).max() < 1e-3
    result = generate(session, prompt_ids, 32)
    assert result.token_ids == ref_tokens


def test_all_position_logits_match(session, prompt_ids, smollm2_reference):
    _, ref_prefill, _ = reference_greedy(smollm2_reference, prompt_ids, 1)
    session.reset()
    logits = session.prefill_all_logits(prompt_ids)
    assert logits.shape == ref_prefill.shape
    assert np.abs(logits - ref_prefill).max() < 1e-3


def test_negative_control_wrong_token_order_changes_logits(session, prompt_ids, smollm2_reference):
    """The comparison can fail: reversed prompt tokens must not match the reference."""
    _, ref_prefill, _ = reference_greedy(smollm2_reference, prompt_ids, 1)
    session.reset()
    logits = session.prefill(prompt_ids[::-1])
    assert np.abs(logits - ref_prefill[-1]).max() > 1e-1


def test_artifact_contents(smollm2_q0f32):
    config = json.loads((smollm2_q0f32 / "mobilec-config.json").read_text())
    assert config["model"]["family"] == "llama"
    assert config["quantization"]["name"] == "q0f32"
    assert config["target"]["name"] == "host" and config["target"]["tvm_target"]["kind"] == "llvm"
    assert set(config["versions"]) == {"mobilec", "apache-tvm", "apache-tvm-ffi"}
    assert (smollm2_q0f32 / "lib" / "model.so").read_bytes()[:4] == b"\x7fELF"
    assert (smollm2_q0f32 / "tokenizer" / "tokenizer.json").is_file()
    index = json.loads((smollm2_q0f32 / "params" / "index.json").read_text())
    # shards hold at most 32 MiB, except that a larger tensor (the fp32 embedding) gets a shard of its own
    for shard in index["shards"]:
        members = [t for t in index["tensors"] if t["shard"] == shard["file"]]
        assert shard["nbytes"] <= 32 * 1024 * 1024 or len(members) == 1
    assert all(t["offset"] % 64 == 0 for t in index["tensors"])
    # 135M float32 parameters with qkv and gate/up concatenated
    assert 500e6 < config["param_bytes"] < 560e6


def test_generate_cli_json(smollm2_q0f32):
    result = CliRunner().invoke(main, ["generate", str(smollm2_q0f32), "--prompt", PROMPT, "--max-new-tokens", "8",
                                       "--json", "--threads", "1"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("text", "token_ids", "ttft_ms", "prefill_tok_s", "decode_tok_s", "peak_rss_mb"):
        assert key in out
    assert len(out["token_ids"]) == 8 and out["decode_tok_s"] > 0


def test_generate_cli_streams_and_reports(smollm2_q0f32):
    result = CliRunner().invoke(main, ["generate", str(smollm2_q0f32), "--prompt", "Hi", "--chat", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.stdout and "decode" in result.stdout and "peak RSS" in result.stdout


def test_gguf_scheme_keeps_the_checkpoint_exactly(smollm2_gguf_exact, prompt_ids, smollm2_reference):
    """--quant gguf keeps the Q4_1/Q8_0 blocks: greedy output equals the float model dequantized from them."""
    art = load_artifact(smollm2_gguf_exact)
    assert art.config["quantization"]["name"] == "gguf"
    assert {t["dtype"] for t in art.index["tensors"]} >= {"uint8", "float16"}  # packed codes and scales
    assert art.config["param_bytes"] < 100e6  # ~96.6 MB, as the GGUF's own blocks
    session = Session(art)
    ref_tokens, ref_prefill, _ = reference_greedy(smollm2_reference, prompt_ids, 32)
    assert generate(session, prompt_ids, 32).token_ids == ref_tokens
    session.reset()
    assert np.abs(session.prefill(prompt_ids) - ref_prefill[-1]).max() < 1e-3
