"""Imported by Python at the start of a process whose PYTHONPATH leads here (torch_hidden.worker_environ: TVM's
worker processes), before anything else: TVM loads there without torch."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the folder that holds the compiler package, last
from compiler.torch_hidden import hide_torch_from_tvm  # pylint: disable=wrong-import-position

hide_torch_from_tvm()
