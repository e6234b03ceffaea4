"""The NPU path: the model's kernels as Hexagon (HVX) object code, and which operators stay on the ARM CPU.

`tvm.compile` with a Hexagon target emits host (x86) code, and a Hexagon host target fails on
`tvm_call_packed`; so the device kernels go through the TIR default pipeline and `target.build.hexagon`
directly. That codegen always asks `tvm.contrib.hexagon.link_shared` for a .so: the hook below keeps the
object it is handed, and links only when the Hexagon SDK is there (HEXAGON_TOOLCHAIN).

With --host-target (`runs_here`) the host side is built too, for that CPU: every NPU kernel's call site becomes a
call of the packed function NPU_FUNCTION names, which the artifact loader (runtime/npu.py) backs with the kernel
running on the emulated DSP (testing/emulated_hexagon.py); the NPU kernels are then built for that DSP, without HVX
float, which QEMU cannot run (emulated_hexagon.emulation_spec).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import shutil
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..errors import MobilecError
from ..passes.expand_npu_math import expand_float_math
from ..passes.ir_walk import relax_nodes, tir_statements
from ..target.targets import TargetSpec
from ..testing import emulated_hexagon
from .pipeline import naming_failures

OBJECT = "hexagon/kernels.o"
SHARED = "hexagon/kernels.so"
# One decode step: the token's embedding, then the step (runtime/session.py, Session.decode); one prefill chunk
# likewise (Session.prefill).
DECODE_STEP = ("embed", "decode")
PREFILL_STEP = ("embed", "prefill")
# The packed function the host build calls for NPU kernel `name` (NPU_FUNCTION + name).
NPU_FUNCTION = "mobilec.npu."
GATHER_KERNEL = "take"  # the embedding's row gather (take, take_dequantize): reads one row of its table a token
_LINK_HOOK = "tvm.contrib.hexagon.link_shared"
# LLVM's Hexagon backend in this TVM has no lowering for these float math intrinsics ("Cannot find intrinsic
# declaration: llvm.sqrt"); passes/expand_npu_math.py rewrites exp, sqrt, rsqrt and sigmoid of float32/float16 into
# arithmetic it lowers; kernels still using one after that run on the CPU.
_NO_NPU_MATH = {"tirx.exp", "tirx.exp2", "tirx.sqrt", "tirx.rsqrt", "tirx.pow", "tirx.log", "tirx.tanh",
                "tirx.sin", "tirx.cos", "tirx.erf", "tirx.sigmoid"}


def runs_here(spec: TargetSpec) -> bool:
    """Whether the host side is built (--host-target), with the NPU kernels for the emulated DSP."""
    return "host_target" in spec.overrides


def host_spec(spec: TargetSpec) -> TargetSpec:
    """The CPU target the host side of `spec` is built for, as a target of its own."""
    return dataclasses.replace(spec, tvm_target_json=dict(spec.tvm_target_json["host"]))


def sdk_linker() -> Path | None:
    linker = Path(os.environ.get("HEXAGON_TOOLCHAIN", "")) / "bin" / "hexagon-link"
    return linker if os.environ.get("HEXAGON_TOOLCHAIN") and os.access(linker, os.X_OK) else None


def _called_kernels(mod: tvm.IRModule) -> set[str]:
    """Kernels a Relax function calls itself; the others are handed to the KV cache, whose C++ code runs
    them on the CPU, or are the VM's shape functions."""
    return {call.op.name_hint for func in mod.functions.values() if isinstance(func, relax.Function)
            for call in relax_nodes(func) if isinstance(call.op, tvm.ir.GlobalVar)
            and isinstance(mod[call.op], tirx.PrimFunc) and not _is_host_function(mod[call.op])}


def _math_ops(func: tirx.PrimFunc) -> set[str]:
    """The intrinsics of _NO_NPU_MATH `func` uses, and "division" for a float division (a compiler-rt call on
    Hexagon, `__hexagon_divsf3`, which the emulated DSP's kernel server lacks)."""
    ops: set[str] = set()
    stack = list(tir_statements(func.body))
    while stack:
        node = stack.pop()
        if isinstance(node, tvm.ir.expr.Call) and isinstance(node.op, tvm.ir.Op) and node.op.name in _NO_NPU_MATH:
            ops.add(node.op.name)
        elif isinstance(node, tirx.Div) and str(node.ty).startswith(("float", "bfloat")):
            ops.add("division")
        for field in ("value", "body", "args", "a", "b", "condition", "true_value", "false_value", "indices"):
            child = getattr(node, field, None)
            children = child if child is not None and type(child).__name__ == "Array" else [child]
            stack.extend(c for c in children if isinstance(c, tirx.Expr))
    return ops


