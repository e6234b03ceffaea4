"""Run a PrimFunc's OpenCL kernels on PoCL (the CPU OpenCL of Debian's `pocl-opencl-icd`) through pyopencl.

TVM's runtime wheel cannot launch OpenCL, so this harness does the host side itself: it builds the PrimFunc for
an OpenCL target, reads the launches from the host function as it is just before `tirx.MakePackedAPI` (each
`call_ffi_kernel(name, args..., extents)` gives kernel order, argument order and launch extents, with
`launch_params` naming the extents; global size = grid x block), takes the OpenCL source from the device module
imported under the host module, and enqueues the kernels in order with concrete shapes.

PoCL 3.1 has no cl_khr_fp16 and no subgroups, so only fp32 kernels run on it (float16 buffers only as
passes/vload_half.py reads them, built inside its `opencl_half_pointers`); float16 kernels run on Intel's CPU
runtime (`platform=INTEL`). Both accept work-group sizes a real GPU refuses, so device limits are checked
elsewhere (compiler/passes/verify_device_limits.py).
`reference_llvm` runs a PrimFunc built for the CPU on the same arrays, for comparison.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tvm
from tvm import tirx
from tvm.sym.analyzer import Analyzer

from ..passes.ir_walk import tir_statements
from ..runtime import opencl_device


class Unsupported(Exception):
    """The harness cannot run this PrimFunc (the reason is the message)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str
    args: tuple  # PrimExprs: buffer data (a call on the parameter buffer) or scalars
    launch_params: tuple[str, ...]
    extents: tuple  # PrimExprs, one per launch param


@dataclasses.dataclass(frozen=True)
class OpenCLBuild:
    func: tirx.PrimFunc
    source: str
    launches: tuple[Launch, ...]
    host: tirx.PrimFunc  # host side before MakePackedAPI


def is_buffer(param) -> bool:
    return isinstance(param.ty, tirx.BufferType)


def _host_llvm(target: tvm.target.Target) -> tvm.target.Target:
    """The device target with this machine's LLVM as host: only the host IR is read, never run."""
    device = {k: v for k, v in target.export().items() if k != "host"}
    return tvm.target.Target(device, host="llvm")


def build_opencl(func: tirx.PrimFunc, target: tvm.target.Target) -> OpenCLBuild:
    """Build a scheduled PrimFunc for an OpenCL target; return its OpenCL source and launches."""
    if target.kind.name != "opencl":
        raise ValueError(f"not an OpenCL target: {target}")
    captured = {}

    @tvm.instrument.pass_instrument
    class _Capture:
        def run_before_pass(self, mod, info):
            if info.name == "tirx.MakePackedAPI":
                captured["host"] = mod

    func = func.with_attr("global_symbol", "main")
    with tvm.transform.PassContext(opt_level=3, instruments=[_Capture()]):
        built = tvm.compile(tvm.IRModule({"main": func}), target=_host_llvm(target))
    module = built.mod if hasattr(built, "mod") else built
    sources = [m.inspect_source() for m in module.imports if m.kind == "opencl"]
    if len(sources) != 1:
        raise Unsupported(f"expected one OpenCL module under the host module, found {len(sources)}")
    host = captured["host"]["main"]
    launches = []
    for stmt in tir_statements(host.body):
        if not isinstance(stmt, tirx.Evaluate) or not isinstance(stmt.value, tvm.ir.Call):
            continue
        call = stmt.value
        if not isinstance(call.op, tvm.ir.Op) or call.op.name != "tirx.call_ffi_kernel":
            continue
        params = tuple(str(p) for p in call.attrs.launch_params)
        n_ext = len(params)
        args = tuple(call.args[1:len(call.args) - n_ext])
        launches.append(Launch(str(call.args[0].value), args, params, tuple(call.args[len(call.args) - n_ext:])))
    if not launches:
        raise Unsupported("no kernel launch in the host function")
    return OpenCLBuild(func, sources[0], tuple(launches), host)


def shape_vars(func: tirx.PrimFunc) -> dict[str, tirx.Var]:
    """The symbolic dimensions of the PrimFunc's buffer parameters, by name."""
    found = {}
    for param in func.params:
        if is_buffer(param):
            for dim in param.shape:
                for var in tirx.analysis.undefined_vars(dim) if not isinstance(dim, tirx.IntImm) else ():
                    found[var.name] = var
    return found


