"""The compile pipeline per target: one ordered list of named steps from imported Relax to an executable."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic
from tvm.s_tir import dlight

from .. import stop_signals
from ..errors import MobilecError
from ..passes.apply_tuning_database import ApplyTuningDatabase
from ..passes.drop_tree_attention import DropTreeAttention
from ..passes.chain_kernels import ChainKernels
from ..passes.fuse_add_rmsnorm import FuseAddRMSNorm
from ..passes.fuse_dequantize_matmul import FuseDequantizeMatmul
from ..passes.fuse_gemm_norms import FuseGEMMNorms
from ..passes.fuse_gemv_norms import FuseGEMVNorms
from ..passes.fuse_norm_pairs import FuseNormPairs
from ..passes.fuse_swiglu import FuseSwiGLU
from ..passes.fuse_transpose_matmul import FuseTransposeMatmul
from ..passes.guard_kv_append import GuardKVAppend
from ..passes.hvx_gemv import HvxGEMV
from ..passes.integer_dot_gemm import IntegerDotGEMM
from ..passes.integer_dot_gemv import IntegerDotGEMV
from ..passes.mark_noalias import MarkNoalias
from ..passes.replace_cpu_attention import ReplaceCPUAttention
from ..passes.replace_gpu_attention import ReplaceGPUAttention
from ..passes.reuse_host_scalars import ReuseHostScalars
from ..passes.verify_alignment import VerifyAlignment
from ..passes.verify_device_limits import VerifyDeviceLimits
from ..passes.vload_half import VloadHalf, opencl_half_pointers
from ..schedules import cpu as cpu_schedules
from ..schedules import gpu as gpu_schedules
from ..target.build_plan import BuildPlan
from ..target.targets import TargetSpec
from . import object_cache

Step = tuple[str, tvm.transform.Pass]
# `mobilec tune` takes its kernels from the IR right before this step, so its database keys match at compile time.
APPLY_TUNING_STEP = "apply-tuning-database"


def _seq(passes: list[tvm.transform.Pass]) -> tvm.transform.Pass:
    return tvm.transform.Sequential(passes)


def steps(plan: BuildPlan, tuning: bool = False) -> list[Step]:
    """The ordered steps that run for `plan`, each inside `with target:`; a step for some targets only says which in
    its condition here, reading the plan's resolved facts (build_plan.py). With `tuning`, kernels tuned faster in
    tuning_logs/<target>/ (`mobilec tune`) are scheduled from there (compile asks for that)."""
    spec, gpu = plan.spec, plan.gpu
    target = spec.tvm_target()
    schedule_rules = gpu_schedules.rules(spec.schedule) if gpu else cpu_schedules.rules(plan.isa)
    gemv_rule = next((rule for rule in schedule_rules if isinstance(rule, gpu_schedules.GEMV)), None)
    matmul_rule = next((rule for rule in schedule_rules if isinstance(rule, gpu_schedules.Matmul)), None)
    reduction_rule = next((rule for rule in schedule_rules if isinstance(rule, dlight.gpu.GeneralReduction)), None)
    every_target = True
    candidates = [
        ("drop-tree-attention", DropTreeAttention(), every_target),
        ("fuse-transpose-matmul", FuseTransposeMatmul(), every_target),
        # CPUs with an integer dot product (x86 AVX2 / AVX-512, ARM dotprod / i8mm): decode GEMVs of quantized
        # weights multiply int16 (or int8) activations by the codes in integers; x86 with int8, prefill's too.
        ("integer-dot-gemv", IntegerDotGEMV(int(plan.decode_activations.removeprefix("int")), plan.gemv_family,
                                            plan.gemv_prefill), plan.gemv_family is not None),
        # hexagon-npu with int8 decode activations: decode GEMVs of weights stored for the HVX GEMV run on it.
        ("hvx-gemv", HvxGEMV(), plan.hvx_gemv),
        # aarch64 with i8mm (smmla) or dotprod (sdot), int8 decode activations: prefill matmuls of quantized weights
        # quantize X rows to int8 per 32 values and multiply them by the codes in integers.
        ("integer-dot-gemm", IntegerDotGEMM(plan.gemm_family), plan.gemm_family is not None),
        # LLVM CPU targets and Hexagon's host: the paged KV cache's attention kernels (decode, prefill) become
        # vectorized ones.
        ("cpu-attention", ReplaceCPUAttention(plan.attention_lanes, plan.attention_registers),
         plan.attention_lanes is not None),
        # GPU targets, models with a sliding window or capped scores (else TVM's GPU kernels stay): ours.
        ("gpu-attention", ReplaceGPUAttention(), gpu),
        # GPU targets: TVM's K/V append reads positions past the token count in its last thread group.
        ("guard-kv-append", GuardKVAppend(), gpu),
        # Needs the NT_matmul calls above; before FuseOps, so bias/residual adds still fuse into the fused kernel.
        ("fuse-dequantize-matmul", FuseDequantizeMatmul(), every_target),
        # CPU rules: on high-level ops, before LegalizeOps; takes the residual add that FuseOps would put in the
        # matmul epilogue, and schedules its kernel for CPU threads itself (GPUs leave it to FuseOps and dlight).
        ("fuse-add-rmsnorm", FuseAddRMSNorm(plan.hvx_norms), not gpu),
        ("fuse-swiglu", FuseSwiGLU(plan.hvx_norms, arithmetic_sigmoid=not gpu), every_target),
        ("dispatch-library", _seq(cpu_generic.library_dispatch_passes(target)), every_target),
        ("legalize", relax.transform.LegalizeOps(), every_target),
        ("annotate-op-pattern", relax.transform.AnnotateTIROpPattern(), every_target),
        ("fold-constant", relax.transform.FoldConstant(), every_target),
        ("fuse-ops", relax.transform.FuseOps(), every_target),
        ("fuse-tir", relax.transform.FuseTIR(), every_target),
        ("dead-code-elimination", relax.transform.DeadCodeElimination(), every_target),
        # GPU targets: the RMSNorm before a decode GEMV runs inside it, where our GEMV rule schedules the pair (each
        # work group reduces the row it reads); a q/k norm over each head after it too (a work group per head).
        ("fuse-gemv-norms", FuseGEMVNorms(lambda func: gemv_rule.takes(func, target)), gpu),
        # GPU targets: the RMSNorm before a prefill GEMM runs inside it, where our Matmul rule schedules the pair (each
        # work group reduces the rows of its tile).
        ("fuse-gemm-norms", FuseGEMMNorms(lambda func: matmul_rule.takes(func, target)), gpu),
        # GPU targets: a norm kernel left after them that alone reads another's result (Gemma 3's last post-norm
        # before the final norm) runs it first, where dlight's GeneralReduction schedules the pair (a work group per
        # row, both reductions in it).
        ("fuse-norm-pairs", FuseNormPairs(lambda func: reduction_rule.apply(func, target, False) is not None), gpu),
        # Kernels that tuned faster than our rules; dlight skips them (tirx.is_scheduled).
        (APPLY_TUNING_STEP, ApplyTuningDatabase(spec.name), tuning),
        ("schedule", dlight.ApplyDefaultSchedule(*schedule_rules), every_target),
        # CPU targets, once every kernel is scheduled: a projection's kernel and the small kernels around it (norms,
        # activation quantization, SwiGLU, casts) become one VM call.
        ("chain-kernels", ChainKernels(), spec.tvm_target_json["kind"] == "llvm"),
        # After the schedule, which adds float16 local caches of the scales.
        ("vload-half", VloadHalf(), _reads_half_with_vload(spec)),
        ("lower-dataflow", _seq(cpu_generic.dataflow_lower_passes(target)), every_target),
        ("plan-memory-and-lower", _seq(cpu_generic.finalize_passes(target)), every_target),
        ("reuse-host-scalars", ReuseHostScalars(), every_target),
        # Once every kernel exists: TVM 0.27's LLVM codegen gives all kernels the noalias setting of the last one.
        ("mark-noalias", MarkNoalias(), every_target),
        # Buffers here; kernels' threads, local memory and arguments again in build(), once split from the host.
        ("verify-device-limits", VerifyDeviceLimits(spec.device["max_alloc_gb"]), every_target),
        ("verify-alignment", VerifyAlignment(), every_target),
    ]
    return [(name, step) for name, step, runs in candidates if runs]


def _reads_half_with_vload(spec: TargetSpec) -> bool:
    """OpenCL computing in float32 (PoCL, devices without cl_khr_fp16): float16 scales and GGUF mins are read with
    vload_half, and the kernels are emitted without the cl_khr_fp16 requirement."""
    return spec.tvm_target_json["kind"] == "opencl" and spec.device["compute_dtype"] == "float32"


def run_steps(
    mod: tvm.IRModule, plan: BuildPlan, after_step: Callable[[int, str, tvm.IRModule], None] | None = None,
    tuning: bool = False,
) -> tvm.IRModule:
    """Apply every step in order; `after_step(index, name, mod)` sees the IR after each (for inspection)."""
    with plan.spec.tvm_target():
        for index, (name, step) in enumerate(steps(plan, tuning)):
            with naming_failures(f"step {name}", plan.spec, mod, step):
                mod = step(mod)
            if after_step is not None:
                after_step(index, name, mod)
    return mod


@tvm.instrument.pass_instrument
class _CheckKernels:
    """Runs VerifyDeviceLimits on the device kernels as SplitHostDevice leaves them: the exact arguments,
    threads and local memory (cross-thread reductions included) each kernel launch will have."""

    def __init__(self, spec: TargetSpec):
        self.verify = VerifyDeviceLimits(spec.device["max_alloc_gb"])

    def run_after_pass(self, mod: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
        if info.name == "tirx.SplitHostDevice":
            self.verify(mod)


def build(mod: tvm.IRModule, plan: BuildPlan, tuning: bool = False,
          after_step: Callable[[int, str, tvm.IRModule], None] | None = None) -> tvm.runtime.Executable:
    """Run the pipeline and generate code."""
    return generate(run_steps(mod, plan, after_step, tuning), plan.spec)


def generate(lowered: tvm.IRModule, spec: TargetSpec) -> tvm.runtime.Executable:
    """Code for a module the steps have lowered; the Relax passes are all ours, so TVM's default list is off."""
    current = tvm.transform.PassContext.current()
    half_pointers = opencl_half_pointers() if _reads_half_with_vload(spec) else contextlib.nullcontext()
    target = spec.tvm_target()
    with tvm.transform.PassContext(opt_level=current.opt_level, config=current.config,
                                   instruments=[*current.instruments, _CheckKernels(spec)]), half_pointers, \
            naming_failures("code generation", spec, lowered, lambda one: tvm.tirx.build(one, target=target)):
        if object_cache.applies(target):
            lowered = object_cache.as_objects(lowered, target, spec.device)
        return tvm.compile(lowered, target=target, relax_pipeline=None)


