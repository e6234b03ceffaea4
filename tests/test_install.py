"""The wheel works installed (not editable) and run from outside the repository: it ships the target files and the
tuning logs (under <prefix>/share/mobilec/, where compiler/data_files.py looks), `mobilec targets` lists them all,
and a tiny model compiles and generates.

The wheel is built from a copy of the sources (the build leaves build/ and egg-info behind) and installed with
--no-deps into a fresh venv that sees this environment's dependencies through a .pth file; that path is not a
site directory, so the editable install's own .pth there is not run and `compiler` is the wheel's copy."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from compiler.data_files import CHECKOUT
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

SOURCES = ("pyproject.toml", "README.md", "compiler", "targets", "tuning_logs", "native")
TIMEOUT_S = 600

pytestmark = pytest.mark.slow  # a wheel build, a compile and a generate: about a minute


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the venv, a working directory outside the repository, the environment to run it with)."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    for name in SOURCES:
        if (CHECKOUT / name).is_dir():
            shutil.copytree(CHECKOUT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(CHECKOUT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOBILEC_TUNING_LOGS", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "wheel"),
          str(src)], root, env)
    (wheel,) = (root / "wheel").glob("mobilec-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     root, env).stdout.strip())
    (site / "mobilec-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # this env's packages
    # --ignore-installed: the editable mobilec this env has is visible through the .pth; never touch it.
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
          str(wheel)], root, env)
    work = root / "elsewhere"
    work.mkdir()
    return venv, work, env


def test_installed_copy_finds_every_target_file_and_tuning_log(installed):
    venv, work, env = installed
    probe = """
import json, sys, compiler
from compiler import tuning_log
from compiler.target import targets
from compiler.data_files import data_dir
from compiler.torch_hidden import WORKER_SITE
print(json.dumps({"compiler": compiler.__file__, "worker_site": (WORKER_SITE / "sitecustomize.py").is_file(), "prefix": sys.prefix, "targets_dir": str(data_dir("targets")),
                  "targets": sorted(targets.available_targets()), "logs_dir": str(tuning_log.TUNING_LOGS_DIR),
                  "host_selection": len(tuning_log.read_selection(tuning_log.log_dir("host"), "reinstall"))}))
"""
    found = json.loads(_run([str(venv / "bin" / "python"), "-c", probe], work, env).stdout)
    share = venv / "share" / "mobilec"
    assert Path(found["compiler"]).is_relative_to(venv), found  # the wheel's copy, not the checkout's
    assert found["worker_site"]  # TVM's worker processes load without torch (compiler/torch_hidden.py)
    assert found["targets_dir"] == str(share / "targets") and found["logs_dir"] == str(share / "tuning_logs")
    shipped = sorted(p.stem for p in (CHECKOUT / "targets").glob("*.toml"))
    assert found["targets"] == shipped
    for path in (CHECKOUT / "targets").glob("*.toml"):
        assert (share / "targets" / path.name).read_bytes() == path.read_bytes()
    # Every tuning log of the checkout is installed (pyproject.toml lists each tuning_logs/<target>/ by name).
    logs = [d for d in (CHECKOUT / "tuning_logs").iterdir() if d.is_dir()]
    assert logs
    for log in logs:
        assert sorted(p.name for p in (share / "tuning_logs" / log.name).iterdir()) == \
            sorted(p.name for p in log.glob("*.json")), f"tuning_logs/{log.name} is not in the wheel"
    assert found["host_selection"] > 0

    listed = _run([str(venv / "bin" / "mobilec"), "targets"], work, env).stdout.splitlines()
    assert sorted(line.split()[0] for line in listed) == shipped


def test_installed_copy_compiles_and_generates_a_tiny_model(installed):
    venv, work, env = installed
    save_compilable_checkpoint(build_model("llama_gqa"), work / "hf")
    mobilec = str(venv / "bin" / "mobilec")
    summary = json.loads(_run([mobilec, "compile", "--model", "hf", "--target", "host", "--quant", "q0f32",
                               "--context-window", "64", "-o", "tiny", "--json"], work, env).stdout)
    assert summary["artifact"] == "tiny" and (work / "tiny" / "lib" / "model.so").is_file()
    config = json.loads((work / "tiny" / "mobilec-config.json").read_text())
    host_toml = (venv / "share" / "mobilec" / "targets" / "host.toml").read_bytes()
    assert config["target"]["file_sha256"] == hashlib.sha256(host_toml).hexdigest() and config["cpu"]
    out = json.loads(_run([mobilec, "generate", "tiny", "--prompt", "the cat", "--max-new-tokens", "2", "--json"],
                          work, env).stdout)
    assert len(out["token_ids"]) == 2


def test_installed_copy_packages_the_native_runner(installed):
    """`mobilec package` compiles the native sources the wheel installed (share/mobilec/native/runtime); the runner
    runs from the package and opens the artifact (the tiny model's word-level tokenizer is refused by name: the
    native tokenizer does BPE only)."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++)")
    venv, work, env = installed
    if not (work / "tiny").is_dir():
        test_installed_copy_compiles_and_generates_a_tiny_model(installed)
    shipped = sorted(p.name for p in (venv / "share" / "mobilec" / "native" / "runtime").iterdir())
    assert shipped == sorted(p.name for p in (CHECKOUT / "native" / "runtime").iterdir() if p.suffix in (".h", ".cc"))
    summary = json.loads(_run([str(venv / "bin" / "mobilec"), "package", "tiny", "-o", "tiny-app", "--json"], work,
                              env).stdout)
    runner = work / "tiny-app" / summary["runner"]
    run = subprocess.run(["/usr/bin/env", "-i", str(runner), str(work / "tiny-app"), "--prompt", "the cat"],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 2 and "WordLevel" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_installed_copy_ships_the_emulated_dsps_sources(installed):
    """Running a hexagon-npu artifact here compiles the DSP side from native/hexagon: the installed copy finds the
    sources the wheel installed (share/mobilec/native/hexagon), not a checkout's."""
    venv, work, env = installed
    shipped = venv / "share" / "mobilec" / "native" / "hexagon"
    assert sorted(p.name for p in shipped.iterdir()) == sorted(
        p.name for p in (CHECKOUT / "native" / "hexagon").iterdir() if p.suffix in (".h", ".c"))
    found = _run([str(venv / "bin" / "python"), "-c",
                  "from compiler.testing.emulated_hexagon import NATIVE_DIR; print(NATIVE_DIR)"], work, env).stdout
    assert Path(found.strip()).resolve() == shipped.resolve()
