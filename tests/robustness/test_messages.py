"""Messages that say what is really wrong: a prompt's real length (not a prefill chunk's), a prompt plus output
that cannot fit refused before generating (with the largest --max-new-tokens that fits), a tensor named by the
checkpoint's own name, invalid UTF-8 in a prompt as one line. The fitting cases still generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.numpy import load_file, save_file

from compiler.artifacts.artifact import load_artifact
from compiler.errors import MobilecError
from compiler.loaders.tokenizer import load_tokenizer
from compiler.runtime.generate import check_fits
from compiler.runtime.session import Session
from tests.helpers.assertions import strict_json
from tests.robustness.conftest import CONTEXT, one_line_error, run_cli


def _prompt_of(artifact, n_tokens: int) -> str:
    """A prompt that the artifact's tokenizer makes exactly n_tokens of."""
    tokenizer = load_tokenizer(load_artifact(artifact).tokenizer_dir)
    text = "a"
    while len(tokenizer.encode(text)) < n_tokens:
        text += " a"
    assert len(tokenizer.encode(text)) == n_tokens
    return text


def test_long_prompt_is_reported_with_its_real_length(tiny_artifact):
    result = run_cli(["generate", tiny_artifact, "--prompt", _prompt_of(tiny_artifact, 3 * CONTEXT + 5)])
    one_line_error(result, f"the prompt has {3 * CONTEXT + 5} tokens", f"context window of {CONTEXT}")
    assert result.stdout == ""
    # the session itself, fed in prefill chunks, counts the whole input too
    session = Session(load_artifact(tiny_artifact))
    with pytest.raises(MobilecError, match=f"^{5 * CONTEXT} tokens exceed the artifact's context window of {CONTEXT}"):
        session.prefill(list(range(5 * CONTEXT)))


def test_prompt_plus_output_that_cannot_fit_is_refused_before_generating(tiny_artifact):
    prompt = _prompt_of(tiny_artifact, 30)
    result = run_cli(["generate", tiny_artifact, "--prompt", prompt, "--max-new-tokens", "60"])
    fits = CONTEXT - 30 + 1
    one_line_error(result, "30 tokens + --max-new-tokens 60", f"context window of {CONTEXT}",
                   f"--max-new-tokens {fits} or less")
    assert result.stdout == ""  # nothing streamed: not stopped mid-stream
    # negative control: the largest output that fits is generated in full, with its statistics
    ok = run_cli(["generate", tiny_artifact, "--prompt", prompt, "--max-new-tokens", str(fits), "--ignore-eos",
                  "--json"])
    assert ok.exit_code == 0, ok.output
    assert len(json.loads(ok.stdout)["token_ids"]) == fits


def test_check_fits_is_exact():
    check_fits(10, 55, 64)  # the 55th token is generated but never fed back
    with pytest.raises(MobilecError, match="--max-new-tokens 55 or less"):
        check_fits(10, 56, 64)
    with pytest.raises(MobilecError, match="the prompt is empty"):
        check_fits(0, 1, 64)


def test_invalid_utf8_prompt_is_one_line(tiny_artifact):
    """As a shell passes it: raw bytes in argv (Python sees surrogate escapes)."""
    argv = [os.fsencode(sys.executable), b"-m", b"compiler", b"generate", os.fsencode(tiny_artifact), b"--prompt",
            b"caf\xe9 \xff bytes", b"--max-new-tokens", b"2"]
    result = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mobilec: error: --prompt is not valid UTF-8"), stderr
    assert "0xe9" in lines[0]


def _with_bad_tensor(checkpoint, tmp_path, name, transform):
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in checkpoint.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    transform(tensors, name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                  "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"])
def test_wrong_shape_is_named_by_the_checkpoints_tensor_name(tiny_checkpoint, tmp_path, name):
    def cut(tensors, key):
        tensors[key] = tensors[key][..., :-2].copy()

    ckpt = _with_bad_tensor(tiny_checkpoint, tmp_path, name, cut)
    line = one_line_error(run_cli(["compile", "--model", ckpt, "--quant", "q4f16_g32", "-o", tmp_path / "out"]),
                          f"tensor {name} has shape", "its config implies")
    assert "qkv_proj" not in line and "gate_up_proj" not in line and "q_weight" not in line
    assert not (tmp_path / "out").exists()


def test_missing_tensor_is_named_before_building(tiny_checkpoint, tmp_path):
    ckpt = _with_bad_tensor(tiny_checkpoint, tmp_path, "model.layers.1.self_attn.v_proj.weight",
                            lambda tensors, key: tensors.pop(key))
    one_line_error(run_cli(["compile", "--model", ckpt, "-o", tmp_path / "out"]),
                   "'model.layers.1.self_attn.v_proj.weight' is not in")


def test_generate_json_of_one_token_is_strict_json_with_null_decode_rate(tiny_artifact):
    """One generated token (as when the first is the end of text) has no decode step to time: its rate is null in
    --json (it was NaN, which strict parsers reject) and "n/a" in the text, the other figures are numbers."""
    result = run_cli(["generate", tiny_artifact, "--prompt", "the cat", "--max-new-tokens", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = strict_json(result.stdout)
    assert len(out["token_ids"]) == 1 and out["decode_tok_s"] is None
    assert all(out[key] > 0 for key in ("ttft_ms", "prefill_tok_s", "peak_rss_mb"))
    text = run_cli(["generate", tiny_artifact, "--prompt", "the cat", "--max-new-tokens", "1"])
    assert text.exit_code == 0 and "decode n/a (one token)" in text.stdout, text.output
