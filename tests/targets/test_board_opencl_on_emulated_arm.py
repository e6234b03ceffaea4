"""A Linux board's GPU as an RPC device, end to end on the emulated arm64 device: its server is the folder `mobilec
board-folder` writes (device_server.py and the cross-built aarch64 OpenCL device), run in the Debian arm64 image
whose PoCL plays the board's GPU. A tiny Llama's android-adreno artifact built with `--host-target linux-arm64
--compute-dtype float32` (PoCL has no float16) is benched there through the tracker: its kernels ran on OpenCL,
and its greedy tokens are the x86 build's (`--host-target host`, run here on x86 PoCL)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from compiler.artifacts.artifact import load_artifact
from compiler.commands.cli import main
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.runtime.bench import generate, prompt_ids
from compiler.runtime.session import Session
from tests.helpers.pocl_device import NEEDS_OPENCL
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

pytestmark = [pytest.mark.slow, NEEDS_OPENCL]

TARGET, QUANT = "android-adreno", "q4f32_g32"
# As few as show the decode loop: PoCL compiles every kernel with LLVM under qemu on first launch.
PROMPT_LEN, GEN_LEN = 4, 4
SESSION_TIMEOUT_S = 600


def _compile(root, host_target: str) -> str:
    out = root / host_target
    compile_model(CompileOptions(str(root / "hf"), TARGET, QUANT, str(out), context_window=32, progress=False,
                                 no_tuning=True, host_target=host_target, compute_dtype="float32"))
    return str(out)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("board_opencl")
    save_compilable_checkpoint(build_model("llama_gqa", num_hidden_layers=1), root / "hf")
    return {host: _compile(root, host) for host in ("linux-arm64", "host")}


def test_bench_on_the_boards_opencl_gives_the_x86_builds_tokens(artifacts, emulated_arm_device):
    board = emulated_arm_device
    first = board.server_log.read_text().splitlines()
    said = [line for line in first if line.startswith("device-server: ")][0]
    assert said.startswith("device-server: OpenCL device ") and "Portable Computing Language" in said, said
    result = CliRunner().invoke(main, ["bench", artifacts["linux-arm64"], "--tracker",
                                       f"{board.tracker_host}:{board.tracker_port}", "--key", board.key,
                                       "--prompt-len", str(PROMPT_LEN), "--gen-len", str(GEN_LEN), "--repeat", "1",
                                       "--session-timeout", str(SESSION_TIMEOUT_S), "--json"])
    assert result.exit_code == 0, result.output
    bench = json.loads(result.stdout)
    assert bench["device"]["kernels_on"] == "opencl"
    assert "Portable Computing Language" in bench["device"]["opencl"]["platform"]
    x86 = load_artifact(artifacts["host"])
    ids = prompt_ids(int(x86.config["model"]["config"]["vocab_size"]), PROMPT_LEN, 0)
    assert bench["tokens"] == generate(Session(x86), ids, GEN_LEN).tokens
