"""`mobilec inspect`: the IR after every pipeline step, as numbered TVMScript files and a summary table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import tvm
from tvm import relax, tirx

from .. import validate
from ..codegen import pipeline
from ..codegen.call_sites import ATTENTION_BUILTIN
from ..errors import MobilecError
from ..model_import.importer import import_model, keeps_gguf_blocks, open_model
from ..passes.ir_walk import relax_nodes
from ..target.build_plan import BuildPlan, resolve_plan


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_CALL_DPS_PACKED = tvm.ir.Op.get("relax.call_dps_packed")


def kernel_launches(mod: tvm.IRModule, function: str = "decode") -> int | None:
    """Kernels one call of `function` launches, as `mobilec profile` counts them: its calls of the module's TIR
    kernels (call_tir, or direct calls once lowered) and of the KV cache's attention (one builtin, which runs its
    own kernels inside); None where the module has no such Relax function."""
    gv = next((g for g in mod.get_global_vars() if g.name_hint == function), None)
    if gv is None or not isinstance(mod[gv], relax.Function):
        return None
    count = 0
    for call in relax_nodes(mod[gv]):
        op = call.args[0] if call.op in (_CALL_TIR, _CALL_DPS_PACKED) else call.op
        if isinstance(op, tvm.ir.GlobalVar):
            count += isinstance(mod[op], tirx.PrimFunc)
        elif isinstance(op, relax.ExternFunc):
            count += op.global_symbol.startswith(ATTENTION_BUILTIN)
    return count


def _summary(index: int, step: str, mod: tvm.IRModule, param_bytes: int, layers: int) -> dict[str, Any]:
    funcs = mod.functions.values()
    row = {
        "index": index,
        "step": step,
        "relax_functions": sum(isinstance(f, relax.Function) for f in funcs),
        "tir_kernels": sum(isinstance(f, tirx.PrimFunc) for f in funcs),
        "param_bytes": param_bytes,
    }
    for function in ("decode", "prefill"):  # prefill: one call per prompt chunk
        launches = kernel_launches(mod, function)
        row[f"{function}_launches"] = launches
        row[f"{function}_launches_per_layer"] = None if launches is None else launches / layers
    return row


_DUMP_NAME = re.compile(r"\d\d-[a-z0-9-]+\.py")
_DUMP_HEAD = b"\n# from tvm.script import"  # in the import lines TVMScript (mod.script()) begins with


def _dump_files(directory: Path) -> list[Path]:
    """The files of an IR dump in `directory`: NN-step.py files holding TVMScript, as record() writes them."""
    files = []
    for path in directory.iterdir():
        if _DUMP_NAME.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                if _DUMP_HEAD in b"\n" + f.read(512):
                    files.append(path)
    return files


def _dump_foreign(directory: Path) -> list[str] | None:
    """None when `directory` holds no IR dump; else its entries that are not the dump's."""
    ours = {p.name for p in _dump_files(directory)}
    return sorted(p.name for p in directory.iterdir() if p.name not in ours) if ours else None


def step_names(plan: BuildPlan) -> list[str]:
    return ["import", "quantize"] + [name for name, _ in pipeline.steps(plan)]


@dataclasses.dataclass(frozen=True)
class InspectOptions:
    """What `mobilec inspect` is asked; model, target, quant, context_window and quant_skip as for compile."""

    model: str | None = "default"
    target: str = "host"
    quant: str | None = None
    dump: str | None = None  # write the IR after each step as NN-step.py files here
    only_step: str | None = None  # only the IR after this step
    context_window: int | None = None
    quant_skip: tuple[str, ...] | list[str] = ()


def inspect_model(options: InspectOptions) -> list[dict[str, Any]]:
    """Run import, quantization and every pipeline step; write `NN-step.py` files into `dump` (all, or `only_step`)."""
    model, target, dump, only_step = options.model, options.target, options.dump, options.only_step
    context_window, quant_skip = options.context_window, list(options.quant_skip)
    plan = resolve_plan(target, options.quant, gguf_keepable=keeps_gguf_blocks(model))
    spec = plan.spec
    names = step_names(plan)
    if only_step is not None and only_step not in names:
        raise MobilecError(f"unknown step {only_step!r}; the steps for {spec.name} are: {', '.join(names)}")
    out = Path(dump) if dump else None
    if out is not None:
        # a new or empty directory, or an earlier dump, whose own files alone are replaced (no --overwrite needed)
        validate.output_directory(out, "--dump", _dump_foreign, "an IR dump of `mobilec inspect`", overwrite=None)
        validate.context_length(context_window)
        try:
            out.mkdir(parents=True, exist_ok=True)
            for old in _dump_files(out):
                old.unlink()
        except OSError as err:
            raise MobilecError(f"cannot write --dump {out}: {err.strerror or err}") from None
    rows: list[dict[str, Any]] = []

    def record(index: int, step: str, mod: tvm.IRModule, param_bytes: int) -> None:
        rows.append(_summary(index, step, mod, param_bytes, float_model.cfg.num_hidden_layers))
        if out is not None and only_step in (None, step):
            (out / f"{index:02d}-{re.sub(r'[^a-z0-9-]', '-', step)}.py").write_text(mod.script())

    with open_model(model) as ckpt:
        float_model = import_model(ckpt, plan, context_window, quant_skip, quantize=False)
        record(0, "import", float_model.mod, float_model.param_bytes)
        imported = import_model(ckpt, plan, context_window, quant_skip)
    quant_bytes = imported.param_bytes
    record(1, "quantize", imported.mod, quant_bytes)
    pipeline.run_steps(imported.mod, plan, lambda i, step, mod: record(i + 2, step, mod, quant_bytes))
    return rows
