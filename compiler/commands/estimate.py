"""`mobilec estimate`: the memory a compiled model needs on a target, before building it.

Everything is derived from what `compile` itself builds, so the estimate cannot drift from the artifact:
- weights: the parameters of the family's nn.Module after quantization (shapes and dtypes only, no values
  read), which are exactly the tensors `compile` writes to params/;
- KV cache: TVM's paged cache as its runtime allocates it (src/runtime/vm/paged_kv_cache.cc);
- activations: the storage TVM's static memory planner gives prefill and decode in the compile pipeline, and the
  heap scratch of the kernel of each that holds most (its buffers of its own: the runtime's workspace pool).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
from typing import Any

import tvm
from tvm import relax, s_tir, tirx
from tvm.sym.analyzer import Analyzer

from .. import roofline
from ..codegen import pipeline
from ..errors import MobilecError
from ..loaders import Checkpoint, ConfigCheckpoint
from ..model_import import kv_cache_dtype
from ..model_import.importer import PAGE_SIZE, ImportedModel, import_model, keeps_gguf_blocks, open_model, tensor_bytes
from ..models.llama import LlamaConfig
from ..passes.ir_walk import relax_nodes, tir_statements
from ..quantization import awq, group
from ..quantization.schemes import SCHEMES, Scheme
from ..target import host
from ..target.build_plan import BuildPlan, resolve_plan
from ..target.targets import TargetSpec
from ..validate import USABLE_CORES

MARGIN = 0.2  # the runtime, library, tokenizer and allocator slack the count above does not see
GIB = 2**30  # target files give ram_gb and max_alloc_gb in GiB, as passes/verify_device_limits.py reads the latter
PLANNED_FUNCTIONS = ("prefill", "decode")  # what a deployed model runs (prefill_logits serves `eval` only)
PLANNED_LAYERS = 2  # plan_activations: a layer and the next, whose storage the memory plan reuses for every other
MIN_SUGGESTED_CONTEXT = 128  # shorter windows are of no use for a conversation
# compile's own peak beside the weights it holds: Python, TVM and the library build (measured: 0.4-0.7 GiB for
# SmolLM2 to Llama-3-8B shapes, CPU and GPU targets; bench/compile_memory.py)
COMPILE_BASE_BYTES = 1 * GIB


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:  # pylint: disable=too-many-instance-attributes
    """Bytes a compiled model needs on a target, against the target's RAM and largest single allocation."""

    model: str
    target: str
    quant: str
    context: int
    prefill_chunk: int
    dtype: str  # activations
    kv_dtype: str  # the KV cache's storage
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    margin_bytes: int
    total_bytes: int
    ram_bytes: int
    fits: bool  # the total within RAM and the largest buffer within the largest allocation
    largest_buffer_name: str
    largest_buffer_bytes: int
    max_alloc_bytes: int
    bytes_per_token: int  # read from memory per decoded token at a full context
    memory_bandwidth_gbs: float
    decode_floor_ms: float  # bytes_per_token at the target's memory bandwidth
    fitting_quant: str | None = None  # when it does not fit: the least quantized smaller scheme that does
    fitting_quant_total_bytes: int | None = None
    fitting_context: int | None = None  # when it does not fit: the longest halved context window that does
    # the longest context (a multiple of the page size, within the model's) that fits, per KV dtype: exact for
    # kv_dtype, at most that for the others (their activations are bounded, not planned)
    context_by_kv_dtype: dict[str, int] = dataclasses.field(default_factory=dict)
    compile_bytes: int = 0  # peak memory of `compile` itself on the machine that compiles (compile_peak_bytes)
    calibrate: str | None = None  # the --calibrate method compile_bytes counts

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@tvm.instrument.pass_instrument
class RecordMemoryPlan:
    """Keeps the module as LowerAllocTensor leaves it: StaticPlanBlockMemory has assigned the tensors it can
    plan to storage, and LowerAllocTensor has given every other (dynamic-size) tensor a storage of its own.
    Compile records it while it builds, so the pipeline runs once."""

    def __init__(self):
        self.mod = None

    def run_after_pass(self, mod: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
        if info.name == "LowerAllocTensor":
            self.mod = mod

    def plan(self) -> ActivationPlan:
        if self.mod is None:
            raise RuntimeError("no pipeline step runs LowerAllocTensor, so there is no memory plan to read")
        return ActivationPlan({name: _storage_sizes(self.mod[name]) for name in PLANNED_FUNCTIONS},
                              {name: _kernel_scratch(self.mod, self.mod[name]) for name in PLANNED_FUNCTIONS})


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
    """The storage allocations of each planned function, and the heap scratch of each kernel it calls (one call at a
    time, from a pool that keeps what it gave back), in bytes, symbolic in the prompt length."""

    sizes: dict[str, list[tirx.PrimExpr]]
    scratch: dict[str, list[tirx.PrimExpr]]

    def at(self, prefill_chunk: int) -> tuple[int, int]:
        """(bytes of the function that holds most: its storage and its largest kernel scratch, largest single
        storage allocation), every symbolic dimension at the prefill chunk: prefill's seq_len is the only one, and
        the runtime never passes a longer prompt."""
        per_function = {name: [_bound(size, prefill_chunk) for size in sizes] for name, sizes in self.sizes.items()}
        held = [sum(sizes) + max((_bound(size, prefill_chunk) for size in self.scratch[name]), default=0)
                for name, sizes in per_function.items()]
        return max(held), max(max(sizes, default=0) for sizes in per_function.values())


def _bound(size: tirx.PrimExpr, value: int) -> int:
    analyzer = Analyzer()
    for var in tirx.analysis.undefined_vars(size):
        analyzer.bind(var, value)
    return int(analyzer.simplify(size).value)


def _storage_sizes(func: relax.Function) -> list[tirx.PrimExpr]:
    """The bytes of every storage allocation in `func` (alloc_storage's shape is a byte count)."""
    return [functools.reduce(operator.mul, call.args[0].values) for call in relax_nodes(func)
            if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.memory.alloc_storage"]


def scratch_bytes(func: tirx.PrimFunc) -> tirx.PrimExpr:
    """Global-scope buffers of a kernel's own: its root block's through the call, and those inside one of its
    statements at a time (a chained kernel's parts, passes/chain_kernels.py)."""

    def total(buffers) -> tirx.PrimExpr:
        sizes = [functools.reduce(operator.mul, [tirx.Cast("int64", d) for d in b.shape],
                                  tirx.const(tvm.DataType(str(b.dtype)).bits * tvm.DataType(str(b.dtype)).lanes // 8,
                                             "int64"))
                 for b in buffers if b.scope() in ("global", "")]
        return sum(sizes, tirx.const(0, "int64"))

    def inside(stmt) -> tirx.PrimExpr:
        return total([b for node in tir_statements(stmt) for b in (
            [node.buffer] if isinstance(node, tirx.AllocBuffer) else getattr(node, "alloc_buffers", []))])

    root = func.body.block if isinstance(func.body, s_tir.SBlockRealize) else None
    if root is None:
        return inside(func.body)
    parts = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    return functools.reduce(tirx.max, [inside(part) for part in parts], total(root.alloc_buffers))


def _kernel_scratch(mod: tvm.IRModule, func: relax.Function) -> list[tirx.PrimExpr]:
    """The scratch of each kernel `func` calls."""
    called = {}
    for call in relax_nodes(func):
        for gv in (call.op, *call.args[:1]):
            if isinstance(gv, tvm.ir.GlobalVar) and isinstance(mod[gv], tirx.PrimFunc):
                called[gv.name_hint] = mod[gv]
    return [scratch_bytes(kernel) for kernel in called.values()]


def plan_activations(ckpt: Checkpoint, plan: BuildPlan, context_window: int, quant_skip: list[str]) -> ActivationPlan:
    """pipeline_activations of the model cut to its first PLANNED_LAYERS layers (LlamaConfig.first_layers): the
    memory plan reuses a layer's storage for the next, so those plan what all of them do, in a fraction of the time
    (a 7B's 32 layers: ~20 s). With --quant-skip, whose patterns may name later layers, the whole model."""
    first = None if quant_skip else PLANNED_LAYERS
    return pipeline_activations(import_model(ckpt, plan, context_window, quant_skip, first_layers=first).mod, plan)


def pipeline_activations(mod: tvm.IRModule, plan: BuildPlan) -> ActivationPlan:
    """Run the compile pipeline's steps through memory planning (no code generation) and read the storage
    that prefill and decode allocate."""
    recorder = RecordMemoryPlan()
    with recording(recorder), plan.spec.tvm_target():
        for _, step in pipeline.steps(plan):
            mod = step(mod)
            if recorder.mod is not None:
                break
    return recorder.plan()


def recording(instrument) -> tvm.transform.PassContext:
    """The current pass context with `instrument` added."""
    current = tvm.transform.PassContext.current()
    return tvm.transform.PassContext(opt_level=current.opt_level, config=current.config,
                                     instruments=[*current.instruments, instrument])


def _attention_scratch(cfg: LlamaConfig, kv_dtype: str) -> int:
    """The cache's attention scratch for one prefill chunk (kv_cache_dtype.scratch_bytes_per_token); sized like
    activations, counted with them."""
    return cfg.prefill_chunk_size * kv_cache_dtype.scratch_bytes_per_token(
        kv_dtype, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)


def _longest_context(cfg: LlamaConfig, fixed: int, kv_dtype: str, ram: int, max_alloc: int) -> int:
    """The longest context, in whole pages and within the model's, whose total (`fixed` bytes of weights and
    activations, plus the KV cache) with the margin fits `ram`, and whose per-layer pages fit `max_alloc`; 0 if
    none."""
    fixed += _attention_scratch(cfg, kv_dtype)
    layer_page = PAGE_SIZE * kv_cache_dtype.bytes_per_token_layer(kv_dtype, cfg.num_key_value_heads, cfg.head_dim)
    pages = min(int(ram / (1 + MARGIN) - fixed) // (cfg.num_hidden_layers * layer_page), max_alloc // layer_page) - 1
    return max(0, min(pages * PAGE_SIZE, cfg.max_position_embeddings))


def compile_peak_bytes(imported: ImportedModel, calibrate: str | None = None) -> int:
    """What `compile` holds at most on the machine that compiles: COMPILE_BASE_BYTES, plus, while the weights are
    written a layer at a time, the layer with the most: its stored arrays, and its float32 weight where it is joined
    from several checkpoint tensors (q/k/v, gate/up; one tensor is read a slice of rows at a time, group.quantize)
    or kept in float; with `calibrate`, at least calibrate_peak_bytes."""
    stored: dict[str, int] = {}
    for name, param in imported.params:
        layer = name.rpartition(".")[0]
        key = layer if layer in imported.plan else name
        stored[key] = stored.get(key, 0) + tensor_bytes(param)
    held, shapes = 0, imported.cfg.source_shapes()
    for key, nbytes in stored.items():
        sources = imported.sources.get(f"{key}.weight" if key in imported.plan else key, [])
        float32 = 4 * sum(functools.reduce(operator.mul, shapes[source], 1) for source in sources)
        joined = key not in imported.plan or len(sources) > 1
        held = max(held, nbytes + (float32 if joined else group.QUANTIZE_CHUNK_BYTES * USABLE_CORES))
    return max(COMPILE_BASE_BYTES + held, calibrate_peak_bytes(imported.cfg) if calibrate else 0)


def calibrate_peak_bytes(cfg: LlamaConfig) -> int:
    """What `--calibrate awq` holds at most (awq.calibrate, a decoder layer at a time): COMPILE_BASE_BYTES plus
    the larger of a decoder layer's working set (its float32 weights twice, as loaded and as joined into q/k/v and
    gate/up, and GPTQ's k x k matrices of its widest input) and the output layer's weight as it is read whole: its
    float32 copy beside the 16-bit checkpoint's pages (measured: Llama-3-8B shape 6.28 GiB in a decoder layer's GPTQ,
    Llama-3.2-3B's 2.79 GiB there and 3.05 GiB as its tied token table is read)."""
    shapes = cfg.source_shapes()
    layers: dict[str, list[tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            layers.setdefault(name.split(".")[2], []).append(shape)
    layer = max(8 * sum(functools.reduce(operator.mul, shape, 1) for shape in layer_shapes)
                + awq.GPTQ_BYTES_PER_INPUT_SQUARED * max(shape[1] for shape in layer_shapes if len(shape) == 2) ** 2
                for layer_shapes in layers.values())
    output = (4 + 2) * functools.reduce(operator.mul, shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"]))
    return COMPILE_BASE_BYTES + max(layer, output)


def _budget(description: str, spec: TargetSpec, quant: str, cfg: LlamaConfig, params: list, dtype: str,
            activations: ActivationPlan) -> MemoryEstimate:
    """The estimate of a model with these parameters at `cfg`'s context window, prefill chunk and KV dtype."""
    weights = {name: tensor_bytes(p) for name, p in params}
    kv_layer = kv_cache_dtype.layer_bytes(cfg.kv_dtype, cfg.num_key_value_heads, cfg.head_dim,
                                          cfg.context_window_size, PAGE_SIZE)
    read = roofline.decode_read(
        ((name.startswith(roofline.EMBEDDING), weights[name], int(p.shape[0])) for name, p in params),
        bool(cfg.tie_word_embeddings),
        cfg.num_hidden_layers * kv_cache_dtype.bytes_per_token_layer(cfg.kv_dtype, cfg.num_key_value_heads,
                                                                     cfg.head_dim),
        cfg.context_window_size, f"weights + {cfg.kv_dtype} KV cache at the context window")
    planned, largest_planned = activations.at(cfg.prefill_chunk_size)
    activation_bytes = planned + _attention_scratch(cfg, cfg.kv_dtype)
    counted = sum(weights.values()) + cfg.num_hidden_layers * kv_layer + activation_bytes
    margin = round(MARGIN * counted)
    largest_weight = max(weights, key=weights.get)
    largest_name, largest_bytes = max(
        [(f"weight {largest_weight}", weights[largest_weight]), ("KV cache pages of one layer", kv_layer),
         ("activation storage", largest_planned)],
        key=lambda item: item[1],
    )
    ram, max_alloc = int(spec.device["ram_gb"] * GIB), int(spec.device["max_alloc_gb"] * GIB)
    bandwidth = float(spec.device["memory_bandwidth_gbs"])
    # Another KV dtype's activations are not planned: a cache in a dtype other than the activations' adds the cast
    # q/k/v and output of one prefill chunk (kv_cache_dtype.conversion_bytes_per_token), counted as if never reused,
    # and a float cast twice: a prefill chain (passes/chain_kernels.py) holds the casts and the copies around them as
    # buffers of its own. So the context is never overstated.
    by_kv = {name: _longest_context(cfg, sum(weights.values()) + planned + (
                 (1 if kv in kv_cache_dtype.CODE_FORMATS else 2) * cfg.prefill_chunk_size
                 * kv_cache_dtype.conversion_bytes_per_token(
                     kv, dtype, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
                 if kv != cfg.kv_dtype else 0), kv, ram, max_alloc)
             for name, kv in ((name, kv_cache_dtype.TVM_DTYPES[name])
                              for name in kv_cache_dtype.names_taken(spec, SCHEMES[quant]))}
    return MemoryEstimate(
        model=description, target=spec.name, quant=quant, context=cfg.context_window_size,
        prefill_chunk=cfg.prefill_chunk_size, dtype=dtype, kv_dtype=cfg.kv_dtype,
        weights_bytes=sum(weights.values()), kv_cache_bytes=cfg.num_hidden_layers * kv_layer,
        activation_bytes=activation_bytes, margin_bytes=margin, total_bytes=counted + margin, ram_bytes=ram,
        fits=counted + margin <= ram and largest_bytes <= max_alloc, largest_buffer_name=largest_name,
        largest_buffer_bytes=largest_bytes, max_alloc_bytes=max_alloc, bytes_per_token=read.total,
        memory_bandwidth_gbs=bandwidth, decode_floor_ms=roofline.floor_ms(read.total, bandwidth),
        context_by_kv_dtype=by_kv,
    )


def _fitting_quant(ckpt: Checkpoint, imported: ImportedModel, plan: BuildPlan,
                   plans: dict[str, ActivationPlan], quant_skip: list[str], kv_dtype: str) -> MemoryEstimate | None:
    """The estimate of the least quantized scheme with smaller weights that fits, if any (each resolved as `plan`
    was, its KV cache as the --kv-dtype name `kv_dtype`)."""
    context = imported.cfg.context_window_size
    current = imported.param_bytes
    smaller = []
    for candidate in SCHEMES.values():
        if candidate.name == plan.scheme.name:
            continue
        try:
            other = resolve_plan(plan.spec, candidate.name, kv_dtype=kv_dtype,
                                 decode_activations=plan.decode_activations)
            shapes = import_model(ckpt, other, context, quant_skip, export=False)
        except MobilecError:
            continue  # a scheme this input cannot take: gguf without a GGUF file, --quant-skip with a float scheme
        weights = shapes.param_bytes
        if weights < current:
            smaller.append((weights, other, shapes))
    for _, other, shapes in sorted(smaller, key=lambda item: -item[0]):
        # Activations depend on the compute dtype only: every scheme's dequantization happens inside its matmuls.
        if shapes.dtype not in plans:
            plans[shapes.dtype] = plan_activations(ckpt, other, context, quant_skip)
        est = _budget(ckpt.description, plan.spec, other.scheme.name, shapes.cfg, shapes.params, shapes.dtype,
                      plans[shapes.dtype])
        if est.fits:
            return est
    return None


def _fitting_context(ckpt: Checkpoint, imported: ImportedModel, scheme: Scheme, spec: TargetSpec,
                     activations: ActivationPlan) -> int | None:
    """The longest halving of the context window that fits with this scheme, if any."""
    context = imported.cfg.context_window_size // 2
    while context >= MIN_SUGGESTED_CONTEXT:
        cfg = dataclasses.replace(imported.cfg, context_window_size=context,
                                  prefill_chunk_size=min(context, imported.cfg.prefill_chunk_size))
        if _budget(ckpt.description, spec, scheme.name, cfg, imported.params, imported.dtype, activations).fits:
            return context
        context //= 2
    return None


def estimate_imported(ckpt: Checkpoint, imported: ImportedModel, plan: BuildPlan,
                      quant_skip: list[str] = (), activations: ActivationPlan | None = None,
                      kv_dtype: str = "auto", calibrate: str | None = None) -> MemoryEstimate:
    """The estimate of a model imported with `plan` (and exported), with its `activations` if the pipeline already
    ran (RecordMemoryPlan); when it does not fit, with the smaller scheme (its KV cache as `kv_dtype`, the
    --kv-dtype name the plan was resolved with) and the shorter context window that would. The compile's own peak
    counts the `calibrate` method's run."""
    spec, scheme = plan.spec, plan.scheme
    plans = {imported.dtype: activations or plan_activations(ckpt, plan, imported.cfg.context_window_size,
                                                             list(quant_skip))}
    est = dataclasses.replace(_budget(ckpt.description, spec, scheme.name, imported.cfg, imported.params,
                                      imported.dtype, plans[imported.dtype]),
                              compile_bytes=compile_peak_bytes(imported, calibrate), calibrate=calibrate)
    if est.fits:
        return est
    by_quant = _fitting_quant(ckpt, imported, plan, plans, list(quant_skip), kv_dtype)
    return dataclasses.replace(
        est,
        fitting_quant=by_quant.quant if by_quant else None,
        fitting_quant_total_bytes=by_quant.total_bytes if by_quant else None,
        fitting_context=_fitting_context(ckpt, imported, scheme, spec, plans[imported.dtype]),
    )


@dataclasses.dataclass(frozen=True)
class EstimateOptions:
    """What `mobilec estimate` is asked; the fields mean what they mean for compile (CompileOptions)."""

    # also a directory holding only a config.json, or an HF config dict: no weights are read
    model: str | os.PathLike | dict[str, Any] | None = "default"
    target: str = "host"
    quant: str | None = None
    context_window: int | None = None
    quant_skip: tuple[str, ...] | list[str] = ()
    kv_dtype: str = "auto"
    calibrate: str | None = None


def estimate_memory(options: EstimateOptions) -> MemoryEstimate:
    """The estimate for `options.model` on `options.target`, with the target's scheme unless `quant` says."""
    model, quant_skip = options.model, list(options.quant_skip)
    plan = resolve_plan(options.target, options.quant, kv_dtype=options.kv_dtype, gguf_keepable=keeps_gguf_blocks(model))
    awq.check_options(options.calibrate, None, plan.scheme.layout)
    if isinstance(model, dict):
        ckpt: Checkpoint = ConfigCheckpoint(model, f"a {model.get('model_type')} config")
    else:
        ckpt = open_model(model, weights_required=False)
    with ckpt:
        imported = import_model(ckpt, plan, options.context_window, quant_skip, export=False)
        return estimate_imported(ckpt, imported, plan, quant_skip, kv_dtype=options.kv_dtype,
                                 calibrate=options.calibrate)


def check_compile_fits(description: str, imported: ImportedModel, calibrate: str | None = None) -> None:
    """Refuse in one line, before the build (and before `calibrate`'s run), a compile this machine has not the
    memory for (compile_peak_bytes against MemAvailable)."""
    need, available = compile_peak_bytes(imported, calibrate), host.available_bytes()
    if available is not None and need > available:
        raise MobilecError(f"compiling {description} needs about {_size(need)} of memory on this machine, which has "
                           f"{_size(available)} available; close other programs, or --force to compile it anyway")


def _size(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


def over_budget_message(est: MemoryEstimate) -> str:
    """One line for an estimate that does not fit: by how much, and the nearest options that do."""
    problems = []
    if est.total_bytes > est.ram_bytes:
        problems.append(f"needs {_size(est.total_bytes)} with the {MARGIN:.0%} margin, over the "
                        f"{_size(est.ram_bytes)} of RAM by {_size(est.total_bytes - est.ram_bytes)}")
    if est.largest_buffer_bytes > est.max_alloc_bytes:
        problems.append(f"its largest buffer ({est.largest_buffer_name}, {_size(est.largest_buffer_bytes)}) is over "
                        f"the largest single allocation ({_size(est.max_alloc_bytes)})")
    fixes = []
    if est.fitting_quant:
        fixes.append(f"--quant {est.fitting_quant} fits ({_size(est.fitting_quant_total_bytes)})")
    if est.fitting_context:
        fixes.append(f"--context-window {est.fitting_context} fits")
    fix = ", or ".join(fixes) or "no smaller --quant or --context-window fits; pick a smaller model or target"
    return (f"{est.model} as {est.quant} with a {est.context}-token context does not fit {est.target}: "
            f"{'; '.join(problems)}; {fix}")


def format_budget(est: MemoryEstimate) -> str:
    """The budget as a table, one row per figure."""
    tok_s = 1e3 / est.decode_floor_ms
    rows = [
        ("weights", _size(est.weights_bytes), est.quant),
        (f"KV cache @ {est.context}", _size(est.kv_cache_bytes), f"{est.kv_dtype}, pages of {PAGE_SIZE} tokens"),
        ("activations", _size(est.activation_bytes), f"prefill chunk {est.prefill_chunk}, {est.dtype}"),
        (f"margin {MARGIN:.0%}", _size(est.margin_bytes), ""),
        ("total", _size(est.total_bytes), f"of {_size(est.ram_bytes)} RAM: "
                                          f"{'fits' if est.total_bytes <= est.ram_bytes else 'DOES NOT FIT'}"),
        ("largest buffer", _size(est.largest_buffer_bytes),
         f"{est.largest_buffer_name}, of {_size(est.max_alloc_bytes)} max alloc: "
         f"{'fits' if est.largest_buffer_bytes <= est.max_alloc_bytes else 'DOES NOT FIT'}"),
        ("bytes/token", _size(est.bytes_per_token), f"weights once + KV cache @ {est.context}"),
        ("decode floor", f"{est.decode_floor_ms:.2f} ms/token",
         f"{tok_s:.1f} tok/s at {est.memory_bandwidth_gbs:g} GB/s"),
    ]
    rows += [("longest context", f"{tokens} tokens", f"with a {name} KV cache")
             for name, tokens in est.context_by_kv_dtype.items()]
    available = host.available_bytes()
    command = "compile" + (f" --calibrate {est.calibrate}" if est.calibrate else "")
    rows.append(("compile here", _size(est.compile_bytes), f"peak of `{command}` itself" + (
        f", of {_size(available)} available on this machine" if available else "")))
    lines = [f"{est.model} on {est.target}"] + [f"  {label:18s} {value:>16s}  {note}".rstrip()
                                                for label, value, note in rows]
    if not est.fits:
        lines.append(f"does not fit: {over_budget_message(est)}")
    return "\n".join(lines)
