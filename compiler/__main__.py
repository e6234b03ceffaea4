"""`python -m compiler` and the `mobilec` command."""

import importlib.abc
import sys


class _TorchHiddenFromTvm(importlib.abc.MetaPathFinder):
    """TVM and its FFI import torch wherever it is installed, only to exchange tensors and streams with it: 2.5-4 s
    of a command's start (measured on 2 cores) that mobilec, which hands TVM numpy arrays, never uses. While either
    initializes, `import torch` fails as if torch were not installed (both take that case); afterwards torch imports
    as usual (eval's reference, AWQ calibration)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch" and any(getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False)
                                       for name in ("tvm", "tvm_ffi")):
            raise ModuleNotFoundError("torch is not imported while TVM initializes", name="torch")
        return None


def run() -> None:
    sys.meta_path.insert(0, _TorchHiddenFromTvm())
    from .commands.cli import main  # pylint: disable=import-outside-toplevel

    main()  # pylint: disable=no-value-for-parameter


if __name__ == "__main__":
    run()
