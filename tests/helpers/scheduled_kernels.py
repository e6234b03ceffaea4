"""SmolLM2's GPU kernels as the GPU rules schedule them, beside the same PrimFuncs before scheduling, and a run of
one on an OpenCL platform against the other built for this CPU (tests/targets/test_pocl_kernels.py: float32 on
PoCL; test_float16_kernels.py: float16 on Intel's runtime)."""

from __future__ import annotations

import functools

import tvm

from compiler.codegen import pipeline
from compiler.testing import pocl

PREFILL = 7  # a prefill length that is not a multiple of any tile, so padding paths run
# Dynamic dimensions of the KV-cache append/read kernels; 8 pages of 16 tokens.
KV_DIMS = {"num_pages": 8, "page_size": 16, "layer_id": 3}
# GPU-only TIR that the KV cache's C++ code launches with its page tables (attention over pages, page copies,
# state merges): written with thread bindings already, so there is no CPU form here to compare against, and
# meaningful inputs are the paged KV cache's runtime state (test_float16_attention.py builds that state and runs
# the attention kernels and the merge against numpy).
NOT_RUN = {
    "batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_decode_paged_kv",
    "batch_prefill_paged_kv_sliding_window", "batch_decode_paged_kv_sliding_window",
    "tir_attention_merge_state", "copy_single_page", "compact_kv_copy",
}


@functools.lru_cache(maxsize=None)
def kernels(target_name: str, quant: str, compute_dtype: str = "float32"):
    """(spec, {name: (scheduled PrimFunc, PrimFunc before scheduling)}) for SmolLM2 on the target, computing in
    `compute_dtype` (float32 for PoCL, which has no fp16)."""
    from compiler.loaders import open_checkpoint  # pylint: disable=import-outside-toplevel
    from compiler.loaders.default_model import default_model_path  # pylint: disable=import-outside-toplevel
    from compiler.model_import.importer import import_model  # pylint: disable=import-outside-toplevel
    from compiler.target.build_plan import resolve_plan  # pylint: disable=import-outside-toplevel

    plan = resolve_plan(target_name, quant, compute_dtype=compute_dtype)
    spec = plan.spec
    with open_checkpoint(default_model_path()) as ckpt:
        mod = import_model(ckpt, plan, 512).mod
    before = None
    with spec.tvm_target():
        for name, step in pipeline.steps(plan):
            if name == "schedule":
                # dlight schedules the module's functions in place; keep a copy of the unscheduled ones.
                before = tvm.ir.load_json(tvm.ir.save_json(mod))
            mod = step(mod)
            if name == "schedule":
                break
    pairs = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            pairs[gv.name_hint] = (func, before[gv.name_hint])
    return spec, pairs


def bindings(func, seq_len: int) -> dict[str, int]:
    names = pocl.shape_vars(func)
    # seq_len (model kernels), ntoken/seqlen (KV-cache append/read) are the token count of the step.
    return {**KV_DIMS, **{n: seq_len for n in names if n not in KV_DIMS}}


def random_args(func, values, rng):
    args = pocl.random_args(func, values, rng)
    for i, param in enumerate(func.params):
        if param.name == "position_map":  # distinct slots: repeated ones would race on the same page entry
            capacity = KV_DIMS["num_pages"] * KV_DIMS["page_size"]
            args[i] = rng.permutation(capacity)[: args[i].shape[0]].astype("int32")
    return args


def compare(spec, scheduled, reference, seq_len, rng, launch_hook=None, platform=pocl.POCL, change_args=None):
    """(max abs error, max |reference|) of the scheduled kernels on `platform` against the reference on this CPU,
    on the same random inputs; `change_args(args)` alters the GPU run's inputs only (negative controls: inputs it
    replaces are left out of the comparison, which would otherwise fail on the altered input itself)."""
    values = bindings(scheduled, seq_len)
    args = random_args(scheduled, values, rng)
    build = pocl.build_opencl(scheduled, spec.tvm_target())
    given = change_args(list(args)) if change_args else args
    got = pocl.run_pocl(build, given, values, launch_hook, platform)
    got = [arg if new is not arg else result for arg, new, result in zip(args, given, got)]
    want = pocl.reference_llvm(reference, args)
    return pocl.max_abs_error(got, want)
