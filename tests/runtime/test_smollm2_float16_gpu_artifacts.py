"""SmolLM2's phone GPU artifacts as the phones run them, computing in float16 (`--host-target host` only), run end
to end on Intel's OpenCL CPU runtime, the implementation here with cl_khr_fp16: `generate` gives the host artifact
of the same scheme's 16 greedy tokens (android-adreno q4f16_g32 and gguf, android-mali q8f16_g128), `eval` its
perplexity within 0.3% on a 128-token window, as with int8 and int4 KV caches (within +0.5% and +3% of the float16
cache's), `bench` runs (locally and over RPC with the OpenCL device in the RPC server), and `profile` over RPC. PoCL, without cl_khr_fp16, refuses the artifact in one line naming the fix (negative control).

The commands run in processes of their own: the OpenCL platform is chosen once per process
(MOBILEC_OPENCL_PLATFORM), and the test processes use PoCL. The default artifact's generate, eval and local bench
share one process (ON_ONE_PROCESS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.commands.cli import main
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.runtime import opencl_device
from compiler.testing.local_rpc import start_server, start_tracker, wait_until_free
from tests.helpers.pocl_device import FP16_PLATFORM, NEEDS_X86_FOR_FP16, ON_FP16_OPENCL, fp16_platform_installed

pytestmark = [pytest.mark.slow,  # three SmolLM2 compiles (seven with the extended set); Intel's runtime compiles
              # each artifact's kernels (~10 s)
              NEEDS_X86_FOR_FP16]

PROMPT = "The three primary colors are"
TOKENS = 16
EVAL_WINDOW = 128  # the ratio to the host was +0.38% on 32 tokens, +0.17% on 64, +0.03% on 128, +0.05% on 1024
EVAL_TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
# (target, scheme) of the float16 GPU artifacts; each is checked against the host artifact of its scheme. The default
# set runs the phones' default (Adreno's q4f16_g32) and every check on it; the GGUF blocks and Mali's q8f16_g128 (the
# same float16 code with other dequantize kernels, which tests/targets/test_float16_kernels.py checks one by one) are
# decoded end to end in the extended set: two SmolLM2 compiles each.
DEFAULT = ("android-adreno", "q4f16_g32")
GPU_ARTIFACTS = [DEFAULT,
                 pytest.param("android-adreno", "gguf", marks=pytest.mark.extended),
                 pytest.param("android-mali", "q8f16_g128", marks=pytest.mark.extended)]
KEY = "mobilec-opencl-fp16"
KV_GATES = {"int8": 1.005, "int4": 1.03}  # perplexity of a quantized KV cache over the float16 cache's


class _CompiledWhenAsked(dict):
    """(target, quant) or (target, quant, kv dtype) -> SmolLM2's artifact (the target's own KV cache, or that one),
    compiled on first use (the extended set's builds only there)."""

    def __init__(self, root: Path, smollm2_gguf: Path):
        super().__init__()
        self.root, self.smollm2_gguf = root, smollm2_gguf

    def __missing__(self, key: tuple[str, ...]) -> Path:
        target, quant, kv = (*key, "auto")[:3]
        path = self.root / "-".join(key)
        compile_model(CompileOptions(str(self.smollm2_gguf), target, quant, str(path), context_window=256,
                                     progress=False, kv_dtype=kv, **(ON_FP16_OPENCL if target != "host" else {})))
        config = json.loads((path / "mobilec-config.json").read_text())
        if kv != "auto":
            assert config["kv_dtype"] == kv
        if target != "host":
            assert config["compute_dtype"] == "float16" and config["target"]["tvm_target"]["kind"] == "opencl"
            assert "cl_khr_fp16" in (path / "lib" / "kernels.cl").read_text()
        self[key] = path
        return path


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, smollm2_gguf) -> dict[tuple[str, str], Path]:
    """The GPU artifacts and the host artifacts of their schemes, each compiled when a test first asks for it."""
    fp16_platform_installed()
    return _CompiledWhenAsked(tmp_path_factory.mktemp("float16_gpu"), smollm2_gguf)


def _mobilec_process(*args, platform: dict[str, str] = FP16_PLATFORM) -> subprocess.CompletedProcess:
    """`mobilec ARGS` in a new process whose OpenCL is the named platform."""
    return subprocess.run([sys.executable, "-m", "compiler", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **platform}, timeout=600, check=False)