def partition(mod: tvm.IRModule) -> tuple[dict[str, tirx.PrimFunc], dict[str, str]]:
    """(kernels for the NPU, their float math expanded (passes/expand_npu_math.py), {kernel: why it stays on the
    CPU})."""
    called = _called_kernels(mod)
    npu, cpu = {}, {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gv.name_hint
        if _is_host_function(func):
            cpu[name] = "the VM's shape arithmetic (a host function: reads no tensor data)"
        elif name not in called:
            cpu[name] = "not called by the model's functions: run by the KV cache or the VM on the CPU"
        elif math := _math_ops(func := expand_float_math(func)):
            cpu[name] = f"uses {', '.join(sorted(op.split('.')[-1] for op in math))} (no Hexagon lowering)"
        else:
            npu[name] = func
    return npu, cpu


@contextlib.contextmanager
def _keep_object(lib_dir: Path, link: bool):
    """While building, stand in for TVM's link_shared: keep the object; link only with the SDK."""
    previous = tvm_ffi.get_global_func(_LINK_HOOK, allow_missing=True)

    def hook(so_name, objs, extra_args=None):
        obj = str(getattr(objs[0], "value", objs[0]))
        shutil.copyfile(obj, lib_dir / OBJECT)
        if link:
            from tvm.contrib.hexagon import tools  # pylint: disable=import-outside-toplevel

            tools.link_shared(so_name, objs, extra_args)
            shutil.copyfile(so_name, lib_dir / SHARED)
        else:
            shutil.copyfile(obj, so_name)  # the codegen reads "the .so" back; the object stands in
        return 0

    tvm_ffi.register_global_func(_LINK_HOOK, hook, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(_LINK_HOOK, previous, override=True)


def build_object(kernels: dict[str, tirx.PrimFunc], spec: TargetSpec, lib_dir: Path, link: bool) -> None:
    """Compile `kernels` into lib_dir/hexagon/: the object, and with `link` the .so the SDK links."""
    device = {key: value for key, value in spec.tvm_target_json.items() if key != "host"}
    target = tvm.target.Target(device, host=device)  # the kernels' own entry code runs on the DSP too
    mod = tirx.transform.BindTarget(target)(tvm.IRModule({tvm.ir.GlobalVar(n): f for n, f in kernels.items()}))
    lower, finalize_host, _ = tirx.get_default_tir_pipeline(target)
    (lib_dir / OBJECT).parent.mkdir(parents=True, exist_ok=True)
    build = tvm.get_global_func("target.build.hexagon")

    def generate(part: tvm.IRModule):
        return build(finalize_host()(lower(part)), target)

    with target, _keep_object(lib_dir, link), naming_failures("NPU code generation", spec, mod, generate):
        generate(mod)


def build_kernels(lowered: tvm.IRModule, spec: TargetSpec, lib_dir: Path) -> tuple[str, dict[str, Any]]:
    """Compile the NPU kernels into lib_dir/hexagon/ (for the emulated DSP when the host side `runs_here`); returns
    (library path under lib/, coverage report)."""
    npu, cpu = partition(lowered)
    if not npu:
        raise MobilecError(f"no kernel of this model can run on {spec.name}; use an android-* target")
    emulated = runs_here(spec)
    link = sdk_linker() is not None and not emulated  # the SDK links for a real DSP
    build_object(npu, emulated_hexagon.emulation_spec(spec) if emulated else spec, lib_dir, link)
    report = coverage(lowered, set(npu), cpu)
    report["library"] = SHARED if link else OBJECT
    if emulated:
        report["dsp"] = "emulated"
        # which arguments each NPU kernel writes: what the loader copies back from the DSP's memory
        report["npu_writes"] = {name: written_params(func) for name, func in sorted(npu.items())}
    elif not link:
        report["note"] = ("no Hexagon SDK linker (HEXAGON_TOOLCHAIN/bin/hexagon-link): the NPU kernels are left as "
                          f"the object lib/{OBJECT}; set HEXAGON_TOOLCHAIN and recompile for lib/{SHARED}")
    return report["library"], report


# A C-calling kernel's written parameters, where they are more than its last (written_params)
WRITES_ATTR = "mobilec.npu_writes"


def written_params(func: tirx.PrimFunc) -> list[int]:
    """The indices of the buffer parameters `func` stores into, directly or through a view of their memory (a
    decl_buffer on their data); a kernel that stores into none itself (a call_extern into C, kernels/hvx_gemv.py,
    whatever it stores into local scalars) writes those its WRITES_ATTR lists (kernels/hvx_norms.py's two-output
    norm), else its last one, the output as call_tir passes it."""
    if func.attrs is not None and WRITES_ATTR in func.attrs:
        return [int(i) for i in func.attrs[WRITES_ATTR]]
    statements = list(tir_statements(func.body))
    views = [(node.buffer, node.data.args[0]) for node in statements  # (view, the buffer whose memory it is)
             if isinstance(node, tirx.DeclBuffer) and isinstance(node.data, tvm.ir.expr.Call)
             and node.data.op.name == "tirx.buffer_data"]
    stored = [node.buffer for node in statements if isinstance(node, tirx.BufferStore)]
    stored += [source for view, source in views if any(view.same_as(buffer) for buffer in stored)]
    written = [i for i, param in enumerate(func.params) if any(param.same_as(buffer) for buffer in stored)]
    return written or [len(func.params) - 1]


@mutator
class _ForwardToNPU(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, npu: set[str]):
        super().__init__(mod)
        self.npu = npu

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if isinstance(call.op, tvm.ir.GlobalVar) and call.op.name_hint in self.npu:
            return relax.Call(relax.ExternFunc(NPU_FUNCTION + call.op.name_hint), call.args, ty_args=[call.ty])
        return call


def forward_to_npu(lowered: tvm.IRModule, npu: set[str]) -> tvm.IRModule:
    """The host side: `lowered` with each call of an NPU kernel made a call of the packed function NPU_FUNCTION
    names (same arguments, outputs last), and the NPU kernels left out."""
    rewriter = _ForwardToNPU(lowered, npu)
    for gv, func in lowered.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    host = rewriter.builder_.get()
    return tvm.IRModule({gv: func for gv, func in host.functions_items() if gv.name_hint not in npu}, attrs=host.attrs)


def _is_host_function(func: tirx.PrimFunc) -> bool:
    """A PrimFunc the VM runs for shape values (VMShapeLower's shape_func, ComputePrimValue's expressions)."""
    return bool(func.attrs is not None and func.attrs.get("tirx.is_host_func", False))


def _is_shape_builtin(symbol: str) -> bool:
    """A VM builtin that checks, matches or builds shapes, or gives a tensor another shape (vm.builtin.reshape: a view
    of the same memory, prefill's reshapes of its symbolic-length tensors): it reads no tensor data."""
    return symbol.startswith("vm.builtin.check_") or symbol in ("vm.builtin.match_shape", "vm.builtin.make_shape",
                                                                "vm.builtin.reshape")


def coverage(mod: tvm.IRModule, npu: set[str], cpu: dict[str, str]) -> dict[str, Any]:
    """Which operators run where, and what one decode step (DECODE_STEP's functions) and one prefill chunk
    (PREFILL_STEP's) call on each side, per kernel or VM builtin, how often each crosses between NPU and CPU (the
    VM starts and ends it on the CPU) and which side reads each weight. Memory and shape bookkeeping (shape builtins,
    host functions computing shapes) reads no tensor data, so it is not counted: only calls that hand data between
    the DSP and the CPU cross."""
    report: dict[str, Any] = {"npu_kernels": sorted(npu), "cpu_kernels": dict(sorted(cpu.items()))}
    for step, functions in (("decode", DECODE_STEP), ("prefill", PREFILL_STEP)):
        report.update({f"{step}_{key}": value for key, value in _step_coverage(mod, functions, npu, cpu).items()})
    return report


def _step_coverage(mod: tvm.IRModule, functions: tuple[str, ...], npu: set[str], cpu: dict[str, str]
                   ) -> dict[str, Any]:
    """coverage's figures for one call of each of `functions`, in order."""
    sequence: list[tuple[str, str]] = []  # (side, kernel or builtin) in the order they run
    kernels = npu | set(cpu)
    for name in functions:
        for call in relax_nodes(mod[name]):
            if isinstance(call.op, tvm.ir.GlobalVar) and call.op.name_hint in kernels:
                if not _is_host_function(mod[call.op]):
                    sequence.append(("npu" if call.op.name_hint in npu else "cpu", call.op.name_hint))
            elif isinstance(call.op, relax.ExternFunc) and not _is_shape_builtin(str(call.op.global_symbol)):
                sequence.append(("cpu", str(call.op.global_symbol)))  # attention over the paged KV cache
    sides = ["cpu", *(side for side, _ in sequence), "cpu"]
    weight_bytes = {"npu": 0, "cpu": 0}
    for nbytes, rows, readers in _weight_readers(mod, functions, npu, set(cpu)).values():
        # each weight once, on the side of the kernel that multiplies it; read only by the embedding's gather (an
        # untied table), one row of it (as roofline.decode_read counts a decode step's)
        matmul = {side for side, kernel in readers if not kernel.startswith(GATHER_KERNEL)}
        side = "npu" if "npu" in matmul else "cpu" if matmul else readers[0][0]
        weight_bytes[side] += nbytes if matmul else nbytes // rows
    return {
        "npu_calls": sides.count("npu"),
        "cpu_calls": sides.count("cpu") - 2,
        "crossings": sum(a != b for a, b in zip(sides, sides[1:])),
        "calls": {side: dict(sorted(collections.Counter(n for s, n in sequence if s == side).items()))
                  for side in ("npu", "cpu")},
        "weight_bytes": weight_bytes,
    }


def _weight_readers(mod: tvm.IRModule, functions: tuple[str, ...], npu: set[str], cpu: set[str]
                    ) -> dict[int, tuple[int, int, list]]:
    """Each weight `functions` read (by its index in the parameter tuple): (its bytes, its rows, the (side, kernel)
    of each kernel call of theirs that reads it)."""
    found: dict[int, tuple[int, int, list]] = {}
    for name in functions:
        func = mod[name]
        packed = [p for p in func.params if isinstance(p.ty, relax.TupleType)]
        weights = {}  # var -> parameter index
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.TupleGetItem) and any(value.tuple_value.same_as(p) for p in packed):
                    weights[binding.var] = value.index
                elif isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar) and \
                        value.op.name_hint in npu | cpu:
                    side = "npu" if value.op.name_hint in npu else "cpu"
                    for arg in value.args:
                        if arg in weights:
                            shape = [int(d) for d in arg.ty.shape.values]
                            nbytes = math.prod(shape) * tvm.DataType(arg.ty.dtype).bits // 8
                            entry = found.setdefault(weights[arg], (nbytes, shape[0], []))
                            entry[2].append((side, value.op.name_hint))
    return found


