"""Which CPU targets this machine can execute, and the assembly of the ones it cannot: a test runs a kernel
variant only where the CPU has every feature its target enables (never SIGILL), and checks the others' code."""

from __future__ import annotations

import tvm

from compiler.target.host import host_features, host_target_json
from compiler.target.isa import cpu_isa, missing_features

X86 = {"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu"}
# one target per x86 integer dot-product family (compiler/target/isa.py)
X86_FAMILY_TARGETS = {
    "avx2": tvm.target.Target({**X86, "mcpu": "x86-64-v3"}),
    "avxvnni": tvm.target.Target({**X86, "mcpu": "x86-64-v3", "mattr": ["+avxvnni"]}),
    "avx512bw": tvm.target.Target({**X86, "mcpu": "x86-64-v4"}),
    "avx512vnni": tvm.target.Target({**X86, "mcpu": "x86-64-v4", "mattr": ["+avx512vnni"]}),
}


def runs_here(target: tvm.target.Target) -> bool:
    """The machine's CPU has the architecture and every instruction-set feature `target` enables."""
    isa, here = cpu_isa(target), cpu_isa(tvm.target.Target(host_target_json()))
    return isa.arch == here.arch and not missing_features(isa.required_features, host_features())


def assembly(lib) -> str:
    """The assembly of a module built by tvm.tirx.build (its LLVM module)."""
    return lib.inspect_source("asm")
