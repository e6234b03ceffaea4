"""Prefill GEMMs on ARM cores, modelled instruction by instruction: mobilec's integer GEMM against llama.cpp's.

    .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcpp  # its source, once
    tar -xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp
    .venv/bin/python bench/arm_gemm_mca.py --llama-cpp /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml

Ours: compiler/kernels/integer_dot_gemm built by TVM for the modelled core's `-mcpu` with the features of
targets/android-arm64.toml (i8mm: smmla) and targets/linux-arm64.toml (dotprod: sdot), K = 576 (SmolLM2's hidden size;
the block loop does not depend on it). llama.cpp's, compiled from its own sources for the same core by the clang of
the llvm-mca that models it (nothing of it is kept): the i8mm GEMM of repacked Q4_0 (`ggml_gemm_q4_0_4x8_q8_0`,
repack.cpp, inline assembly), its dotprod one (`ggml_gemm_q4_0_4x4_q8_0`), and the two-row dot products
(`ggml_vec_dot_*` with nrc = 2, quants.c: `smmla` on 2 rows x 2 columns) for Q4_0, Q4_1 and Q8_0. For each, the
innermost loop with the most integer multiply instructions is modelled on the core models of bench/arm_gemv_mca.py
(llvm-mca-15's Neoverse-N2 and its in-order Cortex-A55; llvm-19's own Cortex-A510 and Neoverse-V2, the X3's sibling,
where llvm-19 and clang-19 are installed) and scaled to one 32 x 32 output tile over one 32-value block of K (32768
multiply-adds; smmla does 32, sdot 16): cycles per tile = loop cycles x 32768 / the loop's multiply-adds. Activation
quantization (ours, llama.cpp's quantize_mat_q8_0) is left out of both.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tvm
from arm_gemv_mca import (CoreModel, Loop, _asm_functions, _clean, _loops, _mnemonic, _objdump_functions, core_models,
                          missing_tools, modelled_target)

from compiler.kernels.integer_dot_gemm import GemmShape, gemm
from compiler.quantization.group import GroupLayout
from compiler.target.targets import load_target

TILE_MACS = 32 * 32 * 32
K = 576  # SmolLM2's hidden size
PANEL_ROWS = 8  # X rows of an activation panel (kernels/integer_dot_gemm TILE_M)
MACS = {"smmla": 32, "usmmla": 32, "sdot": 16}  # multiply-adds per instruction
FORMATS = {"Q4_0": (4, True), "Q4_1": (4, False), "Q8_0": (8, True)}  # GGUF block -> bits, symmetric
TARGETS = {"i8mm": "android-arm64", "dotprod": "linux-arm64"}
# llama.cpp's kernels: (label, source file, function, instruction family, formats)
LLAMA_KERNELS = [
    ("gemm_q4_0_4x8 (repack, i8mm)", "repack.cpp", "ggml_gemm_q4_0_4x8_q8_0", "i8mm", ("Q4_0",)),
    ("gemm_q4_0_4x4 (repack, dotprod)", "repack.cpp", "ggml_gemm_q4_0_4x4_q8_0", "dotprod", ("Q4_0",)),
    ("vec_dot_q4_0_q8_0 nrc=2", "quants.c", "ggml_vec_dot_q4_0_q8_0", "i8mm", ("Q4_0",)),
    ("vec_dot_q4_1_q8_1 nrc=2", "quants.c", "ggml_vec_dot_q4_1_q8_1", "i8mm", ("Q4_1",)),
    ("vec_dot_q8_0_q8_0 nrc=2", "quants.c", "ggml_vec_dot_q8_0_q8_0", "i8mm", ("Q8_0",)),
]


def _macs(ops, first, last) -> int:
    return sum(MACS.get(_mnemonic(t), 0) for _, t in ops[first:last + 1] if t)


def _gemm_loop(ops) -> tuple[Loop, int] | None:
    """The innermost loop with the most multiply-adds (smmla or sdot), and its multiply-adds per iteration."""
    loops = _loops(ops)
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    inner = [lp for lp in inner if _macs(ops, *lp) > 0]
    if not inner:
        return None
    hot = max(inner, key=lambda lp: _macs(ops, *lp))
    return Loop(_clean(ops, *hot), 0), _macs(ops, *hot)


def _tile_cycles(found: tuple[Loop, int], model: CoreModel) -> tuple[float, float]:
    """(cycles, instructions) per 32 x 32 tile over one 32-value block."""
    loop, macs = found
    return loop.mca(model) * TILE_MACS / macs, (len(loop.body) - 1) * TILE_MACS / macs


def _relay_loop(ops) -> Loop | None:
    """The loop that re-lays the stored codes (neon order, 4-bit rows in pairs) into the block products' order
    (GemmShape.relays), a pair of W rows per iteration: the one with `st4`."""
    loops = [lp for lp in _loops(ops) if any(t and _mnemonic(t) == "st4" for _, t in ops[lp[0]:lp[1] + 1])]
    return Loop(_clean(ops, *min(loops, key=lambda lp: lp[1] - lp[0])), 0) if loops else None


def _ours(fmt: str, dot_family: str, cpu: str) -> tuple[tuple[Loop, int], Loop | None]:
    """Our GEMM's block-product loop (with its multiply-adds) and, for 4-bit codes, its per-row re-lay loop."""
    bits, symmetric = FORMATS[fmt]
    target = modelled_target(load_target(TARGETS[dot_family]).tvm_target_json, cpu)
    # as ARM targets store the codes (quantization/group.py: 4-bit rows in pairs), re-laid per task
    order = GroupLayout(bits, 32, symmetric, "float16").with_code_order("neon_pairs", K).code_order
    shape = GemmShape(K, K, bits, 32, symmetric, "float16", dot_family, code_order=order)
    funcs = _asm_functions(tvm.tirx.build(tvm.IRModule({"gemm": gemm(shape).with_attr("global_symbol", "gemm")}),
                                          target=target).inspect_source("asm"))
    found = next(found for ops in funcs.values() if (found := _gemm_loop(ops)))
    relay = next((loop for ops in funcs.values() if (loop := _relay_loop(ops))), None) if shape.relays else None
    return found, relay


