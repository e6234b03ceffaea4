"""Phone GPU artifacts run end to end on this machine: a tiny Llama compiled for android-adreno and android-mali
with `--host-target host --compute-dtype float32` runs its kernels through our OpenCL device on PoCL (fp32 only)
and decodes what the host artifact of the same model decodes; without --host-target the aarch64 host code is
refused before it loads (negative control)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from compiler.artifacts.artifact import CONFIG_FILE, load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.runtime.profile import profile_decode_step
from compiler.runtime.session import Session
from compiler.target.targets import load_target, with_overrides
from tests.helpers.assertions import assert_mobilec_error
from tests.helpers.pocl_device import NEEDS_OPENCL, ON_POCL
from tests.helpers.reference import artifact_greedy
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

pytestmark = [pytest.mark.slow,  # five compiles
              NEEDS_OPENCL]

PROMPT = np.array([3, 7, 1, 4, 4, 9, 2, 5, 6, 8, 1, 2, 3], "int32")
STEPS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_artifacts")
    save_compilable_checkpoint(build_model("llama_gqa"), root / "hf")
    return root


def _compile(root, target: str, quant: str, name: str, **overrides) -> str:
    out = root / name
    if not out.exists():
        # float32 KV caches everywhere: the host and PoCL builds are compared at float32 tolerances
        compile_model(CompileOptions(str(root / "hf"), target, quant, str(out), context_window=64, progress=False,
                                     kv_dtype="f32", **overrides))
    return str(out)


@pytest.mark.parametrize("target,quant,atol", [("android-adreno", "q0f32", 1e-4), ("android-mali", "q4f32_g32", 1e-2)])
def test_gpu_artifact_decodes_the_host_artifacts_tokens_on_opencl(checkpoint, target, quant, atol):
    gpu = _compile(checkpoint, target, quant, f"{target}-{quant}", **ON_POCL)
    config = json.loads((load_artifact(gpu).path / CONFIG_FILE).read_text())
    assert config["target"]["overrides"] == {"host_target": "host", "compute_dtype": "float32"}
    assert config["target"]["tvm_target"]["kind"] == "opencl" and config["compute_dtype"] == "float32"
    gpu_logits, gpu_tokens, device = artifact_greedy(gpu, PROMPT, STEPS)
    assert device.startswith("opencl")
    host = _compile(checkpoint, "host", quant, f"host-{quant}")
    host_logits, host_tokens, host_device = artifact_greedy(host, PROMPT, STEPS)
    assert host_device.startswith("cpu")
    assert gpu_tokens == host_tokens
    np.testing.assert_allclose(gpu_logits, host_logits, atol=atol, rtol=0)
    # Negative control: the comparison sees a wrong position (the logits move from step to step).
    assert np.abs(gpu_logits[1:] - host_logits[:-1]).max() > 100 * atol


def test_chunked_prefill_on_opencl_matches_one_chunk(checkpoint):
    """A prompt prefilled in chunks of 4 (each chunk's attention over the cached pages merged with its own: the merge
    of attention states, mobilec's gpu_merge_state) gives the logits of one chunk; TVM's merge kernel raced on PoCL
    (a tiny Llama's logits off by 1.2 relative from the second chunk)."""
    session = Session(load_artifact(_compile(checkpoint, "android-adreno", "q0f32", "android-adreno-q0f32",
                                             **ON_POCL)))
    session.reset()
    whole = session.prefill_all_logits(PROMPT)
    session.reset()
    session.prefill_chunk = 4
    chunked = session.prefill_all_logits(PROMPT)
    np.testing.assert_allclose(chunked, whole, atol=1e-4 * np.abs(whole).max(), rtol=0)
    assert np.abs(chunked[1:] - whole[:-1]).max() > 1e-2 * np.abs(whole).max()  # negative control: one off


def test_without_host_target_the_phone_host_code_is_refused(checkpoint):
    phone = _compile(checkpoint, "android-adreno", "q0f32", "adreno-phone-host", compute_dtype="float32")
    assert_mobilec_error(lambda: Session(load_artifact(phone)), "aarch64")


def test_host_target_applies_to_gpu_targets_only():
    assert_mobilec_error(lambda: with_overrides(load_target("linux-arm64"), host_target="host"), "--host-target",
                         "GPU and NPU targets")
    assert with_overrides(load_target("hexagon-npu"), host_target="host").overrides == {"host_target": "host"}
    assert_mobilec_error(lambda: with_overrides(load_target("android-adreno"), host_target="android-mali"),
                         "CPU target file")
    assert_mobilec_error(lambda: with_overrides(load_target("android-adreno"), compute_dtype="int8"),
                         "--compute-dtype")


def test_profile_reads_each_kernels_device_time_from_opencl_events(checkpoint):
    """`mobilec profile` on an OpenCL artifact: every launch of a decode step timed by the device (event profiling),
    one per OpenCL kernel the library holds, adding up to no more than the step's wall time (a tiny model's step is
    mostly host work; SmolLM2's adds up to it: test_smollm2_float16_gpu_artifacts.py), while a CPU artifact has
    no device table."""
    gpu = _compile(checkpoint, "android-adreno", "q0f32", "android-adreno-q0f32", **ON_POCL)
    art = load_artifact(gpu)
    prof = profile_decode_step(Session(art), context_len=8, steps=4)
    device = prof["device"]
    layers = art.config["model"]["config"]["num_hidden_layers"]
    assert device["launches_per_step"] >= prof["kernel_calls_per_step"] - 1  # the KV builtin launches kernels too
    assert device["launches_per_layer"] == device["launches_per_step"] / layers
    source = (art.path / "lib" / "kernels.cl").read_text()
    assert all(f"__kernel void {k['name']}(" in source for k in device["kernels"])
    assert sum(k["launches_per_step"] for k in device["kernels"]) == device["launches_per_step"]
    assert 0 < device["kernels_ms"] and device["fraction_of_step"] <= 1.1, device
    host = _compile(checkpoint, "host", "q0f32", "host-q0f32")
    assert profile_decode_step(Session(load_artifact(host)), context_len=8, steps=2)["device"] is None
