"""`mobilec compile`: checkpoint -> Relax IR -> compiled library + weight shards, as one artifact directory."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from .. import validate
from ..artifacts.artifact import (
    CONFIG_FILE,
    FORMAT_VERSION,
    LIBRARY_DIR,
    PARAMS_DIR,
    TOKENIZER_DIR,
    file_manifest,
    installed_versions,
)
from ..artifacts.export import ShardWriter, atomic_directory, check_output
from ..codegen import hexagon, link, pipeline
from ..codegen.call_sites import call_site_map
from ..errors import MobilecError
from ..loaders import Checkpoint, open_checkpoint
from ..loaders.tokenizer import load_tokenizer
from ..model_import import chat_prompt
from ..model_import.importer import (PAGE_SIZE, ImportedModel, import_model, keeps_gguf_blocks, resolve_model_path,
                                     tensor_bytes)
from ..passes.apply_tuning_database import tuned_kernels
from ..progress import Steps
from ..quantization import awq
from ..target.build_plan import resolve_plan
from ..target.cpu_check import cpu_entry
from .estimate import RecordMemoryPlan, check_compile_fits, estimate_imported, over_budget_message, recording


def model_name(path: Path) -> str:
    return path.stem if path.is_file() else path.resolve().name


def default_output(model_path: Path, quant: str, target: str) -> Path:
    return Path("build") / f"{model_name(model_path)}-{quant}-{target}"


def _stored_array(ckpt: Checkpoint, imported: ImportedModel, name: str, made: dict[str, dict[str, np.ndarray]]):
    """The array to store for parameter `name`: from a quantized layer's plan, or checkpoint tensors as they are."""
    layer, _, suffix = name.rpartition(".")
    if layer in imported.plan and suffix != "bias":
        if layer not in made:
            made[layer] = imported.plan[layer]()
        array = made[layer].pop(suffix)
        if not made[layer]:
            del made[layer]
        return array
    parts = [ckpt.get(src) for src in imported.sources[name]]
    array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    offset = imported.cfg.param_offsets().get(name)
    if offset is not None:
        array = np.asarray(array, np.float32) + np.float32(offset)
    return imported.calibration.float_param(name, array) if imported.calibration else array


def write_params(ckpt: Checkpoint, imported: ImportedModel, out: Path, steps: Steps):
    """Convert weights one layer at a time, so only one layer is in memory beyond the checkpoint's map."""
    writer = ShardWriter(out / PARAMS_DIR)
    made: dict[str, dict[str, np.ndarray]] = {}
    sizes = [tensor_bytes(param) for _, param in imported.params]
    for name, param in steps.counted(imported.params, sizes, "tensors"):
        array = _stored_array(ckpt, imported, name, made)
        if tuple(array.shape) != tuple(int(d) for d in param.shape):
            raise MobilecError(
                f"tensor {name} has shape {tuple(array.shape)} in the checkpoint but the config implies "
                f"{tuple(int(d) for d in param.shape)}; the checkpoint and its config.json disagree"
            )
        writer.add(name, array.astype(param.dtype, copy=False))
    return writer.finish(out)


@dataclasses.dataclass(frozen=True)
class CompileOptions:  # pylint: disable=too-many-instance-attributes
    """What `mobilec compile` is asked: the checkpoint, the target file, the scheme, where to write, and how."""

    model: str | None = "default"  # an HF directory, a .gguf file, or "default" (SmolLM2-135M)
    target: str = "host"  # a target name or .toml path
    quant: str | None = None  # None: the target's default scheme
    output: str | None = None  # None: build/<model>-<quant>-<target>
    context_window: int | None = None
    progress: bool = True  # step lines on stderr (progress.Steps); False: silent
    quant_skip: tuple[str, ...] | list[str] = ()
    calibrate: str | None = None  # "awq"
    calib_text: str | None = None
    force: bool = False  # compile a model the estimate says does not fit
    no_tuning: bool = False  # ignore tuning_logs/<target>/
    decode_activations: str | None = None  # decode GEMV activations' int width; None: the target's (TargetSpec)
    overwrite: bool = False  # replace the artifact at output
    host_target: str | None = None  # GPU targets: build the host side for this target file's CPU instead
    compute_dtype: str | None = None  # instead of the target's (PoCL, which runs GPU artifacts here, has no fp16)
    kv_dtype: str = "auto"  # the KV cache's storage (kv_cache_dtype.py)


