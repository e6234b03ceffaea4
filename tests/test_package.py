"""`mobilec package` for the host: the artifact with the native runner, C API and TVM's runtime, run with a bare
environment from another directory, gives `mobilec generate`'s greedy tokens; the output rule holds for packages.
The ARM and Android packages are tested in test_mobile_artifacts.py and targets/test_smollm2_on_emulated_arm.py."""

import json
import shutil
import subprocess

import pytest

from compiler.artifacts.artifact import CONFIG_FILE
from compiler.commands.package import PACKAGE_FILE, package
from compiler.errors import MobilecError
from compiler.runtime.generate import GenerateOptions, generate_text

pytestmark = pytest.mark.slow
PROMPT, TOKENS = "The capital of France is", 32


@pytest.fixture(scope="module")
def host_package(smollm2_gguf_exact, tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++): scripts/setup.sh installs it")
    out = tmp_path_factory.mktemp("package") / "smollm2"
    return out, package(smollm2_gguf_exact, out)


def _run(runner, *args, cwd):
    return subprocess.run(["/usr/bin/env", "-i", str(runner), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_packaged_runner_gives_the_python_tokens_with_a_bare_environment(host_package, smollm2_gguf_exact, tmp_path):
    out, summary = host_package
    assert summary["runner"] == "bin/mobilec-run" and summary["arch"] and summary["bytes"] > 50e6
    assert {p.name for p in (out / "lib").iterdir()} >= {"model.so", "libmobilec.so", "libtvm_runtime.so",
                                                          "libtvm_ffi.so"}
    assert (out / "include" / "mobilec.h").is_file()
    listed = json.loads((out / PACKAGE_FILE).read_text())["files"]
    assert "bin/mobilec-run" in listed and "lib/model.so" not in listed  # the artifact's own files stay its own
    run = _run(out / summary["runner"], out, "--prompt", PROMPT, "--max-new-tokens", TOKENS, "--ignore-eos", "--json",
               cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    native = json.loads(run.stdout)
    python = generate_text(GenerateOptions(str(smollm2_gguf_exact), PROMPT, max_new_tokens=TOKENS, ignore_eos=True))
    assert native["token_ids"] == python.token_ids and len(native["token_ids"]) == TOKENS
    assert native["text"] == python.text
    # negative control: another prompt, other tokens
    other = _run(out / summary["runner"], out, "--prompt", "Once upon a time", "--max-new-tokens", 8, "--json",
                 cwd=tmp_path)
    assert json.loads(other.stdout)["token_ids"] != python.token_ids[:8]


def test_packaged_runner_refuses_a_package_whose_library_changed(host_package, tmp_path):
    out, summary = host_package
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with open(copy / "lib" / "model.so", "ab") as f:
        f.write(b"\0")
    run = _run(copy / summary["runner"], copy, "--prompt", PROMPT, cwd=tmp_path)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "model.so" in run.stderr


def test_package_output_rule(host_package, smollm2_gguf_exact, tmp_path):
    out, _ = host_package
    # A directory of the user's is never written into.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(MobilecError, match="not a mobilec package"):
        package(smollm2_gguf_exact, mine)
    assert (mine / "notes.txt").read_text() == "mine" and len(list(mine.iterdir())) == 1
    # A package is replaced only with overwrite, and not when a file of the user's was put in it.
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with pytest.raises(MobilecError, match="--overwrite"):
        package(smollm2_gguf_exact, copy)
    (copy / "bin" / "my-script.sh").write_text("#!/bin/sh\n")
    with pytest.raises(MobilecError, match="other files"):
        package(smollm2_gguf_exact, copy, overwrite=True)
    assert (copy / "bin" / "my-script.sh").is_file()
    # The target is the artifact's: another one is refused, naming both.
    with pytest.raises(MobilecError, match="compiled for target host, not linux-arm64"):
        package(smollm2_gguf_exact, tmp_path / "arm", target="linux-arm64")
    assert not (tmp_path / "arm").exists()


def test_package_refuses_a_gpu_artifact(smollm2_gguf_exact, tmp_path):
    """The native runner drives CPU artifacts; a GPU artifact's config (here an edited copy) is refused before any
    build, with nothing written."""
    gpu = tmp_path / "gpu"
    shutil.copytree(smollm2_gguf_exact, gpu)
    config = json.loads((gpu / CONFIG_FILE).read_text())
    config["target"]["tvm_target"] = {"kind": "opencl", "device": "adreno", "host": config["target"]["tvm_target"]}
    (gpu / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(MobilecError, match=r"targets host \(opencl\); the native runner drives CPU artifacts only"):
        package(gpu, tmp_path / "out")
    assert not (tmp_path / "out").exists()
