"""A command's start: TVM loads without torch (compiler/__main__.py), which stays importable afterwards."""

import subprocess
import sys


def _imports(*args: str) -> set[str]:
    """The modules a Python process with `args` imported (-X importtime's report, which also lists an import that
    failed by its name alone: torch's own extension, torch._C, tells torch loaded)."""
    run = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}


def test_a_command_that_loads_tvm_does_not_import_torch():
    imported = _imports("-m", "compiler", "targets")  # reads the target files through TVM's Target
    assert "tvm" in imported and "torch._C" not in imported
    # negative control: TVM alone imports torch where it is installed
    assert "torch._C" in _imports("-c", "import tvm")


def test_torch_imports_after_tvm_loaded_without_it():
    code = ("import sys; from compiler.__main__ import _TorchHiddenFromTvm; sys.meta_path.insert(0, "
            "_TorchHiddenFromTvm()); import tvm; assert 'torch' not in sys.modules; import torch; "
            "print(torch.ones(2).sum().item())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "2.0", run.stderr[-2000:]