def _analyzer(func: tirx.PrimFunc, bindings: Mapping[str, int]) -> Analyzer:
    ana = Analyzer()
    for name, var in shape_vars(func).items():
        if name not in bindings:
            raise Unsupported(f"no value given for the dynamic dimension {name}")
        ana.bind(var, tirx.const(int(bindings[name]), var.ty.dtype if hasattr(var.ty, "dtype") else "int64"))
    for param in func.params:
        if is_buffer(param) and isinstance(param.elem_offset, tirx.Var):  # arrays here start at offset 0
            ana.bind(param.elem_offset, tirx.const(0, str(param.elem_offset.ty.dtype)))
        if not is_buffer(param) and param.name in bindings:
            ana.bind(param, tirx.const(bindings[param.name], str(param.ty.dtype)))
    return ana


def _const(ana: Analyzer, expr) -> int | float:
    value = ana.simplify(expr)
    if isinstance(value, tirx.IntImm):
        return int(value.value)
    if isinstance(value, tirx.FloatImm):
        return float(value.value)
    raise Unsupported(f"cannot evaluate {expr} with the given dimensions (got {value})")


def concrete_shape(param, ana: Analyzer) -> tuple[int, ...]:
    return tuple(_const(ana, d) for d in param.shape)


def random_args(func: tirx.PrimFunc, bindings: Mapping[str, int], rng: np.random.Generator,
                int_high: int = 64) -> list[np.ndarray | int | float]:
    """One argument per PrimFunc parameter: random normal floats, random ints in [0, int_high), random
    uint8 bytes (packed weights); scalar parameters from `bindings` (default 1)."""
    ana = _analyzer(func, bindings)
    out = []
    for param in func.params:
        if not is_buffer(param):
            value = bindings.get(param.name, 1)
            out.append(float(value) if "float" in str(param.ty.dtype) else int(value))
            continue
        shape, dtype = concrete_shape(param, ana), str(param.dtype)
        if dtype.startswith("float"):
            out.append(rng.standard_normal(shape).astype(dtype))
        elif dtype == "uint8":
            out.append(rng.integers(0, 256, size=shape).astype(np.uint8))
        elif dtype.startswith(("int", "uint")):
            out.append(rng.integers(0, int_high, size=shape).astype(dtype))
        else:
            raise Unsupported(f"parameter {param.name} has dtype {dtype}")
    return out


POCL = "Portable Computing Language"
INTEL = "Intel(R) OpenCL"  # Intel's CPU runtime: cl_khr_fp16, so float16 kernels run (scripts/setup.sh installs it)
_INSTALL = {POCL: "apt-get install pocl-opencl-icd",
            INTEL: "run scripts/setup.sh (it installs intel-opencl-rt into .venv and registers it)"}


@functools.lru_cache(maxsize=2)
def _context(platform: str = POCL):
    import pyopencl as cl  # pylint: disable=import-outside-toplevel

    opencl_device.use_installed_platforms()
    platforms = [p for p in cl.get_platforms() if platform in p.name]
    if not platforms:
        raise Unsupported(f"the OpenCL platform {platform!r} is not installed ({_INSTALL.get(platform, '')})")
    ctx = cl.Context(platforms[0].get_devices())
    # profiling on, so a run can report each kernel's device time (run_pocl's `times`)
    return ctx, cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)


@functools.lru_cache(maxsize=256)
def _program(source: str, platform: str):
    import pyopencl as cl  # pylint: disable=import-outside-toplevel

    ctx, _ = _context(platform)
    return {kernel.function_name: kernel for kernel in cl.Program(ctx, source).build().all_kernels()}


def _sizes(launch: Launch, ana: Analyzer) -> tuple[list[int], list[int]]:
    grid, block = [1, 1, 1], [1, 1, 1]
    for tag, extent in zip(launch.launch_params, launch.extents):
        axis = "xyz".index(tag[-1]) if tag[-1] in "xyz" else None
        if tag.startswith("blockIdx.") and axis is not None:
            grid[axis] = _const(ana, extent)
        elif tag.startswith("threadIdx.") and axis is not None:
            block[axis] = _const(ana, extent)
        else:
            raise Unsupported(f"kernel {launch.kernel}: launch parameter {tag} is not handled")
    return [g * b for g, b in zip(grid, block)], block


LaunchHook = Callable[[str, list[int], list[int]], tuple[list[int], list[int]]]


def _views_of_parameters(host: tirx.PrimFunc) -> dict[str, str]:
    """Buffers the host function declares over another buffer's data (views such as a quantized KV cache's code
    view of its float32 pages), by name -> the name of that buffer: a kernel given the view gets that memory."""
    views = {}
    for stmt in tir_statements(host.body):
        data = stmt.data if isinstance(stmt, tirx.DeclBuffer) else None
        if isinstance(data, tvm.ir.Call) and data.args and is_buffer(data.args[0]):
            views[stmt.buffer.name] = data.args[0].name
    return views


