"""A command's start, and its TVM worker processes' (compiler/torch_hidden.py): TVM loads without torch, which
stays importable afterwards."""

import contextlib
import os
import subprocess
import sys

from tvm.support.popen_pool import PopenPoolExecutor

from compiler.torch_hidden import WORKER_SITE, worker_environ, workers_without_torch


def _without_worker_site(environ) -> dict[str, str]:
    """`environ` whose PYTHONPATH no longer leads to WORKER_SITE (a command run in this test process before, such as
    device-server, may have put it there)."""
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(WORKER_SITE)]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths)}


def _imports(*args: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a Python process with `args` imported (-X importtime's report, which also lists an import that
    failed by its name alone: torch's own extension, torch._C, tells torch loaded)."""
    run = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=120,
                         check=False, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}


def test_a_command_that_loads_tvm_does_not_import_torch():
    imported = _imports("-m", "compiler", "targets")  # reads the target files through TVM's Target
    assert "tvm" in imported and "torch._C" not in imported
    # negative control: TVM alone imports torch where it is installed
    assert "torch._C" in _imports("-c", "import tvm", env=_without_worker_site(os.environ))


def test_a_worker_process_loads_tvm_without_torch():
    """A process started with worker_environ (an RPC server's, a tracker's) imports TVM without torch."""
    imported = _imports("-c", "import tvm", env=worker_environ(os.environ))
    assert "tvm" in imported and "sitecustomize" in imported and "torch._C" not in imported


def _torch_loaded() -> bool:
    return "torch" in sys.modules


def test_metaschedules_workers_load_tvm_without_torch_while_tuning(monkeypatch):
    """TVM's popen workers (MetaSchedule's builders and runners) started inside workers_without_torch have no
    torch; outside it they do (negative control), and the environment is as it was."""
    monkeypatch.setenv("PYTHONPATH", _without_worker_site(os.environ)["PYTHONPATH"])
    before = os.environ.get("PYTHONPATH")
    loaded = {}
    for hidden in (True, False):
        with workers_without_torch() if hidden else contextlib.nullcontext():
            pool = PopenPoolExecutor(max_workers=1, timeout=120)
            loaded[hidden] = pool.submit(_torch_loaded).result()
            pool.shutdown()
    assert loaded == {True: False, False: True}
    assert os.environ.get("PYTHONPATH") == before


def test_torch_imports_after_tvm_loaded_without_it():
    code = ("import sys; from compiler.torch_hidden import hide_torch_from_tvm; hide_torch_from_tvm(); "
            "import tvm; assert 'torch' not in sys.modules; import torch; print(torch.ones(2).sum().item())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "2.0", run.stderr[-2000:]
