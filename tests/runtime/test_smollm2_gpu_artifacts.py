"""SmolLM2 (the default model) compiled for the phone GPUs with `--host-target host --compute-dtype float32` runs
end to end on PoCL, float16 scales and GGUF mins included (read with vload_half): `mobilec generate` on the
android-adreno gguf artifact gives the host gguf artifact's 32 greedy tokens, and `mobilec eval` of the
android-mali q4f16_g32 artifact gives the host q4f16_g32 artifact's perplexity within 0.1% on a short window."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.artifacts.artifact import CONFIG_FILE
from compiler.commands.cli import main
from compiler.commands.compile_model import CompileOptions, compile_model
from tests.helpers.pocl_device import NEEDS_OPENCL, ON_POCL

pytestmark = [pytest.mark.slow,  # three compiles, 32 tokens decoded on PoCL, short evals: ~3 minutes
              NEEDS_OPENCL]

PROMPT = "The three primary colors are"
EVAL_TOKENS = 32  # one window: prefill on PoCL is slow, and the kernels match the host's to ~1e-6 relative
# CPython's LICENSE, the eval text the docs' figures use; every CPython install has it.
EVAL_TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def _compile(root: Path, smollm2_gguf: Path, target: str, quant: str, **overrides) -> Path:
    out = root / f"{target}-{quant}"
    compile_model(CompileOptions(str(smollm2_gguf), target, quant, str(out), context_window=256, progress=False,
                                 **overrides))
    return out


def _gpu_artifact(root: Path, smollm2_gguf: Path, target: str, quant: str) -> Path:
    out = _compile(root, smollm2_gguf, target, quant, **ON_POCL)
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["target"]["tvm_target"]["kind"] == "opencl" and config["compute_dtype"] == "float32"
    kernels = (out / "lib" / "kernels.cl").read_text()
    assert "vload_half" in kernels and "cl_khr_fp16" not in kernels
    return out


def _mobilec(*args) -> dict:
    result = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_adreno_gguf_artifact_decodes_the_host_gguf_artifacts_32_tokens(tmp_path, smollm2_gguf, smollm2_gguf_exact):
    gpu = _gpu_artifact(tmp_path, smollm2_gguf, "android-adreno", "gguf")
    on_pocl = _mobilec("generate", gpu, "--prompt", PROMPT, "--max-new-tokens", 32)
    on_cpu = _mobilec("generate", smollm2_gguf_exact, "--prompt", PROMPT, "--max-new-tokens", 32)
    assert len(on_pocl["token_ids"]) == 32 and on_pocl["token_ids"] == on_cpu["token_ids"]


@pytest.mark.extended  # ~5 minutes: two SmolLM2 compiles and an eval on PoCL
def test_mali_q4f16_g32_perplexity_is_the_host_artifacts(tmp_path, smollm2_gguf, smollm2_gguf_exact,
                                                          smollm2_reference, monkeypatch):
    # eval's float reference is the session's (loaded once); only the artifacts' perplexities are compared.
    monkeypatch.setattr("compiler.runtime.evaluate.load_reference", lambda _path: smollm2_reference)
    gpu = _gpu_artifact(tmp_path, smollm2_gguf, "android-mali", "q4f16_g32")
    host = _compile(tmp_path, smollm2_gguf, "host", "q4f16_g32")
    window = ("--text", EVAL_TEXT, "--max-tokens", EVAL_TOKENS, "--window", EVAL_TOKENS)
    ppl = {name: _mobilec("eval", path, *window)["ppl"]
           for name, path in (("mali", gpu), ("host", host), ("host gguf", smollm2_gguf_exact))}
    assert abs(ppl["mali"] - ppl["host"]) <= 1e-3 * ppl["host"], ppl
    # Negative control: 0.1% tells schemes apart (the GGUF's own blocks on the same window).
    assert abs(ppl["host gguf"] - ppl["host"]) > 1e-3 * ppl["host"], ppl