def format_coverage(report: dict[str, Any]) -> str:
    lines = [f"NPU (Hexagon HVX): {len(report['npu_kernels'])} kernels: {', '.join(report['npu_kernels'])}",
             f"CPU fallback: {len(report['cpu_kernels'])} kernels, plus the VM builtins (paged-KV-cache attention):"]
    lines += [f"  {name}: {why}" for name, why in report["cpu_kernels"].items()]
    lines.append(f"one decode step: {report['decode_npu_calls']} NPU kernel calls, {report['decode_cpu_calls']} CPU "
                 f"calls, {report['decode_crossings']} NPU<->CPU crossings")
    weights = report["decode_weight_bytes"]
    lines.append(f"weights read per decode step: {weights['npu'] / 1e6:.2f} MB by NPU kernels, "
                 f"{weights['cpu'] / 1e6:.2f} MB by CPU ones "
                 f"({100 * weights['npu'] / max(1, weights['npu'] + weights['cpu']):.1f}% on the NPU)")
    prefill = report["prefill_weight_bytes"]
    lines.append(f"one prefill chunk: {report['prefill_npu_calls']} NPU kernel calls, {report['prefill_cpu_calls']} "
                 f"CPU calls, {report['prefill_crossings']} NPU<->CPU crossings; its matmuls' weights "
                 f"{100 * prefill['npu'] / max(1, prefill['npu'] + prefill['cpu']):.1f}% on the NPU")
    if report.get("dsp") == "emulated":
        lines.append("the NPU kernels are built for the emulated Hexagon DSP (no HVX float) and the host side for "
                     "this CPU: generate, eval, bench, profile and serve run them here under qemu-hexagon")
    return "\n".join(lines)