def run_pocl(build: OpenCLBuild, args: Sequence, bindings: Mapping[str, int],
             launch_hook: LaunchHook | None = None, platform: str = POCL,
             times: list[tuple[str, float]] | None = None) -> list[np.ndarray | int | float]:
    """Run the build's kernels in order on PoCL (or another platform, by name: INTEL for float16); return every
    argument after the run (buffers copied back). `launch_hook(kernel, global_size, local_size)` may change a
    launch (negative controls); `times` gets (kernel, device seconds) per launch, from OpenCL event profiling."""
    import pyopencl as cl  # pylint: disable=import-outside-toplevel

    ctx, queue = _context(platform)
    func = build.func
    ana = _analyzer(func, bindings)
    by_name = {p.name: i for i, p in enumerate(func.params)}
    by_name.update({view: by_name[param] for view, param in _views_of_parameters(build.host).items()
                    if param in by_name})
    device: dict[int, cl.Buffer] = {}
    for i, (param, value) in enumerate(zip(func.params, args)):
        if is_buffer(param):
            host = np.ascontiguousarray(value)
            device[i] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                  size=max(host.nbytes, 4), hostbuf=host if host.nbytes else np.zeros(1, "int32"))
        else:
            ana.bind(param, tirx.const(value, str(param.ty.dtype)))
    for stmt in tir_statements(build.host.body):  # host-side lets (common subexpressions of launch extents)
        if isinstance(stmt, (tirx.Bind, tirx.LetStmt)):
            try:
                ana.bind(stmt.var, tirx.const(_const(ana, stmt.value), str(stmt.var.ty.dtype)))
            except (Unsupported, AttributeError):
                pass
    program = _program(build.source, platform)
    for launch in build.launches:
        kernel_args = []
        for arg in launch.args:
            if isinstance(arg, tvm.ir.Call) and arg.args and is_buffer(arg.args[0]) and "data" in arg.op.name:
                index = by_name.get(arg.args[0].name)
                if index is None:
                    raise Unsupported(f"kernel {launch.kernel}: argument {arg} is not a parameter buffer "
                                      f"(host-side workspace)")
                kernel_args.append(device[index])
            else:
                dtype = str(arg.ty.dtype) if hasattr(arg.ty, "dtype") else None
                if dtype is None or dtype == "handle":
                    raise Unsupported(f"kernel {launch.kernel}: argument {arg} is not handled")
                kernel_args.append(np.dtype(dtype).type(_const(ana, arg)))
        global_size, local_size = _sizes(launch, ana)
        if launch_hook is not None:
            global_size, local_size = launch_hook(launch.kernel, global_size, local_size)
        event = program[launch.kernel](queue, global_size, local_size, *kernel_args)
        if times is not None:
            event.wait()
            times.append((launch.kernel, (event.profile.end - event.profile.start) * 1e-9))
    results = []
    for i, value in enumerate(args):
        if i in device:
            out = np.empty_like(np.ascontiguousarray(value))
            if out.nbytes:
                cl.enqueue_copy(queue, out, device[i])
            results.append(out)
        else:
            results.append(value)
    queue.finish()
    return results


@functools.lru_cache(maxsize=256)
def _llvm_build(func: tirx.PrimFunc):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")


def reference_llvm(func: tirx.PrimFunc, args: Sequence) -> list[np.ndarray | int | float]:
    """Run an (unscheduled or CPU-scheduled) PrimFunc built for this machine's CPU; return every argument after."""
    built = _llvm_build(func)
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a for a in args]
    built["main"](*tensors)
    return [t.numpy() if isinstance(a, np.ndarray) else t for t, a in zip(tensors, args)]


def max_abs_error(got: Sequence, want: Sequence) -> tuple[float, float]:
    """(max abs error, max abs reference value) over the float buffer arguments (outputs included: inputs come
    back unchanged from both runs); integer buffers must match exactly or the error is inf."""
    err, scale = 0.0, 0.0
    for g, w in zip(got, want):
        if isinstance(w, np.ndarray) and w.size and w.dtype.kind != "f":
            err = err if np.array_equal(g, w) else math.inf
        elif isinstance(w, np.ndarray) and w.size:
            diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
            err = max(err, float(np.nanmax(diff)) if not np.isnan(diff).any() else math.inf)
            scale = max(scale, float(np.max(np.abs(w.astype(np.float64)))))
    return err, scale
