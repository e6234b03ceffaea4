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
`ggml-cpu/arch/arm/quants.c` (nothing of it is kept) for the target's CPU and for the modelled core, by the clang of
the llvm-mca that models it. The core models (LLVM15, LLVM19): llvm-mca-15's Neoverse-N2 (`n2`, the big core) and
its in-order Cortex-A55 (`a55`, the little core: also llvm-15's model for -mcpu=cortex-a510, which it does not know
otherwise; code for it is built for -mcpu=cortex-a55, as TVM's LLVM 22 would schedule cortex-a510 code for the A510
itself); llvm-14 would fall back to the Cortex-A57 model for both. Where Debian's llvm-19 and clang-19 are installed
(`apt-get install llvm-19 clang-19`), also llvm-19's own Cortex-A510 model (`a510`) and its Neoverse-V2 (`x3~v2`:
the server core derived from the Cortex-X3, four vector pipes to the N2's two), for the loops alone.

Printed per format and core model: cycles and instructions per 32 weights of the steady-state loop (ours also per
whole row: its shorter last step and the row's epilogue included), bytes per weight, the ratio to llama.cpp; then
one SmolLM2 decode token's modelled GEMV compute time (every call of every GEMV, at the clock the target file
gives for that core, on its core count: the decode threads split the rows evenly, so a faster core among them
waits for the others) against the bandwidth floor (weight bytes / memory_bandwidth_gbs). Activation quantization
(ours and llama.cpp's quantize_row_q8_*) and attention are left out of both. Last, the same token's bound: only the
instructions no int8-dot GEMV can do without (per 32 weights: the dot products, 2 for int8 activations, 4 for int16
ones as two planes, and for 4-bit codes the nibble split: an AND and a shift per 16 bytes of a row, or an AND per 16
bytes of a pair of rows in the neon_pairs order, which the library's kernels read), modelled by llvm-mca as one loop
(`_essential_loop`) on the same cores; what a kernel spends above it goes to scales, conversions and loads. And the
bound with the least float work any such GEMV adds ("+ floats"; fp16 weight scales, a float scale per 32
activations): per 4 blocks of a row, an accumulator zeroed, one int -> float conversion, the 4 scales widened, a
multiply by the activation scales and an FMA into the row's sum, asymmetric codes' mins as one fp16 `fmlal`. Where
the "+ floats" figure is above a goal, no kernel of that form reaches it on that core model.
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

from compiler.artifacts.artifact import load_artifact
from compiler.kernels.integer_dot_gemv import GemvShape, gemv
from compiler.quantization.group import ORDER_MARKS
from compiler.target.targets import load_target

OBJDUMP = "llvm-objdump-15"


@dataclasses.dataclass(frozen=True)
class CoreModel:
    """A core as one LLVM release's llvm-mca models it, with that release's clang to build llama.cpp for it."""

    label: str
    mca: str
    mcpu: str  # llvm-mca's -mcpu, and TVM's and clang's to build for the modelled core
    kind: str | None  # the target file's core kind ([device.cpu] big / little) it stands for; None: loops only
    clang: str
    only: str | None = None  # stands for that kind only where the target file names this core

    def stands_for(self, cores: dict) -> bool:
        return self.kind is not None and self.only in (None, cores.get(self.kind))

    @property
    def clangxx(self) -> str:
        return self.clang.replace("clang", "clang++")

    def clang_cpu(self, cpu: str) -> str:
        """clang-15 knows no Cortex-A715/X3: its predecessors have the same instructions the kernels use."""
        renamed = {"cortex-a715": "cortex-a710", "cortex-x3": "cortex-x2"} if self.clang == "clang-15" else {}
        return renamed.get(cpu, cpu)

    def tools(self) -> tuple[str, ...]:
        return self.mca, self.clang, self.clangxx


LLVM15 = (CoreModel("n2", "llvm-mca-15", "neoverse-n2", "big", "clang-15"),
          CoreModel("a55", "llvm-mca-15", "cortex-a55", "little", "clang-15"))
LLVM19 = (CoreModel("a510", "llvm-mca-19", "cortex-a510", "little", "clang-19", only="Cortex-A510"),
          CoreModel("x3~v2", "llvm-mca-19", "neoverse-v2", None, "clang-19"))


def core_models() -> tuple[CoreModel, ...]:
    """llvm-15's models (required), and llvm-19's where its llvm-mca and clang are installed."""
    return LLVM15 + (LLVM19 if all(shutil.which(tool) for model in LLVM19 for tool in model.tools()) else ())


def missing_tools() -> list[str]:
    return [tool for tool in (OBJDUMP, *dict.fromkeys(t for model in LLVM15 for t in model.tools()))
            if not shutil.which(tool)]


ITERATIONS = 200
# kernel name mark -> code order (the plain order has none)
ORDERS = {mark or None: order for order, mark in ORDER_MARKS.items()}
KERNEL = re.compile(r"integer_dot_gemv_int(\d+)_g(\d+)_(sym|asym)_(float\d+)_a(\d+)_([a-z0-9]+?)"
                    f"({'|'.join(sorted(filter(None, ORDERS), key=len, reverse=True))})?" r"_n(\d+)_k(\d+)")
DOTS = ("sdot", "udot", "usdot")
BRANCH = re.compile(r"^(b|b\.\w+|cbz|cbnz|tbz|tbnz)$")
# llama.cpp's dot product per block format (its activations: Q8_0 blocks, or Q8_1 with the block sum for Q4_1)
LLAMA_KERNELS = {"Q4_0": "ggml_vec_dot_q4_0_q8_0", "Q4_1": "ggml_vec_dot_q4_1_q8_1", "Q8_0": "ggml_vec_dot_q8_0_q8_0"}


@dataclasses.dataclass
class Loop:
    body: list[str]  # instructions, llvm-mc syntax, the backward branch last
    dots: int

    def mca(self, model: CoreModel) -> float:
        """Cycles per iteration in steady state."""
        text = "\n".join(self.body) + "\n"
        out = subprocess.run([model.mca, "-mtriple=aarch64", f"-mcpu={model.mcpu}",
                              "-mattr=+dotprod,+i8mm,+fullfp16,+fp16fml", f"-iterations={ITERATIONS}"],
                             input=text, capture_output=True, text=True, check=True)
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


def _essential_loop(bits: int, act_bits: int, row_pairs: bool, symmetric: bool | None = None) -> Loop:
    """4 blocks of 32 weights with only what every int8-dot GEMV must issue: the code loads (load pipes), the 4-bit
    nibble split and the dot products, into 8 accumulators so that no dependency chain sets the pace. Rows in pairs
    (neon_pairs): 2 blocks of 2 rows, 16 bytes holding 16 codes of each row: the bytes and their low nibbles.

    With `symmetric` given, 8 blocks (two rounds of the above), each 4 with the least float work a GEMV with fp16
    weight scales and a float scale per 32 activations must add (the blocks' int32 sums in the lanes of one vector):
    zero that accumulator, convert it to float, widen the 4 weight scales, multiply by the activation scales and add
    into the row's sum; asymmetric codes also add the mins' term, taken here in its cheapest form (one fp16 x fp16
    -> fp32 `fmlal` of the mins and fp16 activation sums); rows in pairs also separate the second row's sum (a `sub`
    per pair and 4 blocks). A round's float work is spread over the other round's dot products, as a scheduler for
    an in-order core would place it."""
    rounds = 1 if symmetric is None else 2
    dots, code, floats = 0, [], []
    for r in range(rounds):
        code.append([])
        for block in range(4):
            at = r * 4 + block
            if row_pairs:
                code[r] += [f"ldr q{block}, [x0, #{at * 16}]", f"and v{4 + 2 * block}.16b, v{block}.16b, v31.16b"]
                vectors = [block, 4 + 2 * block]
            elif bits == 4:
                code[r] += [f"ldr q{block}, [x0, #{at * 16}]", f"and v{4 + 2 * block}.16b, v{block}.16b, v31.16b",
                            f"ushr v{5 + 2 * block}.16b, v{block}.16b, #4"]
                vectors = [4 + 2 * block, 5 + 2 * block]
            else:
                code[r] += [f"ldp q{2 * block}, q{2 * block + 1}, [x0, #{at * 32}]"]
                vectors = [2 * block, 2 * block + 1]
            for plane in range(act_bits // 8):
                for i, v in enumerate(vectors):
                    code[r].append(f"sdot v{16 + (2 * block + i) % 8}.4s, v{v}.16b, v{24 + plane}.16b")
                    dots += 1
        if symmetric is not None:
            floats.append(["movi v12.2d, #0000000000000000", f"ldr d13, [x2, #{r * 8}]", "fcvtl v13.4s, v13.4h",
                           f"scvtf v14.4s, v{16 + 4 * r}.4s", f"ldr q15, [x3, #{r * 16}]",
                           "fmul v14.4s, v14.4s, v15.4s", f"fmla v{26 + r}.4s, v13.4s, v14.4s"])
            if not symmetric:
                floats[r] += [f"ldr d29, [x4, #{r * 8}]", f"ldr d30, [x5, #{r * 8}]",
                              f"fmlal v{26 + r}.4s, v29.4h, v30.4h"]
            if row_pairs and r == 0:
                floats[r].append("sub v28.4s, v20.4s, v21.4s")
    body = [".Lloop:"]
    for r in range(rounds):
        extra = floats[(r + 1) % rounds] if floats else []
        for i, text in enumerate(code[r]):  # extra[j] after code[r][(j + 1) * len(code[r]) // len(extra) - 1]
            body.append(text)
            body += [f for j, f in enumerate(extra) if (j + 1) * len(code[r]) // len(extra) - 1 == i]
    body += [f"add x0, x0, #{rounds * 4 * bits * 4}", "subs x1, x1, #1", "b.ne .Lloop"]
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


def _figures(loops: tuple[Loop, Loop | None], weights_per_dot: int, row_weights: int | None,
             model: CoreModel) -> Figures:
    hot, rest = loops
    weights = hot.dots * weights_per_dot
    cycles = hot.mca(model)
    row = None
    if rest is not None and row_weights:
        trips = (row_weights // weights_per_dot - rest.dots) / hot.dots
        row = (trips * cycles + rest.mca(model)) * 32 / row_weights
    return Figures(cycles * 32 / weights, (len(hot.body) - 1) * 32 / weights, row)


def _format(bits: int, symmetric: bool, group: int) -> str:
    if bits == 8:
        return "Q8_0" if group == 32 else f"int8 g{group}"
    return ("Q4_0" if symmetric else "Q4_1") if group == 32 else f"int4 g{group}"


def _bytes_per_weight(bits: int, symmetric: bool, group: int, scale_bytes: int = 2) -> float:
    return bits / 8 + scale_bytes * (1 if symmetric else 2) / group


def _llama_loops(ggml: Path, model: CoreModel, cpu: str, work: Path) -> dict[str, tuple[Loop, Loop | None]]:
    """llama.cpp's ARM quants.c compiled by the model's clang for `cpu` (NEON: +nosve); its dot products' hot
    loops."""
    asm = work / f"quants-{model.clang}-{cpu}.s"
    if not asm.exists():
        subprocess.run([model.clang, "--target=aarch64-linux-gnu", f"-mcpu={model.clang_cpu(cpu)}+nosve", "-O3", "-S",
                        "-I", "include", "-I", "src", "-I", "src/ggml-cpu", "src/ggml-cpu/arch/arm/quants.c",
                        "-o", str(asm)], cwd=ggml, check=True, capture_output=True, text=True)
    funcs = _asm_functions(asm.read_text())
    return {fmt: _hot_loops(funcs[name]) for fmt, name in LLAMA_KERNELS.items()}


def modelled_target(target_json: dict, cpu: str) -> tvm.target.Target:
    """The target's features for `cpu`, a modelled core, without SVE: -mcpu=cortex-a510 and neoverse-v2 imply SVE2,
    which the phones' NEON builds do not use (LLVM's vector copies became SVE `mov z`, which llvm-mca-15's A55 model
    rejects)."""
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
    for tool in missing_tools():
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
    models = core_models()
    target_cpu = target_json.get("mcpu", "generic")
    print(f"\n{artifact} ({spec.name}, -mcpu={target_cpu}, decode activations {config.get('decode_activations')}); "
          f"{spec.device['memory_bandwidth_gbs']} GB/s")
    for m in models:
        kind = (f"{m.kind} core {cores.get(m.kind, '?')} at {cores.get(m.kind + '_ghz', '?')} GHz "
                f"x{cores.get(m.kind + '_count', '?')}" if m.stands_for(cores) else "loops only")
        print(f"  core model {m.label:<6} {m.mca} -mcpu={m.mcpu} (llama.cpp: {m.clang}): {kind}")
    # llama.cpp's loop per format, built for the target's CPU and for the modelled core: modelled once per artifact
    llama = {(m, cpu, fmt): _figures(loops, 16, None, m) for m in models for cpu in (target_cpu, m.mcpu)
             for fmt, loops in _llama_loops(ggml, m, cpu, work).items()}
    rows, token = [], {m: {"ours": 0.0, "llama": 0.0, "bound": 0.0, "float": 0.0} for m in models}
    weight_bytes = 0.0
    header = (f"{'GEMV (calls/token)':<50} {'format':<6} {'B/w':>6} {'model':<6} | {'mobilec':>7} {'(row)':>6} "
              f"{'ins':>5} {'llama':>6} {'ins':>5} {'ratio':>5} | {'mobilec':>7} {'llama':>6} {'ratio':>5}")
    print(f"cycles and instructions per 32 weights; left: built for -mcpu={target_cpu} (mobilec: the library's "
          f"own loop; llama.cpp: by the model's clang), right: both built for the modelled core")
    print(header)
    print("-" * len(header))
    # (bits, activation bits, rows in pairs, symmetric) -> core model -> cycles per 32 weights of the essential loop,
    # without and with the least float work
    bounds = {}
    for name in kernels:
        bits, group, kind, scale, act, family, order, n, k = KERNEL.fullmatch(name).groups()
        bits, group, act, n, k = int(bits), int(group), int(act), int(n), int(k)
        shape = GemvShape(n, k, bits, group, kind == "sym", scale, act, family, code_order=ORDERS[order])
        fmt = _format(bits, shape.symmetric, group)
        llama_fmt = fmt if fmt in LLAMA_KERNELS else ("Q8_0" if bits == 8 else "Q4_0" if shape.symmetric else "Q4_1")
        calls = 1 if n == int(model.get("vocab_size", -1)) else int(model.get("num_hidden_layers", 1))
        bpw = _bytes_per_weight(bits, shape.symmetric, group, 2 if scale == "float16" else 4)
        weight_bytes += calls * n * k * bpw
        bound_key = (bits, act, shape.row_pairs, shape.symmetric)
        if bound_key not in bounds:
            essential = _essential_loop(bits, act, shape.row_pairs)
            scaled = _essential_loop(bits, act, shape.row_pairs, shape.symmetric)
            bounds[bound_key] = {m: (essential.mca(m) / 4, scaled.mca(m) / 8) for m in models}
        per_dot = 16 if act == 8 else 8  # int16 activations: two int8 planes, two dot products per 16 codes
        row_weights = k * shape.rows_together
        library = next(loops for sym, ops in funcs.items() if name in sym and "compute" in sym
                       and (loops := _hot_loops(ops)))
        rebuilt = {cpu: _rebuilt_loops(shape, target_json, cpu) for cpu in {m.mcpu for m in models}}
        for m in models:
            lib = _figures(library, per_dot, row_weights, m)
            lib_llama = llama[m, target_cpu, llama_fmt]
            own = _figures(rebuilt[m.mcpu], per_dot, row_weights, m)
            own_llama = llama[m, m.mcpu, llama_fmt]
            row = lib.row_cycles if lib.row_cycles is not None else lib.cycles
            label = f"{name.removeprefix('integer_dot_gemv_')} ({calls})"
            print(f"{label:<50} {fmt:<6} {bpw:>6.4f} {m.label:<6} | {lib.cycles:>7.2f} {row:>6.2f} "
                  f"{lib.instructions:>5.1f} {lib_llama.cycles:>6.2f} {lib_llama.instructions:>5.1f} "
                  f"{lib.cycles / lib_llama.cycles:>5.2f} | {own.cycles:>7.2f} {own_llama.cycles:>6.2f} "
                  f"{own.cycles / own_llama.cycles:>5.2f}")
            rows.append((fmt, m.label, f"-mcpu={target_cpu}", lib.cycles / lib_llama.cycles))
            rows.append((fmt, m.label, f"-mcpu={m.mcpu}", own.cycles / own_llama.cycles))
            token[m]["ours"] += calls * n * k / 32 * row
            token[m]["llama"] += calls * n * k / 32 * lib_llama.cycles
            token[m]["bound"] += calls * n * k / 32 * bounds[bound_key][m][0]
            token[m]["float"] += calls * n * k / 32 * bounds[bound_key][m][1]
    floor_ms = weight_bytes / (spec.device["memory_bandwidth_gbs"] * 1e9) * 1e3
    print(f"\none decode token: {weight_bytes / 1e6:.1f} MB of GEMV weights, bandwidth floor {floor_ms:.2f} ms "
          f"at {spec.device['memory_bandwidth_gbs']} GB/s")
    for m in (m for m in models if m.stands_for(cores)):
        ghz, count = float(cores.get(f"{m.kind}_ghz", 2.0)), int(cores.get(f"{m.kind}_count", 1))
        for who in ("ours", "llama", "bound", "float"):
            ms = token[m][who] / (ghz * 1e9) * 1e3
            label = {"ours": "mobilec", "llama": "llama.cpp", "bound": "bound", "float": "+ floats"}[who]
            print(f"  {label:<9} GEMV compute on {m.label} ({cores.get(m.kind, m.kind)} at {ghz} GHz): {ms:.2f} ms "
                  f"on 1 core, {ms / count:.2f} ms on {count} = {ms / count / floor_ms:.0%} of the floor")
    print("  (bound: the code loads, 4-bit nibble splits and dot products alone: no scales, conversions or sums;\n"
          "   + floats: the bound with the least float work per 4 blocks of a row: zeroing, int -> float, the fp16\n"
          "   scales widened, activation scale and sum; the mins' term as one fmlal. Both are loops of our writing:\n"
          "   on the in-order models their schedule, not only their instructions, sets the figure)")
    for label in dict.fromkeys(m.mca for m in models):
        worst = max((r for r in rows if any(m.label == r[1] and m.mca == label for m in models)), key=lambda r: r[3])
        print(f"worst ratio to llama.cpp on {label}'s models (steady-state loop): {worst[3]:.2f} ({worst[0]} on the "
              f"{worst[1]} model, both built with {worst[2]})")

if __name__ == "__main__":
    sys.exit(main())
