"""Which CPU targets this machine can execute, and the assembly of the ones it cannot: a test runs a kernel
variant only where the CPU has every feature its target enables (never SIGILL), and checks the others' code."""

from __future__ import annotations

import re

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


def innermost_loops(asm: str) -> list[list[str]]:
    """The instructions of each innermost loop of an assembly listing: a label to a branch back to it (x86 j*,
    AArch64 b / b.cond / cbz / cbnz / tbz / tbnz) with no such loop inside."""
    lines = asm.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.?L\w+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.match(r"\s+(?:j\w+|b(?:\.\w+)?|cbn?z|tbn?z)\s+(?:.*,\s*)?(\.?L\w+)\s*$", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    return [[line.strip() for line in lines[start + 1:end + 1] if line.startswith("\t")
             and not line.strip().startswith(".")]
            for start, end in loops if not any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops)]