class InternalCompilerError(MobilecError):
    """TVM or a pass of ours failed on a model it accepted: a compiler bug, told in one line with the kernel."""


@contextlib.contextmanager
def naming_failures(where: str, spec: TargetSpec, mod: tvm.IRModule, attempt: Callable[[tvm.IRModule], object]):
    """Inside: an error that is not the user's (not MobilecError) becomes one line naming the kernel that fails,
    found by running `attempt` (the step that failed) on each PrimFunc of `mod` alone, and the target."""
    try:
        yield
    except MobilecError:
        raise
    except Exception as err:  # pylint: disable=broad-exception-caught
        stop_signals.raise_if_received()  # a Ctrl-C that TVM turned into an error of its own
        kernel = _failing_kernel(mod, attempt)
        detail = (str(err).strip().splitlines() or [type(err).__name__])[-1].strip()
        raise InternalCompilerError(
            f"internal compiler error in {where}{f', kernel {kernel}' if kernel else ''} for target {spec.name}: "
            f"{detail}; a bug in mobilec or TVM: please report this line with the model's config.json") from err


def _failing_kernel(mod: tvm.IRModule, attempt: Callable[[tvm.IRModule], object]) -> str | None:
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            try:
                attempt(tvm.IRModule({gv: func}))
            except Exception:  # pylint: disable=broad-exception-caught
                return gv.name_hint
    return None