def compile_model(options: CompileOptions) -> dict[str, Any]:
    """Compile and write the artifact; returns a summary (path, timings, sizes, kernels scheduled from the
    target's tuning log, which `no_tuning` leaves unread). A model that does not fit the target's memory is
    refused unless `force`. `decode_activations`: int16 (float-accurate) or int8 (faster, llama.cpp's rounding) for
    the integer decode GEMVs of CPU targets with an integer dot product; None: the target file's default. The output
    must be a new path, an empty directory, or an artifact (replaced only with `overwrite`): export.check_output."""
    o = options
    quant_skip, overwrite = list(o.quant_skip), o.overwrite
    validate.context_length(o.context_window)
    if o.output:
        check_output(Path(o.output), overwrite)  # before anything is loaded or built
    # every option about the target and scheme, resolved (and a bad one refused) before any work
    model_path = resolve_model_path(o.model)
    plan = resolve_plan(o.target, o.quant, kv_dtype=o.kv_dtype, decode_activations=o.decode_activations,
                        host_target=o.host_target, compute_dtype=o.compute_dtype,
                        gguf_keepable=keeps_gguf_blocks(model_path))
    spec, scheme = plan.spec, plan.scheme
    link.check_toolchain(spec)  # before the build, not after it
    awq.check_options(o.calibrate, o.calib_text, scheme.layout)
    out_dir = Path(o.output) if o.output else default_output(model_path, scheme.name, spec.name)
    check_output(out_dir, overwrite)
    steps = Steps("compile", 4, o.progress)
    t_start = time.perf_counter()
    # calib_dir: --calibrate's rounded layers, until the artifact's writer has read them
    with open_checkpoint(model_path) as ckpt, atomic_directory(out_dir, overwrite) as tmp, \
            tempfile.TemporaryDirectory(prefix="mobilec-calibration-") as calib_dir:
        with steps.step("import", ckpt.description):
            if o.calibrate and not o.force:  # refused before the calibration's run, the largest peak
                check_compile_fits(ckpt.description, import_model(ckpt, plan, o.context_window, quant_skip,
                                                                  export=False), o.calibrate)
            calibration = (awq.calibrate(ckpt, scheme.layout, o.calib_text, Path(calib_dir), steps.log)
                           if o.calibrate else None)
            imported = import_model(ckpt, plan, o.context_window, quant_skip, calibration=calibration)
            if not o.force:
                check_compile_fits(ckpt.description, imported)
        family, cfg = imported.family, imported.cfg
        tuned: list[str] = []

        def note_tuned(_index: int, step: str, mod: tvm.IRModule) -> None:
            if step == pipeline.APPLY_TUNING_STEP:
                tuned.extend(tuned_kernels(mod))

        with steps.step("build", f"{family.name} for {spec.name} ({scheme.name})"):
            # The memory estimate reads the activation storage the pipeline plans, so it is made on the way and a
            # model that does not fit is refused before code generation.
            recorder = RecordMemoryPlan()
            with recording(recorder):
                lowered = pipeline.run_steps(imported.mod, plan, note_tuned, tuning=not o.no_tuning)
            memory = estimate_imported(ckpt, imported, plan, quant_skip, activations=recorder.plan(),
                                       kv_dtype=o.kv_dtype, calibrate=o.calibrate)
            if not memory.fits and not o.force:
                raise MobilecError(f"{over_budget_message(memory)}; or --force to compile it anyway")
            (tmp / LIBRARY_DIR).mkdir()
            npu, call_sites, executable = None, None, None
            if spec.tvm_target_json["kind"] == "hexagon":
                name, npu = hexagon.build_kernels(lowered, spec, tmp / LIBRARY_DIR)
                note = npu.get("note")
                if hexagon.runs_here(spec):  # the host side, its NPU kernel calls forwarded to the emulated DSP
                    executable = pipeline.generate(hexagon.forward_to_npu(lowered, set(npu["npu_kernels"])),
                                                   hexagon.host_spec(spec))
            else:
                executable = pipeline.generate(lowered, spec)
            if executable is not None:
                call_sites = call_site_map(executable.mod, len(imported.params))
                name, note = link.export_library(executable, spec, tmp / LIBRARY_DIR)
            library = f"{LIBRARY_DIR}/{name}"
        with steps.step("weights", f"{len(imported.params)} tensors ({scheme.name})"):
            index = write_params(ckpt, imported, tmp, steps)
        with steps.step("write", str(out_dir)):
            ckpt.save_tokenizer(tmp / TOKENIZER_DIR)
            config = {
                "format_version": FORMAT_VERSION,
                "model": {
                    "name": model_name(model_path),
                    "path": str(model_path.resolve()),
                    "family": family.name,
                    "source": ckpt.description,
                    "config": dataclasses.asdict(cfg),
                },
                "quantization": {**scheme.to_json(), "skip": list(quant_skip),
                                 "quantized_layers": sorted(imported.plan),
                                 "calibration": calibration.summary if calibration else None,
                                 # how the shards order the codes (group.CODE_ORDERS): the target's kernels'
                                 "code_order": plan.code_order},
                "compute_dtype": imported.dtype,
                "kv_dtype": cfg.kv_dtype,
                "decode_activations": plan.decode_activations if plan.integer_decode else None,
                "target": {
                    "name": spec.name,
                    "description": spec.description,
                    "tvm_target": spec.tvm_target_json,
                    "file_sha256": spec.sha256,
                    **({"overrides": spec.overrides} if spec.overrides else {}),
                },
                # the CPU the library's code needs (arch, features): a CPU without them refuses it (cpu_check.py)
                "cpu": cpu_entry(plan.cpu),
                "library": library,
                **({"npu_coverage": npu} if npu else {}),
                # which parameters each VM call reads (call_sites.py): what `mobilec profile` labels kernels by
                **({"call_sites": call_sites} if call_sites else {}),
                # one user message's prompt as the chat template renders it, split around the message (chat_prompt.py)
                "chat_prompt": chat_prompt.split(load_tokenizer(tmp / TOKENIZER_DIR)),
                "context_window": cfg.context_window_size,
                "prefill_chunk": cfg.prefill_chunk_size,
                "page_size": PAGE_SIZE,
                "param_bytes": sum(t["nbytes"] for t in index["tensors"]),
                "memory_estimate": memory.to_json(),
                "versions": installed_versions(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            # every file but this config, with its size and sha256 (the shards' computed as they were written)
            config["files"] = file_manifest(tmp, {f"{PARAMS_DIR}/{s['file']}": s["sha256"] for s in index["shards"]})
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    summary = {
        "artifact": str(out_dir),
        "target": spec.name,
        "quant": scheme.name,
        "decode_activations": config["decode_activations"],  # None: no integer decode GEMVs on this target
        "build_seconds": steps.record["build"]["seconds"],
        "total_seconds": round(time.perf_counter() - t_start, 2),
        "steps": steps.record,  # each step's seconds and peak resident memory (progress.Steps)
        "param_bytes": config["param_bytes"],
        "tuned_kernels": tuned,
        **({"note": note} if note else {}),
        **({"npu_coverage": npu} if npu else {}),
    }
    steps.log(f"wrote {out_dir} in {summary['total_seconds']:.1f} s")
    return summary
