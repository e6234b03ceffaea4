"""Decode GEMVs on ARM cores, modelled instruction by instruction: mobilec's integer GEMVs against llama.cpp's.

    .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcpp  # its source, once
    tar -xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp
    mobilec compile --target linux-arm64 --quant gguf --decode-activations int8 -o build/smollm2-arm64-int8
    .venv/bin/python bench/arm_gemv_mca.py --artifact build/smollm2-arm64-int8 \\
        --llama-cpp /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml

For each decode GEMV of the artifact's library (the `integer_dot_gemv_*` kernels, found by name), the hot loop is
taken from the library itself (`llvm-objdump-15 -d`), and the same kernel is rebuilt for the modelled core's own
`-mcpu` (TVM's assembly). llama.cpp's ARM kernels for the same block formats (`ggml_vec_dot_q4_0_q8_0`,
`ggml_vec_dot_q4_1_q8_1`, `ggml_vec_dot_q8_0_q8_0`, NEON path: `+nosve`) are compiled from its own
`ggml-cpu/arch/arm/quants.c` by clang-15 (nothing of it is kept) for the target's CPU and for the modelled core.
`llvm-mca-15` then models every loop on a big core (`-mcpu=neoverse-n2`) and a little one (`-mcpu=cortex-a510`,
which llvm-15 models as the in-order Cortex-A55); llvm-14 would fall back to the Cortex-A57 model for both.

Printed per format and core model: cycles and instructions per 32 weights of the steady-state loop (ours also per
whole row: its shorter last step and the row's epilogue included), bytes per weight, the ratio to llama.cpp; then
one SmolLM2 decode token's modelled GEMV compute time (every call of every GEMV, at the clock the target file
gives for that core, on its big-core count) against the bandwidth floor (weight bytes / memory_bandwidth_gbs).
Activation quantization (ours and llama.cpp's quantize_row_q8_*) and attention are left out of both. Last, the
same token's bound: only the instructions no int8-dot GEMV can do without (per 32 weights: the dot products, 2 for
int8 activations, 4 for int16 ones as two planes, and for 4-bit codes the nibble split: an AND and a shift per 16
bytes of a row, or an AND per 16 bytes of a pair of rows in the neon_pairs order, which the library's kernels read),
modelled by llvm-mca as one loop (`_essential_loop`) on the same cores; what a kernel spends above it goes
to scales, conversions and loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tvm

from compiler.artifact import load_artifact
from compiler.kernels.integer_dot_gemv import GemvShape, gemv
from compiler.quantization.group import ORDER_MARKS
from compiler.targets import load_target

MCA, OBJDUMP, CLANG = "llvm-mca-15", "llvm-objdump-15", "clang-15"
CORE_MODELS = {"neoverse-n2": "big", "cortex-a510": "little"}  # llvm-mca -mcpu -> the target file's core kind
ITERATIONS = 200
# kernel name mark -> code order (the plain order has none)
ORDERS = {mark or None: order for order, mark in ORDER_MARKS.items()}
KERNEL = re.compile(r"integer_dot_gemv_int(\d+)_g(\d+)_(sym|asym)_(float\d+)_a(\d+)_([a-z0-9]+?)"
                    f"({'|'.join(sorted(filter(None, ORDERS), key=len, reverse=True))})?" r"_n(\d+)_k(\d+)")
DOTS = ("sdot", "udot", "usdot")
BRANCH = re.compile(r"^(b|b\.\w+|cbz|cbnz|tbz|tbnz)$")
# llama.cpp's dot product per block format (its activations: Q8_0 blocks, or Q8_1 with the block sum for Q4_1),
# and bytes per weight of the format: codes + fp16 scale (+ fp16 min) per 32 weights
LLAMA_KERNELS = {"Q4_0": "ggml_vec_dot_q4_0_q8_0", "Q4_1": "ggml_vec_dot_q4_1_q8_1", "Q8_0": "ggml_vec_dot_q8_0_q8_0"}
# clang-15 knows no Cortex-A715/X3: its predecessor A710 has the same instructions the kernels use
CLANG_CPU = {"cortex-a715": "cortex-a710", "cortex-x3": "cortex-x2"}


@dataclasses.dataclass
class Loop:
    body: list[str]  # instructions, llvm-mc syntax, the backward branch last
    dots: int

    def mca(self, cpu: str) -> float:
        """Cycles per iteration in steady state."""
        text = "\n".join(self.body) + "\n"
        out = subprocess.run([MCA, "-mtriple=aarch64", f"-mcpu={cpu}", "-mattr=+dotprod,+i8mm,+fullfp16",
                              f"-iterations={ITERATIONS}"], input=text, capture_output=True, text=True, check=True)
        return int(re.search(r"Total Cycles:\s+(\d+)", out.stdout).group(1)) / ITERATIONS


@dataclasses.dataclass
class Figures:
    cycles: float  # per 32 weights
    instructions: float  # per 32 weights
    row_cycles: float | None = None  # per 32 weights over whole rows (last step, epilogue)


def _mnemonic(line: str) -> str:
    return line.split(None, 1)[0] if line else ""


def _loops(ops: list[tuple[str | None, str]]) -> list[tuple[int, int]]:
    """(first, last) indices of the loops of a function: `ops` is (label or None, instruction) in order; a loop is a
    backward branch to a label and what lies between."""
    where = {label: i for i, (label, _) in enumerate(ops) if label}
    found = []
    for i, (_, text) in enumerate(ops):
        if not text or not BRANCH.match(_mnemonic(text)):
            continue
        target = text.split()[-1] if "<" not in text else text.split()[1]
        if target in where and where[target] <= i:
            found.append((where[target], i))
    return found


def _clean(ops, first, last) -> list[str]:
    """The instructions of ops[first..last] for llvm-mca: branch targets become one local label."""
    body = []
    for _, text in ops[first:last + 1]:
        if not text:
            continue
        if BRANCH.match(_mnemonic(text)):
            fields = re.split(r"\s+", text.split("<")[0].strip())
            text = " ".join(fields[:-1]).rstrip(",") + (", " if len(fields) > 2 else " ") + ".Lloop"
        body.append(text)
    return [".Lloop:"] + body


def _hot_loops(ops) -> tuple[Loop, Loop | None] | None:
    """The innermost loop with the most dot products, and the loop around it (whole rows), as Loops."""
    loops = _loops(ops)
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]

    def dots(lp):
        return sum(1 for _, t in ops[lp[0]:lp[1] + 1] if t and _mnemonic(t) in DOTS)

    inner = [lp for lp in inner if dots(lp) > 0]
    if not inner:
        return None
    hot = max(inner, key=dots)
    outer = [lp for lp in loops if lp != hot and lp[0] <= hot[0] and hot[1] <= lp[1]]
    parent = min(outer, key=lambda lp: lp[1] - lp[0]) if outer else None
    hot_loop = Loop(_clean(ops, *hot), dots(hot))
    if parent is None:
        return hot_loop, None
    rest = ops[parent[0]:hot[0]] + ops[hot[1] + 1:parent[1] + 1]
    rest_loop = Loop(_clean(rest, 0, len(rest) - 1), sum(1 for _, t in rest if t and _mnemonic(t) in DOTS))
    return hot_loop, rest_loop


def _essential_loop(bits: int, act_bits: int, row_pairs: bool) -> Loop:
    """4 blocks of 32 weights with only what every int8-dot GEMV must issue: the code loads (load pipes), the 4-bit
    nibble split and the dot products, into 8 accumulators so that no dependency chain sets the pace. Rows in pairs
    (neon_pairs): 2 blocks of 2 rows, 16 bytes holding 16 codes of each row: the bytes and their low nibbles."""
    body = [".Lloop:"]
    dots = 0
    for block in range(4):
        vectors = []
        if row_pairs:
            body += [f"ldr q{block}, [x0, #{block * 16}]", f"and v{4 + 2 * block}.16b, v{block}.16b, v31.16b"]
            vectors = [block, 4 + 2 * block]
        elif bits == 4:
            body += [f"ldr q{block}, [x0, #{block * 16}]", f"and v{4 + 2 * block}.16b, v{block}.16b, v31.16b",
                     f"ushr v{5 + 2 * block}.16b, v{block}.16b, #4"]
            vectors = [4 + 2 * block, 5 + 2 * block]
        else:
            body += [f"ldp q{2 * block}, q{2 * block + 1}, [x0, #{block * 32}]"]
            vectors = [2 * block, 2 * block + 1]
        for plane in range(act_bits // 8):
            for i, v in enumerate(vectors):
                body.append(f"sdot v{16 + (2 * block + i) % 8}.4s, v{v}.16b, v{24 + plane}.16b")
                dots += 1
    body += [f"add x0, x0, #{4 * bits * 4}", "subs x1, x1, #1", "b.ne .Lloop"]
    return Loop(body, dots)


def _asm_functions(asm: str) -> dict[str, list[tuple[str | None, str]]]:
    """Assembler text -> function name -> ops (TVM's parallel bodies are local `.L__tvm_parallel_lambda*`)."""
    funcs: dict[str, list] = {}
    ops = None
    for raw in asm.splitlines():
        line = raw.split("//")[0].rstrip()
        label = re.match(r"^([\w.$]+):", line)
        if label:
            name = label.group(1)
            if not name.startswith(".L") or name.startswith(".L__tvm_parallel_lambda"):
                ops = funcs.setdefault(name, [])
            elif ops is not None:
                ops.append((name, ""))
            continue
        text = line.strip()
        if ops is not None and text and not text.startswith("."):
            ops.append((None, re.sub(r"\s+", " ", text)))
    return funcs


def _objdump_functions(path: Path) -> dict[str, list[tuple[str | None, str]]]:
    """A library or object, disassembled: symbol -> ops, each address a label (code after a symbol that no other
    symbol names, such as TVM's parallel bodies, stays with it)."""
    out = subprocess.run([OBJDUMP, "-d", "--no-show-raw-insn", "--mattr=+dotprod,+i8mm,+fullfp16", str(path)],
                         capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list] = {}
    ops = None
    for line in out.splitlines():
        head = re.match(r"^[0-9a-f]+ <([^>]+)>:", line)
        if head:
            ops = funcs.setdefault(head.group(1), [])
            continue
        insn = re.match(r"^\s+([0-9a-f]+):\s+(\S.*)$", line)
        if insn and ops is not None:
            text = re.sub(r"\s+", " ", insn.group(2).split("//")[0].strip())
            branch = re.match(r"^(b|b\.\w+|cbz|cbnz|tbz|tbnz) (?:(.*), )?(?:0x)?([0-9a-f]+)(?: <.*>)?$", text)
            if branch and BRANCH.match(branch.group(1)):
                text = " ".join(p for p in (branch.group(1), (branch.group(2) or "") + ",") if p.strip(",")) + \
                    f" {int(branch.group(3), 16):x}"
                text = text.replace(" ,", "")
            ops.append((f"{int(insn.group(1), 16):x}", text))
    return funcs


def _library_functions(artifact: Path, library: str) -> dict[str, list]:
    path = artifact / library
    if path.suffix == ".tar":  # android without the NDK: objects
        funcs = {}
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
            for obj in Path(tmp).rglob("*.o"):
                funcs.update(_objdump_functions(obj))
        return funcs
    return _objdump_functions(path)


def _figures(loops: tuple[Loop, Loop | None], weights_per_dot: int, row_weights: int | None) -> dict[str, Figures]:
    hot, rest = loops
    weights = hot.dots * weights_per_dot
    figures = {}
    for cpu in CORE_MODELS:
        cycles = hot.mca(cpu)
        row = None
        if rest is not None and row_weights:
            trips = (row_weights // weights_per_dot - rest.dots) / hot.dots
            row = (trips * cycles + rest.mca(cpu)) * 32 / row_weights
        figures[cpu] = Figures(cycles * 32 / weights, (len(hot.body) - 1) * 32 / weights, row)
    return figures


def _format(bits: int, symmetric: bool, group: int) -> str:
    if bits == 8:
        return "Q8_0" if group == 32 else f"int8 g{group}"
    return ("Q4_0" if symmetric else "Q4_1") if group == 32 else f"int4 g{group}"


def _bytes_per_weight(bits: int, symmetric: bool, group: int, scale_bytes: int = 2) -> float:
    return bits / 8 + scale_bytes * (1 if symmetric else 2) / group


def _llama_loops(ggml: Path, cpu: str, work: Path) -> dict[str, tuple[Loop, Loop | None]]:
    """llama.cpp's ARM quants.c compiled by clang-15 for `cpu` (NEON: +nosve); its dot products' hot loops."""
    asm = work / f"quants-{cpu}.s"
    if not asm.exists():
        subprocess.run([CLANG, "--target=aarch64-linux-gnu", f"-mcpu={CLANG_CPU.get(cpu, cpu)}+nosve", "-O3", "-S",
                        "-I", "include", "-I", "src", "-I", "src/ggml-cpu", "src/ggml-cpu/arch/arm/quants.c",
                        "-o", str(asm)], cwd=ggml, check=True, capture_output=True, text=True)
    funcs = _asm_functions(asm.read_text())
    return {fmt: _hot_loops(funcs[name]) for fmt, name in LLAMA_KERNELS.items()}


def modelled_target(target_json: dict, cpu: str) -> tvm.target.Target:
    """The target's features for `cpu`, a modelled core, without SVE: -mcpu=cortex-a510 (the A55 model) implies SVE2,
    which neither the A55 nor the phones' NEON builds use (LLVM's vector copies became SVE `mov z`, which llvm-mca's
    A55 model rejects)."""
    mattr = [f for f in target_json.get("mattr", []) if f.lstrip("+-") not in ("sve", "sve2")]
    return tvm.target.Target({**target_json, "mcpu": cpu, "mattr": [*mattr, "-sve", "-sve2"]})


def _rebuilt_loops(shape: GemvShape, target_json: dict, cpu: str) -> tuple[Loop, Loop | None]:
    """The GEMV built by TVM for `cpu` (the modelled core) with the target's features."""
    target = modelled_target(target_json, cpu)
    mod = tvm.IRModule({"gemv": gemv(shape, (1, 1, shape.n)).with_attr("global_symbol", "gemv")})
    funcs = _asm_functions(tvm.tirx.build(mod, target=target).inspect_source("asm"))
    return next(loops for name, ops in funcs.items() if "lambda" in name and (loops := _hot_loops(ops)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, action="append", help="a linux-arm64 / android-arm64 artifact")
    parser.add_argument("--llama-cpp", required=True, type=Path,
                        help="llama.cpp's ggml directory (vendor/llama.cpp/ggml of the llama-cpp-python sdist)")
    args = parser.parse_args()
    for tool in (MCA, OBJDUMP, CLANG):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (Debian: apt-get install llvm-15 clang-15)")
    if not (args.llama_cpp / "src/ggml-cpu/arch/arm/quants.c").is_file():
        parser.error(f"no src/ggml-cpu/arch/arm/quants.c under {args.llama_cpp}; see the download lines in --help")
    work = Path(tempfile.mkdtemp(prefix="arm-gemv-mca-"))
    try:
        for artifact in map(Path, args.artifact):
            report(artifact, args.llama_cpp, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(artifact: Path, ggml: Path, work: Path) -> None:
    art = load_artifact(artifact)
    config = art.config
    spec = load_target(config["target"]["name"])
    target_json = dict(config["target"]["tvm_target"])
    cores = spec.device.get("cpu", {})
    model = config["model"]["config"]
    funcs = _library_functions(artifact, config["library"])
    kernels = sorted({m.group(0) for name in funcs for m in [KERNEL.search(name)] if m})
    if not kernels:
        print(f"{artifact}: no integer decode GEMVs in {config['library']} (a target without dot products?)")
        return
    target_cpu = target_json.get("mcpu", "generic")
    print(f"\n{artifact} ({spec.name}, -mcpu={target_cpu}, decode activations {config.get('decode_activations')})")
    print(f"big core {cores.get('big', '?')} at {cores.get('big_ghz', '?')} GHz (x{cores.get('big_count', '?')}; "
          f"llvm-mca -mcpu=neoverse-n2), little core {cores.get('little', '?')} at {cores.get('little_ghz', '?')} GHz "
          f"(x{cores.get('little_count', '?')}; -mcpu=cortex-a510, the A55 model); "
          f"{spec.device['memory_bandwidth_gbs']} GB/s")
    llama = {cpu: _llama_loops(ggml, cpu, work) for cpu in {target_cpu, *CORE_MODELS}}
    llama_figures = {(built, fmt): _figures(loops, 16, None) for built, table in llama.items()
                     for fmt, loops in table.items()}
    rows, token = [], {cpu: {"ours": 0.0, "llama": 0.0, "bound": 0.0} for cpu in CORE_MODELS}
    weight_bytes = 0.0
    llama_cpu = CLANG_CPU.get(target_cpu, target_cpu)
    header = (f"{'GEMV (calls/token)':<50} {'format':<6} {'B/w':>6} {'core model':<11} | {'mobilec':>7} {'(row)':>6} "
              f"{'ins':>5} {'llama':>6} {'ins':>5} {'ratio':>5} | {'mobilec':>7} {'llama':>6} {'ratio':>5}")
    print(f"cycles and instructions per 32 weights; left: built for -mcpu={target_cpu} (mobilec: the library's "
          f"own loop; llama.cpp: -mcpu={llama_cpu}), right: both built for the modelled core")
    print(header)
    print("-" * len(header))
    bounds = {}  # (bits, activation bits) -> core model -> cycles per 32 weights of the essential loop
    for name in kernels:
        bits, group, kind, scale, act, family, order, n, k = KERNEL.fullmatch(name).groups()
        bits, group, act, n, k = int(bits), int(group), int(act), int(n), int(k)
        shape = GemvShape(n, k, bits, group, kind == "sym", scale, act, family, code_order=ORDERS[order])
        fmt = _format(bits, shape.symmetric, group)
        llama_fmt = fmt if fmt in LLAMA_KERNELS else ("Q8_0" if bits == 8 else "Q4_0" if shape.symmetric else "Q4_1")
        calls = 1 if n == int(model.get("vocab_size", -1)) else int(model.get("num_hidden_layers", 1))
        bpw = _bytes_per_weight(bits, shape.symmetric, group, 2 if scale == "float16" else 4)
        weight_bytes += calls * n * k * bpw
        if (bits, act, shape.row_pairs) not in bounds:
            essential = _essential_loop(bits, act, shape.row_pairs)
            bounds[bits, act, shape.row_pairs] = {cpu: essential.mca(cpu) / 4 for cpu in CORE_MODELS}
        per_dot = 16 if act == 8 else 8  # int16 activations: two int8 planes, two dot products per 16 codes
        row_weights = k * shape.rows_together
        library = next(loops for sym, ops in funcs.items() if name in sym and "compute" in sym
                       and (loops := _hot_loops(ops)))
        ours = {"lib": _figures(library, per_dot, row_weights)}
        for cpu in CORE_MODELS:
            ours[cpu] = _figures(_rebuilt_loops(shape, target_json, cpu), per_dot, row_weights)
        for model_cpu in CORE_MODELS:
            lib, lib_llama = ours["lib"][model_cpu], llama_figures[target_cpu, llama_fmt][model_cpu]
            own, own_llama = ours[model_cpu][model_cpu], llama_figures[model_cpu, llama_fmt][model_cpu]
            row = lib.row_cycles if lib.row_cycles is not None else lib.cycles
            label = f"{name.removeprefix('integer_dot_gemv_')} ({calls})"
            print(f"{label:<50} {fmt:<6} {bpw:>6.4f} {model_cpu:<11} | {lib.cycles:>7.2f} {row:>6.2f} "
                  f"{lib.instructions:>5.1f} {lib_llama.cycles:>6.2f} {lib_llama.instructions:>5.1f} "
                  f"{lib.cycles / lib_llama.cycles:>5.2f} | {own.cycles:>7.2f} {own_llama.cycles:>6.2f} "
                  f"{own.cycles / own_llama.cycles:>5.2f}")
            rows.append((fmt, model_cpu, f"-mcpu={target_cpu}", lib.cycles / lib_llama.cycles))
            rows.append((fmt, model_cpu, f"-mcpu={model_cpu}", own.cycles / own_llama.cycles))
            token[model_cpu]["ours"] += calls * n * k / 32 * row
            token[model_cpu]["llama"] += calls * n * k / 32 * lib_llama.cycles
            token[model_cpu]["bound"] += calls * n * k / 32 * bounds[bits, act, shape.row_pairs][model_cpu]
    floor_ms = weight_bytes / (spec.device["memory_bandwidth_gbs"] * 1e9) * 1e3
    print(f"\none decode token: {weight_bytes / 1e6:.1f} MB of GEMV weights, bandwidth floor {floor_ms:.2f} ms "
          f"at {spec.device['memory_bandwidth_gbs']} GB/s")
    for model_cpu, kind in CORE_MODELS.items():
        ghz, count = float(cores.get(f"{kind}_ghz", 2.0)), int(cores.get(f"{kind}_count", 1))
        for who in ("ours", "llama", "bound"):
            ms = token[model_cpu][who] / (ghz * 1e9) * 1e3
            label = {"ours": "mobilec", "llama": "llama.cpp", "bound": "bound"}[who]
            print(f"  {label:<9} GEMV compute on {model_cpu} ({cores.get(kind, kind)} at {ghz} GHz): {ms:.2f} ms "
                  f"on 1 core, {ms / count:.2f} ms on {count} = {ms / count / floor_ms:.0%} of the floor")
    print("  (bound: the code loads, 4-bit nibble splits and dot products alone: no scales, conversions or sums)")
    worst = max(rows, key=lambda r: r[3])
    print(f"worst ratio to llama.cpp (steady-state loop): {worst[3]:.2f} ({worst[0]} on the {worst[1]} model, "
          f"both built with {worst[2]})")


if __name__ == "__main__":
    sys.exit(main())
