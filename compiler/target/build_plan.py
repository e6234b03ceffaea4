"""One compile's resolved facts: the target, the scheme and what they imply (instruction set, integer-dot kernels,
code order, KV cache dtype, activations), derived once by resolve_plan and read by the import, the pipeline and
its passes (compile, estimate, inspect and tune each resolve one)."""

from __future__ import annotations

import dataclasses

from ..choices import DECODE_ACTIVATIONS
from ..errors import MobilecError
from ..kernels import integer_dot_gemm, integer_dot_gemv
from ..model_import import kv_cache_dtype
from ..quantization.schemes import Scheme, get_scheme
from .isa import CpuIsa, code_cpu_isa
from .targets import TargetSpec, load_target, with_overrides


@dataclasses.dataclass(frozen=True)
class BuildPlan:  # pylint: disable=too-many-instance-attributes
    """What one compile builds: read, never re-derived, by the steps after resolve_plan."""

    spec: TargetSpec  # the target file, with --host-target / --compute-dtype applied (with_overrides)
    scheme: Scheme
    cpu: CpuIsa | None  # the CPU that runs the library's CPU code: the target's own, else its host's (GPU, Hexagon)
    gpu: bool  # GPU schedule rules (OpenCL)
    gemv_family: str | None  # integer-dot decode GEMVs' family (kernels/integer_dot_gemv/); None: float GEMVs
    hvx_gemv: bool  # hexagon-npu, int8 decode activations: decode GEMVs on the HVX GEMV (passes/hvx_gemv.py)
    hvx_norms: bool  # hexagon, float32 compute: RMSNorm (+add) and SwiGLU on hvx_norms.c (kernels/hvx_norms.py)
    gemm_family: str | None  # integer-dot prefill GEMMs' family (kernels/integer_dot_gemm/); None: float GEMMs
    code_order: str  # how the weight shards order the codes (quantization/group.CODE_ORDERS)
    decode_activations: str  # integer width of the decode GEMVs' activations (choices.DECODE_ACTIVATIONS)
    kv_dtype: str  # the KV cache's TVM dtype (kv_cache_dtype.resolve)
    compute_dtype: str  # activations: the float scheme's dtype, or the target's compute dtype
    attention_lanes: int | None  # float32 lanes of the CPU attention kernels; None: the target's (GPU) attention
    attention_registers: int | None  # vector registers the CPU attention kernels' register tiles fit in

    @property
    def isa(self) -> CpuIsa | None:
        """The instruction set of the target's own kernels: LLVM CPU targets; None for GPU and Hexagon targets."""
        return self.cpu if self.spec.tvm_target_json["kind"] == "llvm" else None

    @property
    def gemv_prefill(self) -> bool:
        """Whether prefill's matmuls run on the decode GEMV's batched kernel: int8 activations where there is no
        integer GEMM (x86), so that an int8 build rounds prefill as the ARM and hexagon-npu int8 builds do."""
        return self.decode_activations == "int8" and self.gemv_family is not None and self.gemm_family is None

    @property
    def integer_decode(self) -> bool:
        """Whether decode GEMVs multiply integer activations (and decode_activations applies)."""
        return self.gemv_family is not None or self.hvx_gemv


def resolve_plan(target: str | TargetSpec, quant: str | None = None, *, kv_dtype: str = "auto",
                 decode_activations: str | None = None, host_target: str | None = None,
                 compute_dtype: str | None = None, gguf_keepable: bool = False) -> BuildPlan:
    """The plan for `target` (a name, a .toml path or a loaded TargetSpec) and the options compile takes: `quant`
    (None: default_scheme's), `kv_dtype` (a --kv-dtype name), `decode_activations` (None: the target file's),
    `host_target` and `compute_dtype` (with_overrides); `gguf_keepable`: the model is a GGUF file every tensor of
    which `gguf` keeps (importer.keeps_gguf_blocks). Bad input is refused in one line."""
    spec = load_target(target) if isinstance(target, str) else target
    asked = get_scheme(quant) if quant else None  # a bad --quant is named before anything about the target
    spec = with_overrides(spec, host_target, compute_dtype)
    cpu = code_cpu_isa(spec.tvm_target())
    isa = cpu if spec.tvm_target_json["kind"] == "llvm" else None
    gemv_family = integer_dot_gemv.family(isa)
    hexagon = spec.tvm_target_json["kind"] == "hexagon"
    activations = _decode_activations(decode_activations, spec, gemv_family is not None or hexagon)
    # Hexagon: the HVX GEMV takes int8 activations only; with int16 (its default) the GEMVs stay TVM's float ones
    hvx_gemv = hexagon and activations == "int8"
    scheme = asked or get_scheme(default_scheme(spec, gguf_keepable, gemv_family is not None or hvx_gemv))
    # Prefill in integers only where decode already rounds activations to int8 as llama.cpp does (the ARM targets'
    # default): with int16 decode activations, which keep the float model's results, prefill stays float.
    gemm_family = integer_dot_gemm.family(isa) if activations == "int8" else None
    # the KV cache's attention kernels run on the CPU the model is exported for (Hexagon: its ARM host)
    cpu_attention = cpu is not None and spec.model_target().kind.name == "llvm"
    compute = scheme.float_dtype or spec.device["compute_dtype"]
    return BuildPlan(
        spec=spec, scheme=scheme, cpu=cpu, gpu=spec.schedule["rules"] == "gpu", gemv_family=gemv_family,
        hvx_gemv=hvx_gemv, hvx_norms=hexagon and compute == "float32", gemm_family=gemm_family,
        code_order="hvx" if hvx_gemv else integer_dot_gemv.stored_code_order(gemv_family),
        decode_activations=activations, kv_dtype=kv_cache_dtype.resolve(kv_dtype, spec, scheme),
        compute_dtype=compute,
        attention_lanes=cpu.float_lanes if cpu_attention else None,
        attention_registers=cpu.vector_registers if cpu_attention else None,
    )


def default_scheme(spec: TargetSpec, gguf_keepable: bool, integer_gemvs: bool) -> str:
    """The scheme compile uses without --quant: a GGUF file's own blocks (`gguf`) where integer-dot kernels multiply
    them as stored (the fast path, and no second rounding of weights already quantized); else the target file's."""
    return "gguf" if gguf_keepable and integer_gemvs else spec.device["default_quant"]


def _decode_activations(asked: str | None, spec: TargetSpec, integer_gemvs: bool) -> str:
    """`asked` (--decode-activations), else the target file's default; other than int16 only with integer GEMVs."""
    value = asked or spec.decode_activations
    if value not in DECODE_ACTIVATIONS:
        raise MobilecError(f"--decode-activations {value!r} is not one of {', '.join(DECODE_ACTIVATIONS)}")
    if value != "int16" and not integer_gemvs:
        needs = (f"needs a target with integer decode GEMVs (x86 with AVX2 or AVX-512, aarch64 with the dot "
                 f"product: +dotprod or +i8mm, hexagon-npu); {spec.name} decodes with float activations")
        if asked:
            raise MobilecError(f"--decode-activations {value} {needs}: drop the option")
        raise MobilecError(f"target file {spec.path}: field 'device.decode_activations' = {value!r} {needs}: "
                           f"remove the field")
    return value