# `mobilec ARGS` for each ARGS of a JSON list on stdin, one after another in this process, their exit codes and
# output (with the traceback of an exception) written as a JSON list to the file argv[1]. The first command on
# Intel's runtime loads it and builds the kernels: a second generate in the same process took a third of the first's
# time (33 vs 101 s, loaded 2-core VM).
ON_ONE_PROCESS = """
import json, sys, traceback
from click.testing import CliRunner
from compiler.commands.cli import main
runs = [CliRunner().invoke(main, args) for args in json.load(sys.stdin)]
with open(sys.argv[1], "w") as out:
    json.dump([{"exit_code": r.exit_code, "stdout": r.stdout,
                "stderr": r.stderr + ("" if r.exc_info is None or isinstance(r.exception, SystemExit)
                                      else "".join(traceback.format_exception(*r.exc_info)))} for r in runs], out)
"""


def _in_one_process(*commands: tuple) -> list[dict]:
    """The JSON of `mobilec ARGS --json` for each ARGS in `commands`, run in one new process on Intel's runtime."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        process = subprocess.run([sys.executable, "-c", ON_ONE_PROCESS, str(out)], capture_output=True, text=True,
                                 input=json.dumps([[*map(str, args), "--json"] for args in commands]),
                                 env={**os.environ, **FP16_PLATFORM}, timeout=1200, check=False)
        assert process.returncode == 0, process.stderr
        runs = json.loads(out.read_text())
    for args, run in zip(commands, runs):
        assert run["exit_code"] == 0, (args, run["stderr"])
    return [json.loads(run["stdout"]) for run in runs]


def _json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _here(*args) -> dict:
    result = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _generate(path: Path) -> tuple:
    return "generate", path, "--prompt", PROMPT, "--max-new-tokens", TOKENS


def _eval(path: Path) -> tuple:
    return "eval", path, "--text", EVAL_TEXT, "--max-tokens", EVAL_WINDOW, "--window", EVAL_WINDOW, "--no-reference"


def _local_bench(path: Path) -> tuple:
    return "bench", path, "--prompt-len", 8, "--gen-len", 4, "--repeat", 1


@pytest.fixture(scope="module")
def default_on_fp16(artifacts) -> dict[str, dict]:
    """The JSON of generate, eval and a local bench of the default GPU artifact, in one process on Intel's runtime."""
    path = artifacts[DEFAULT]
    return dict(zip(("generate", "eval", "bench"), _in_one_process(_generate(path), _eval(path), _local_bench(path))))


@pytest.mark.parametrize("target,quant", GPU_ARTIFACTS)
def test_float16_artifact_decodes_the_host_artifacts_tokens(request, artifacts, target, quant):
    if (target, quant) == DEFAULT:
        on_gpu = request.getfixturevalue("default_on_fp16")["generate"]
    else:
        on_gpu = _json(_mobilec_process(*_generate(artifacts[target, quant]), "--json"))
    on_cpu = _here(*_generate(artifacts["host", quant]))
    assert len(on_gpu["token_ids"]) == TOKENS and on_gpu["token_ids"] == on_cpu["token_ids"]


def _perplexity(path: Path) -> float:
    """The artifact's perplexity on the eval window, in a process of its own on Intel's runtime (a GPU artifact)
    or here (a host one)."""
    if json.loads((path / "mobilec-config.json").read_text())["target"]["tvm_target"]["kind"] == "opencl":
        return _json(_mobilec_process(*_eval(path), "--json"))["ppl"]
    return _here(*_eval(path))["ppl"]


@pytest.fixture(scope="module")
def perplexity(artifacts, default_on_fp16):
    """(target, quant, kv dtype) -> perplexity on the eval window, each measured once ("f16": the artifact's own
    float16 cache)."""
    measured = {(*DEFAULT, "f16"): default_on_fp16["eval"]["ppl"]}

    def of(target: str, quant: str, kv: str = "f16") -> float:
        if (target, quant, kv) not in measured:
            path = artifacts[target, quant] if kv == "f16" else artifacts[target, quant, kv]
            measured[target, quant, kv] = _perplexity(path)
        return measured[target, quant, kv]

    return of


def test_float16_perplexity_is_within_0_3_percent_of_the_host_artifacts(perplexity):
    gpu, host = perplexity("android-adreno", "q4f16_g32"), perplexity("host", "q4f16_g32")
    assert gpu <= host * 1.003, (gpu, host)


