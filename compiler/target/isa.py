"""One description of a CPU's instruction set, derived from a TVM target once per compile (build_plan.py), which
hands it to every CPU schedule rule and kernel: vector width, float lanes, vector registers, the integer dot-product
family, and the features an artifact records so that a CPU without them refuses it instead of dying on an illegal
instruction."""

from __future__ import annotations

import dataclasses

import tvm
from tvm.target import Target
from tvm.target.codegen import llvm_get_cpu_features

# Instruction-set features whose absence makes code fault (SIGILL), by LLVM name, with the flag Linux lists in
# /proc/cpuinfo for each. An artifact records those of them its target enables; the running CPU must have all.
X86_FEATURE_FLAGS = {
    "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "popcnt": "popcnt",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2",
    "lzcnt": "abm", "movbe": "movbe", "adx": "adx", "aes": "aes", "pclmul": "pclmulqdq", "sha": "sha_ni",
    "vaes": "vaes", "vpclmulqdq": "vpclmulqdq", "gfni": "gfni", "avxvnni": "avx_vnni",
    "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512cd": "avx512cd", "avx512dq": "avx512dq",
    "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
    "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2", "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512ifma": "avx512ifma", "avx512fp16": "avx512_fp16",
}
AARCH64_FEATURE_FLAGS = {
    "neon": "asimd", "dotprod": "asimddp", "i8mm": "i8mm", "fullfp16": "asimdhp", "bf16": "bf16",
    "sve": "sve", "sve2": "sve2", "rdm": "asimdrdm", "lse": "atomics", "aes": "aes", "sha2": "sha2",
    "crc": "crc32",
}

# Integer dot-product families, best first per architecture, with the features each needs. The decode GEMV and
# the prefill GEMM pick their kernel variant by this name.
INT_DOT_FAMILIES = {
    "x86_64": [
        ("avx512vnni", ("avx512bw", "avx512vl", "avx512vnni")),  # vpdpbusd (int8), vpmaddwd zmm (int16)
        ("avx512bw", ("avx512bw",)),  # vpmaddwd zmm, vpmaddubsw
        ("avxvnni", ("avx2", "avxvnni")),  # vpdpbusd ymm (VEX), vpmaddwd ymm
        ("avx2", ("avx2",)),  # vpmaddubsw + vpmaddwd ymm
    ],
    "aarch64": [
        ("i8mm", ("neon", "dotprod", "i8mm")),  # smmla, sdot
        ("dotprod", ("neon", "dotprod")),  # sdot / udot
        ("neon", ("neon",)),  # smlal
    ],
}


def arch_of_triple(triple: str) -> str:
    if triple.startswith(("x86_64", "amd64")):
        return "x86_64"
    if triple.startswith(("aarch64", "arm64")):
        return "aarch64"
    return "other"


def feature_flags(arch: str) -> dict[str, str]:
    return {"x86_64": X86_FEATURE_FLAGS, "aarch64": AARCH64_FEATURE_FLAGS}.get(arch, {})


@dataclasses.dataclass(frozen=True)
class CpuIsa:
    """What a CPU target's code may use."""

    arch: str  # "x86_64", "aarch64" or "other"
    features: frozenset[str]  # LLVM feature names the target enables
    vector_bits: int  # the widest vector register
    vector_registers: int
    int_dot: str  # the integer dot-product family (INT_DOT_FAMILIES), or "none"

    @property
    def float_lanes(self) -> int:
        return self.vector_bits // 32

    def lanes(self, dtype_bits: int) -> int:
        return max(self.vector_bits // dtype_bits, 1)

    def has(self, *features: str) -> bool:
        return all(f in self.features for f in features)

    @property
    def required_features(self) -> list[str]:
        """The enabled features a CPU must have to run this target's code (recorded in the artifact)."""
        return sorted(self.features & set(feature_flags(self.arch)))

    def describe(self) -> str:
        return f"{self.arch}, {self.vector_bits}-bit vectors x {self.vector_registers}, integer dot: {self.int_dot}"


def _classify(arch: str, features: frozenset[str]) -> tuple[int, int, str]:
    family = next((name for name, need in INT_DOT_FAMILIES.get(arch, []) if all(f in features for f in need)), "none")
    if arch == "x86_64":
        bits = 512 if "avx512f" in features else 256 if "avx" in features else 128
        return bits, 32 if bits == 512 else 16, family
    if arch == "aarch64":
        return 128, 32, family  # NEON (SVE lengths vary per core and are not used)
    return 128, 16, family


_CACHE: dict[str, CpuIsa] = {}


def cpu_isa(target: Target) -> CpuIsa | None:
    """The instruction set of an LLVM CPU target (a GPU target's host is not asked); None for other kinds."""
    if target.kind.name != "llvm":
        return None
    key = str(target)
    if key not in _CACHE:
        arch = arch_of_triple(str(target.attrs.get("mtriple", "")) or tvm.target.codegen.llvm_get_system_triple())
        features = frozenset(str(f) for f in llvm_get_cpu_features(target))
        _CACHE[key] = CpuIsa(arch, features, *_classify(arch, features))
    return _CACHE[key]


def code_cpu_isa(target: Target) -> CpuIsa | None:
    """The instruction set of the CPU that runs a target's CPU code: an LLVM target's own, else its host's (GPU and
    Hexagon targets); None where no CPU code is built."""
    runs_cpu = target if target.kind.name == "llvm" else target.host
    return None if runs_cpu is None else cpu_isa(runs_cpu)


def missing_features(required: list[str], available: frozenset[str] | set[str]) -> list[str]:
    """The features of `required` that a CPU offering `available` lacks."""
    return [f for f in required if f not in available]
