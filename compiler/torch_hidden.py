"""TVM without torch: TVM and its FFI import torch wherever it is installed, only to exchange tensors and streams with
it, which mobilec (numpy arrays in, numpy arrays out) never does. That import is 2.5 s of every Python process that
loads TVM (measured on 2 cores): the `mobilec` command itself, and the worker processes TVM starts for it
(MetaSchedule's builders and runners, new for each batch of candidates; an RPC server's process per session)."""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import sys
from pathlib import Path
from typing import Iterator, Mapping

# Python imports its sitecustomize at start in a process whose PYTHONPATH leads here (worker_environ).
WORKER_SITE = Path(__file__).resolve().with_name("worker_site")


class TorchHiddenFromTvm(importlib.abc.MetaPathFinder):
    """While tvm or tvm_ffi initializes, `import torch` fails as if torch were not installed (both take that case);
    afterwards torch imports as usual (eval's reference, AWQ calibration)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch" and any(getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False)
                                       for name in ("tvm", "tvm_ffi")):
            raise ModuleNotFoundError("torch is not imported while TVM initializes", name="torch")
        return None


def hide_torch_from_tvm() -> None:
    """In this process, before it imports TVM."""
    if not any(isinstance(finder, TorchHiddenFromTvm) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchHiddenFromTvm())


def worker_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a Python process that loads TVM: its PYTHONPATH leads first to WORKER_SITE."""
    paths = [str(WORKER_SITE), *(p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


@contextlib.contextmanager
def workers_without_torch() -> Iterator[None]:
    """While open, the Python processes this one starts (TVM's worker pools take os.environ) load TVM without
    torch."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = worker_environ(os.environ)["PYTHONPATH"]
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