# int4 misses its gate on this text on Intel's runtime: +3.5% here (23.95 vs 23.14), +3.7% on 1024 tokens (15.698 vs
# 15.144). Not float16's doing (the same artifact built for float32: 15.796 on Intel's runtime, 15.545 on PoCL; the
# host's int4 15.498): last-bit float differences flip a few 4-bit codes and int4 carries them through the layers
# (PoCL and Intel's hidden states equal at layer 0, 2.4% apart at the last). On 1024 tokens of the README of
# 2026-12-06 the same float16 artifacts give int4 +1.23% and int8 +0.08% over the float16 cache (the host's int4:
# +0.87%).
INT4_ON_INTEL = pytest.mark.xfail(strict=True, reason="int4 on Intel's OpenCL, LICENSE: +3.5% over the float16 cache "
                                                      "(float noise through 4-bit codes: the same float32 artifact is "
                                                      "1.6% better on PoCL; README's text: +1.2%)")


# Both run in the extended set (-m extended): each is a SmolLM2 compile and two evaluations (~3 minutes of CI); the
# quantized caches' GPU kernels are checked against transformers on PoCL in the default set
# (tests/test_kv_cache_dtype.py), and int4 at 128 tokens of LICENSE measures float noise (above).
@pytest.mark.extended
@pytest.mark.parametrize("kv", ["int8", pytest.param("int4", marks=INT4_ON_INTEL)])
def test_quantized_kv_caches_on_the_float16_gpu_keep_the_perplexity(perplexity, kv):
    """int8 within +0.5% of the float16 cache on the same float16 GPU artifact, int4 within +3% (q/k/v widened to
    the float32 carrier, models/llama.py), and the cache quantizes (negative control: its perplexity is not the
    float16 cache's). (Against the host artifact with the same cache, the window is too short to gate: float16
    q/k/v move a few codes, and int8 on the GPU was 0.76% below the host's here, -0.01% on 1024 tokens.)"""
    gpu, f16 = perplexity("android-adreno", "q4f16_g32", kv), perplexity("android-adreno", "q4f16_g32")
    assert gpu <= f16 * KV_GATES[kv] and gpu != f16, (gpu, f16)


def test_bench_and_profile_here_and_over_rpc_run_on_fp16_opencl(artifacts, default_on_fp16, tmp_path):
    """Here: bench names Intel's fp16 device; through a tracker: the server's fp16 OpenCL runs the kernels (this
    process has no OpenCL platform), gives the same tokens, and times each launch. (A local profile's device times
    are checked on PoCL: tests/runtime/test_gpu_artifacts.py.)"""
    path = artifacts[DEFAULT]
    local = default_on_fp16["bench"]
    opencl = local["device"]["opencl"]
    assert local["device"]["kernels_on"] == "opencl" and opencl["fp16"] and "Intel" in opencl["platform"]
    tracker, port = start_tracker(tmp_path / "tracker.log")
    server = None
    try:
        server = start_server(tmp_path / "server.log", port, KEY, ("--load-library", str(opencl_device.library_path())),
                              env=FP16_PLATFORM)[0]
        wait_until_free(port, {KEY: 1}, [server])
        remote = ("--tracker", f"127.0.0.1:{port}", "--key", KEY, "--session-timeout", 300, "--json")
        bench = _json(_mobilec_process("bench", path, *remote, "--prompt-len", 8, "--gen-len", 4, "--repeat", 1,
                                       platform={}))
        wait_until_free(port, {KEY: 1}, [server])
        profile = _json(_mobilec_process("profile", path, *remote, "--context-len", 8, "--steps", 2, platform={}))
    finally:
        for process in (server, tracker):
            if process is not None:
                process.kill()
    assert bench["device"]["kind"] == "tracker" and bench["device"]["opencl"]["fp16"]
    device = profile["device"]
    assert profile["remote"]["opencl"]["fp16"] and device["launches_per_step"] > 30 * 2  # SmolLM2's 30 layers
    assert 0.9 <= device["fraction_of_step"] <= 1.1, device  # the device's kernel times add up to its step
    assert bench["tokens"] == local["tokens"]


def test_a_platform_without_fp16_refuses_the_artifact_in_one_line(artifacts):
    result = _mobilec_process("generate", artifacts["android-adreno", "q4f16_g32"], "--prompt", PROMPT,
                              platform={opencl_device.PLATFORM_VARIABLE: "pocl"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "computes in float16" in lines[0] and "cl_khr_fp16" in lines[0] and "MOBILEC_OPENCL_PLATFORM" in lines[0]


def test_a_platform_name_that_matches_none_is_told_with_the_installed_ones(artifacts):
    result = _mobilec_process("generate", artifacts["android-adreno", "q4f16_g32"], "--prompt", PROMPT,
                              platform={opencl_device.PLATFORM_VARIABLE: "nonesuch"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "MOBILEC_OPENCL_PLATFORM=nonesuch names no installed OpenCL platform" in lines[0]
    assert "Intel(R) OpenCL" in lines[0] and "Portable Computing Language" in lines[0]