@functools.cache  # once per source, family and core model: every format of the report reads it
def _llama(ggml: Path, source: str, dot_family: str, model: CoreModel, work: Path) -> dict[str, list]:
    """llama.cpp's ARM `source` compiled by the model's clang for its core (NEON, +nosve; +i8mm for the i8mm kernels)
    and disassembled: its inline assembly writes smmla as `.inst` words, which only the disassembler names."""
    features = "+nosve" + ("+i8mm" if dot_family == "i8mm" else "+noi8mm")
    obj = work / f"{source}-{model.clang}-{model.mcpu}-{dot_family}.o"
    compiler = model.clangxx if source.endswith(".cpp") else model.clang
    subprocess.run([compiler, "--target=aarch64-linux-gnu", f"-mcpu={model.clang_cpu(model.mcpu)}{features}", "-O3",
                    "-c", "-I", "include", "-I", "src", "-I", "src/ggml-cpu", "-D_GNU_SOURCE",
                    f"src/ggml-cpu/arch/arm/{source}", "-o", str(obj)], cwd=ggml, check=True, capture_output=True,
                   text=True)
    return _objdump_functions(obj)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", required=True, type=Path,
                        help="llama.cpp's ggml directory (vendor/llama.cpp/ggml of the llama-cpp-python sdist)")
    args = parser.parse_args()
    for tool in missing_tools():
        parser.error(f"{tool} not found (Debian: apt-get install llvm-15 clang-15)")
    if not (args.llama_cpp / "src/ggml-cpu/arch/arm/repack.cpp").is_file():
        parser.error(f"no src/ggml-cpu/arch/arm/repack.cpp under {args.llama_cpp}; see the download lines in --help")
    work = Path(tempfile.mkdtemp(prefix="arm-gemm-mca-"))
    try:
        report(args.llama_cpp, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(ggml: Path, work: Path) -> None:
    models = core_models()
    print("cycles (instructions) per 32 x 32 output tile over one 32-value block of K, both built for the modelled "
          "core; core models: " + ", ".join(f"{m.label} = {m.mca} -mcpu={m.mcpu} ({m.clang})" for m in models))
    header = f"{'kernel':<44} {'format':<6} " + " ".join(f"{m.label:>14}" for m in models)
    print(header)
    print("-" * len(header))
    figures, relays = {}, []
    for fmt in FORMATS:
        for dot_family in TARGETS:
            cells = []
            built = {cpu: _ours(fmt, dot_family, cpu) for cpu in {m.mcpu for m in models}}
            for m in models:
                found, relay = built[m.mcpu]
                cycles, instructions = _tile_cycles(found, m)
                figures["mobilec", dot_family, fmt, m] = cycles
                cells.append(f"{cycles:>6.0f} ({instructions:>5.0f})")
                if relay is not None:  # one W row re-laid, against its block products for one panel of X rows
                    panel = cycles / 32 * (K // 32) * PANEL_ROWS / 32
                    relays.append((fmt, dot_family, m, relay.mca(m) / 2, panel))
            label = f"mobilec integer_dot_gemm ({'smmla' if dot_family == 'i8mm' else 'sdot'}, {dot_family})"
            print(f"{label:<44} {fmt:<6} " + " ".join(f"{c:>14}" for c in cells))
        for label, source, function, dot_family, formats in LLAMA_KERNELS:
            if fmt not in formats:
                continue
            cells = []
            for m in models:
                ops = _llama(ggml, source, dot_family, m, work)[function]
                cycles, instructions = _tile_cycles(_gemm_loop(ops), m)
                figures[label, dot_family, fmt, m] = cycles
                cells.append(f"{cycles:>6.0f} ({instructions:>5.0f})")
            print(f"{'llama.cpp ' + label:<44} {fmt:<6} " + " ".join(f"{c:>14}" for c in cells))
    print(f"codes re-laid from the stored order per task (K = {K}), cycles per W row against one {PANEL_ROWS}-row "
          f"panel's block products for it (paid once per task, for all its panels):")
    for fmt, dot_family, m, cycles, panel in relays:
        print(f"  {fmt} {dot_family:<8} {m.label:<6} {cycles:6.1f} = {cycles / panel:.1%} of one panel, "
              f"{cycles / panel / 16:.2%} of a 128-token prompt's 16")
    for m in models:
        for dot_family in TARGETS:
            theirs = {key: value for key, value in figures.items()
                      if key[0] != "mobilec" and key[1] == dot_family and key[3] == m}
            for (label, _, fmt, _), value in theirs.items():
                ratio = figures["mobilec", dot_family, fmt, m] / value
                print(f"{m.label:<6} {dot_family:<8} {fmt}: mobilec / llama.cpp {label}: {ratio:.2f}")

if __name__ == "__main__":
    sys.exit(main())
