"""Our OpenCL device for TVM's runtime (native/opencl/, compiler/runtime/opencl_device.py) on the machine's OpenCL:
PoCL's CPU device here (pocl-opencl-icd 3.1, fp32 only).

Device attributes are compared with pyopencl's view of the same device; copies, kernels built by TVM's OpenCL
codegen (a TIR GEMV, a Relax module through the VM, TVM's paged KV cache) are compared with numpy. Each check has
a negative control: a refused launch, a wrong reference that must not match, a broken kernel that must not build.

Skipped only when no OpenCL platform exists; a library that is not built is a failure that names the build
command (scripts/build_opencl_runtime.sh).
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.s_tir import dlight
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compiler.errors import MobilecError
from compiler.runtime import opencl_device

TARGET = {"kind": "opencl"}


def _cl_platform_devices():
    """pyopencl's pick of the same device as our runtime: GPUs first, else every device of the first platform that
    has one. None when there is no OpenCL platform."""
    import pyopencl as cl

    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return None
    for kind in (cl.device_type.GPU, cl.device_type.ALL):
        for platform in platforms:
            try:
                devices = platform.get_devices(device_type=kind)
            except cl.Error:
                continue
            if devices:
                return devices
    return None


@pytest.fixture(scope="module")
def cl_devices():
    devices = _cl_platform_devices()
    if devices is None:
        pytest.skip("no OpenCL platform: apt-get install pocl-opencl-icd")
    return devices


@pytest.fixture(scope="module")
def dev(cl_devices):
    if not opencl_device.library_path().is_file():
        pytest.fail(f"{opencl_device.library_path()} is not built: run scripts/build_opencl_runtime.sh")
    try:
        opencl_device.load()
    except opencl_device.NoOpenCLPlatform as exc:
        pytest.skip(str(exc))
    return tvm.opencl(0)


def _target(**attrs):
    return tvm.target.Target({**TARGET, **attrs}, host="llvm")


# ---- the device ----


def test_device_attributes_are_the_cl_devices(dev, cl_devices):
    cl_dev = cl_devices[0]
    assert dev.exist
    assert dev.device_name == cl_dev.name
    assert dev.max_threads_per_block == cl_dev.max_work_group_size
    assert dev.max_shared_memory_per_block == cl_dev.local_mem_size
    assert dev.multi_processor_count == cl_dev.max_compute_units
    assert dev.max_clock_rate == cl_dev.max_clock_frequency
    assert dev.total_global_memory == cl_dev.global_mem_size
    assert dev.l2_cache_size_bytes == cl_dev.global_mem_cache_size
    assert dev.driver_version == cl_dev.driver_version
    assert dev.warp_size == 1
    assert list(dev.max_thread_dimensions) == list(cl_dev.max_work_item_sizes)[:3]
    major, minor = cl_dev.version.split()[1].split(".")[:2]
    assert dev.compute_version == f"{major}.{minor}"
    assert dev.api_version == int(major) * 100 + int(minor) * 10
    # Negative control: a device id past the platform's devices does not exist.
    assert not tvm.opencl(len(cl_devices)).exist


def test_load_names_the_build_command_when_the_library_is_missing(tmp_path):
    code = ("from pathlib import Path; from compiler.runtime import opencl_device as o; "
            f"o.LIBRARY = Path({str(tmp_path / 'missing.so')!r}); o.load()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=opencl_device.ROOT,
                         timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("compiler.errors.MobilecError") and "scripts/build_opencl_runtime.sh" in last


# ---- copies ----


def test_copies_round_trip_with_offsets(dev):
    a = np.arange(64, dtype="float32")
    t = tvm.runtime.tensor(a, dev)
    assert t.device == dev
    np.testing.assert_array_equal(t.numpy(), a)
    # A view 8 floats in: reads from byte 32 (from_offset), writes there (to_offset), nothing else changes.
    view = t._create_view((16,), "float32", 8 * 4)
    np.testing.assert_array_equal(view.numpy(), a[8:24])
    view.copyfrom(np.full(16, -1, "float32"))
    expect = a.copy()
    expect[8:24] = -1
    np.testing.assert_array_equal(t.numpy(), expect)
    # Device to device, offsets on both sides.
    other = tvm.runtime.tensor(np.zeros(64, "float32"), dev)
    view.copyto(other._create_view((16,), "float32", 40 * 4))
    want = np.zeros(64, "float32")
    want[40:56] = -1
    np.testing.assert_array_equal(other.numpy(), want)
    whole = tvm.runtime.empty((64,), "float32", dev)
    t.copyto(whole)
    np.testing.assert_array_equal(whole.numpy(), expect)
    # Empty tensors allocate and copy.
    assert tvm.runtime.tensor(np.zeros((0, 3), "float32"), dev).numpy().shape == (0, 3)
    # Negative control: the view really is offset (not the start of the buffer).
    assert not np.array_equal(t._create_view((16,), "float32", 0).numpy(), view.numpy())


# ---- kernels ----


def _gemv(n, k):
    @T.prim_func(s_tir=True)
    def gemv(W: T.Buffer((n, k), "float32"), x: T.Buffer((k,), "float32"), y: T.Buffer((n,), "float32")):
        T.func_attr({"global_symbol": "gemv"})
        for i, j in T.grid(n, k):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SR", [i, j])
                with T.init():
                    y[vi] = T.float32(0)
                y[vi] = y[vi] + W[vi, vj] * x[vj]

    return gemv


def test_gemv_from_an_exported_library(dev, tmp_path):
    n, k = 300, 200  # not multiples of the tiles: the bounds checks run
    target = _target()
    mod = tvm.IRModule({"gemv": _gemv(n, k)})
    with target:
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.GEMV(), dlight.gpu.Fallback())(mod)
    lib = tvm.compile(mod, target=target)
    path = tmp_path / "gemv.so"
    lib.export_library(str(path))
    loaded = tvm.runtime.load_module(str(path))
    (cl_mod,) = [m for m in loaded.imports if m.kind == "opencl"]
    source = cl_mod.inspect_source()
    assert "__kernel" in source and "get_local_id" in source  # a thread-block schedule

    rng = np.random.default_rng(0)
    W = rng.standard_normal((n, k)).astype("float32")
    x = rng.standard_normal(k).astype("float32")
    y = tvm.runtime.tensor(np.full(n, np.nan, "float32"), dev)
    loaded["gemv"](tvm.runtime.tensor(W, dev), tvm.runtime.tensor(x, dev), y)
    np.testing.assert_allclose(y.numpy(), W @ x, rtol=1e-5, atol=1e-4)
    # Negative control: another input's product does not pass the same check.
    assert not np.allclose(y.numpy(), W @ (x + 1), rtol=1e-5, atol=1e-4)


def test_offset_views_reach_kernels_as_element_offsets_and_workspace_is_reused(dev):
    """A cl_mem cannot be offset on the host: a tensor view (byte_offset) reaches a kernel as the whole buffer plus
    an element-offset argument, where the buffer allows an offset (offset_factor); the host code refuses a view
    for a buffer that does not. The intermediate between the two kernels is TVM workspace on the device."""
    n = 256

    @T.prim_func(s_tir=True)
    def two_stage(a: T.handle, b: T.handle):
        T.func_attr({"global_symbol": "two_stage"})
        A = T.match_buffer(a, (n,), "float32", offset_factor=1)
        B = T.match_buffer(b, (n,), "float32")
        C = T.alloc_buffer((n,), "float32")
        for bx in T.thread_binding(n // 64, thread="blockIdx.x"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                with T.sblock("c"):
                    i = T.axis.spatial(n, bx * 64 + tx)
                    C[i] = A[i] * T.float32(2)
        for bx in T.thread_binding(n // 64, thread="blockIdx.x"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                with T.sblock("b"):
                    i = T.axis.spatial(n, bx * 64 + tx)
                    B[i] = C[n - 1 - i] + T.float32(1)

    lib = opencl_device.runnable(tvm.compile(tvm.IRModule({"two_stage": two_stage}), target=_target()))
    assert "elem_offset" in lib.mod.imports[0].inspect_source()
    base_values = np.arange(n + 32, dtype="float32")
    base = tvm.runtime.tensor(base_values, dev)
    out = tvm.runtime.empty((n,), "float32", dev)
    count = tvm.get_global_func("mobilec.opencl.num_workspace_buffers")
    before = count(0)
    for offset in (0, 32):
        lib["two_stage"](base._create_view((n,), "float32", offset * 4), out)
        np.testing.assert_array_equal(out.numpy(), base_values[offset:offset + n][::-1] * 2 + 1)
    dev.sync()
    # The intermediate came from the pool (one buffer at most: the second call reused the first's).
    assert count(0) >= 1 and count(0) - before <= 1
    # Negative control: B has no offset_factor, so a view for it is refused by the compiled host code.
    with pytest.raises(ValueError, match="byte_offset"):
        lib["two_stage"](base._create_view((n,), "float32", 0), base._create_view((n,), "float32", 16))


def _add_one(n, threads):
    @T.prim_func(s_tir=True)
    def add_one(A: T.Buffer((n,), "float32"), B: T.Buffer((n,), "float32")):
        T.func_attr({"global_symbol": "add_one"})
        for bx in T.thread_binding(n // threads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("b"):
                    i = T.axis.spatial(n, bx * threads + tx)
                    B[i] = A[i] + T.float32(1)

    return add_one


def test_a_work_group_over_the_device_limit_is_refused(dev, cl_devices):
    limit = cl_devices[0].max_work_group_size
    n = 4 * limit
    target = _target(max_num_threads=4 * limit)  # TVM's own check would stop it before the runtime sees it
    a = tvm.runtime.tensor(np.arange(n, dtype="float32"), dev)
    b = tvm.runtime.tensor(np.zeros(n, "float32"), dev)
    ok = opencl_device.runnable(tvm.compile(tvm.IRModule({"add_one": _add_one(n, limit)}), target=target))
    ok["add_one"](a, b)  # at the limit: runs
    np.testing.assert_array_equal(b.numpy(), np.arange(n, dtype="float32") + 1)
    over = opencl_device.runnable(tvm.compile(tvm.IRModule({"add_one": _add_one(n, 2 * limit)}), target=target))
    with pytest.raises(RuntimeError, match=rf"OpenCL kernel add_one_kernel: a work-group of {2 * limit} work-items"):
        over["add_one"](a, b)


def test_local_memory_over_the_device_limit_is_refused(dev, cl_devices):
    floats = cl_devices[0].local_mem_size // 4 + 1024
    stride = floats // 63  # TVM shrinks a buffer to the region used: use all of it

    @T.prim_func(s_tir=True)
    def big_local(A: T.Buffer((64,), "float32"), B: T.Buffer((64,), "float32")):
        T.func_attr({"global_symbol": "big_local"})
        for bx in T.thread_binding(1, thread="blockIdx.x"):
            with T.sblock("outer"):
                S = T.sblock_alloc_buffer((floats,), "float32", scope="shared")
                for tx in T.thread_binding(64, thread="threadIdx.x"):
                    with T.sblock("store"):
                        i = T.axis.spatial(64, tx)
                        S[i * stride] = A[i]
                for tx in T.thread_binding(64, thread="threadIdx.x"):
                    with T.sblock("load"):
                        i = T.axis.spatial(64, tx)
                        B[i] = S[i * stride]

    target = _target(max_shared_memory_per_block=1 << 30)
    lib = opencl_device.runnable(tvm.compile(tvm.IRModule({"big_local": big_local}), target=target))
    a, b = tvm.runtime.tensor(np.ones(64, "float32"), dev), tvm.runtime.empty((64,), "float32", dev)
    with pytest.raises(RuntimeError, match=r"OpenCL kernel big_local_kernel uses \d+ bytes of local memory"):
        lib["big_local"](a, b)


def _module_bytes(source: str, kernels: dict[str, tuple[list[tuple[int, int]], list[str]]]) -> bytes:
    """An "opencl" module in TVM's format (native/opencl/opencl_module.cc): fmt, function infos, source."""

    def string(s):
        data = s.encode()
        return struct.pack("<Q", len(data)) + data

    out = string("cl") + struct.pack("<Q", len(kernels))
    for name, (arg_types, tags) in kernels.items():
        out += string(name) + string(name) + struct.pack("<Q", len(arg_types))
        out += b"".join(struct.pack("<BBH", code, bits, 1) for code, bits in arg_types)
        out += struct.pack("<Q", len(tags)) + b"".join(string(t) for t in tags)
        out += struct.pack("<Q", len(arg_types)) + b"\0\0\0\0" * len(arg_types)
    return out + string(source)


HANDLE, INT32, FLOAT32 = (3, 64), (0, 32), (2, 32)


def test_a_module_from_bytes_passes_scalars_and_a_broken_kernel_shows_its_build_log(dev):
    load = tvm.get_global_func("ffi.Module.load_from_bytes.opencl")
    source = ("// Function: axpb\n__kernel void axpb(__global float* x, __global float* y, float a, int b) {\n"
              "  int i = get_group_id(0) * get_local_size(0) + get_local_id(0);\n  y[i] = a * x[i] + b;\n}\n")
    mod = load(_module_bytes(source, {"axpb": ([HANDLE, HANDLE, FLOAT32, INT32], ["blockIdx.x", "threadIdx.x"])}))
    assert mod.kind == "opencl" and mod.inspect_source() == source
    x = tvm.runtime.tensor(np.arange(32, dtype="float32"), dev)
    y = tvm.runtime.empty((32,), "float32", dev)
    mod["axpb"](x, y, 0.5, 3, 4, 8)  # 4 groups of 8
    np.testing.assert_allclose(y.numpy(), 0.5 * np.arange(32) + 3)
    mod["axpb"](x, y, 2.0, 0, 0, 8)  # no groups (a dynamic extent of 0): nothing runs
    np.testing.assert_allclose(y.numpy(), 0.5 * np.arange(32) + 3)
    assert mod.implements_function("axpb") and not mod.implements_function("other")

    broken = load(_module_bytes("// Function: bad\n__kernel void bad(__global float* x) { x[0] = undefined_name; }\n",
                                {"bad": ([HANDLE], ["threadIdx.x"])}))
    with pytest.raises(RuntimeError, match=r"(?s)clBuildProgram: CL_BUILD_PROGRAM_FAILURE for kernel bad.*"
                                           r"build log:.*undefined_name"):
        broken["bad"](x, 1)
    with pytest.raises(RuntimeError, match="truncated or corrupt"):
        load(_module_bytes(source, {"axpb": ([HANDLE], ["threadIdx.x"])})[:-10])


# ---- Relax through the VM ----


@I.ir_module
class MatmulAddSum:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64, 48), "float32"), b: R.Tensor((48,), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.add(y, b)
            s = R.sum(z, axis=1)
            R.output(z, s)
        return (z, s)


def test_relax_module_on_the_vm(dev, tmp_path):
    target = _target()
    with target:
        mod = relax.transform.LegalizeOps()(MatmulAddSum)
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(),
                                          dlight.gpu.GeneralReduction(), dlight.gpu.Fallback())(mod)
    ex = tvm.compile(mod, target=target)
    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(s).astype("float32") for s in ((4, 64), (64, 48), (48,)))
    z_ref = x @ w + b
    args = [tvm.runtime.tensor(v, dev) for v in (x, w, b)]
    # In memory (the codegen's placeholder replaced by our module), then exported from there (our module's bytes)
    # and loaded back.
    opencl_device.runnable(ex)
    path = tmp_path / "relax.so"
    ex.export_library(str(path))
    for runnable in (ex, tvm.runtime.load_module(str(path))):
        z, s = relax.VirtualMachine(runnable, dev)["main"](*args)
        np.testing.assert_allclose(z.numpy(), z_ref, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(s.numpy(), z_ref.sum(1), rtol=1e-5, atol=1e-3)
    # Negative control: without the bias the same check fails.
    assert not np.allclose(z.numpy(), x @ w, rtol=1e-5, atol=1e-4)


# ---- TVM's paged KV cache, as an LLM uses it ----

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _attention_module():
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
    from tvm.target import Target

    class Attention(nn.Module):
        def forward(self, qkv: nn.Tensor, kv_cache: PagedKVCache):
            return kv_cache.attention_with_fused_qkv(0, qkv, HEADS, sm_scale=1.0 / math.sqrt(HEAD_DIM))

        def create_tir_paged_kv_cache(self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                                      support_sliding_window):
            return TIRPagedKVCache(
                attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size, page_size=page_size,
                support_sliding_window=support_sliding_window, layer_partition=relax.ShapeExpr([0, 1]),
                num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
                rope_mode=RopeMode.NONE, rope_scale=1, rope_theta=10000, rope_scaling={},
                rope_ext_factors=relax.prim_value(0), rotary_dim=HEAD_DIM, enable_disaggregation=False,
                dtype="float32", target=Target.current())

    spec = nn.spec.ModuleSpec.from_raw({
        "forward": {"qkv": nn.spec.Tensor([1, "seq_len", HEADS + 2 * KV_HEADS, HEAD_DIM], "float32"),
                    "kv_cache": nn.spec.Object(object_type=PagedKVCache),
                    "$": {"param_mode": "packed", "effect_mode": "none"}},
        "create_tir_paged_kv_cache": {"max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int,
                                      "page_size": int, "support_sliding_window": int,
                                      "$": {"param_mode": "none", "effect_mode": "none"}},
    }, Attention())
    return Attention().export_tvm(spec=spec)[0]


def _causal_attention(q, k, v, causal=True):
    """q [n, heads, d]: the last n positions of k, v [length, kv_heads, d]; grouped-query, softmax(q k^T / sqrt d)."""
    n, length = q.shape[0], k.shape[0]
    out = np.zeros_like(q)
    for h in range(HEADS):
        kh = h // (HEADS // KV_HEADS)
        s = q[:, h] @ k[:, kh].T / math.sqrt(HEAD_DIM)
        if causal:
            for i in range(n):
                s[i, length - n + i + 1:] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ v[:, kh]
    return out


def test_paged_kv_cache_prefill_then_decode(dev, monkeypatch):
    """A prefill of 5 tokens into an empty cache, then 2 decode steps that read it back from its pages.

    Not here: a prefill into a cache that already holds tokens. It merges two partial attentions with TVM's
    tir_attention_merge_state kernel, whose threads read a score another thread of the work-group has overwritten
    (no barrier between; a GPU's lock-step warp hides it, PoCL runs work-items one after another), so it is wrong on
    PoCL whatever the runtime. And PoCL 3.1's optimizer miscompiles the first-prefill kernel
    (batch_prefill_ragged_kv: the V tile in local memory stays zero), so kernels build here with -cl-opt-disable.
    Both reproduce with pyopencl alone.
    """
    monkeypatch.setenv("MOBILEC_OPENCL_BUILD_OPTIONS", "-cl-opt-disable")
    target = _target()
    with target:
        mod = relax.transform.LegalizeOps()(_attention_module())
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.Fallback())(mod)
    vm = relax.VirtualMachine(opencl_device.runnable(tvm.compile(mod, target=target)), dev)
    shape = tvm.runtime.ShapeTuple
    # batch 1, 64 tokens, prefill chunk 16, pages of 16 tokens, no sliding window
    cache = vm["create_tir_paged_kv_cache"](shape([1]), shape([64]), shape([16]), shape([16]), shape([0]))
    tvm.get_global_func("vm.builtin.kv_state_add_sequence")(cache, 0)
    begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
    end = tvm.get_global_func("vm.builtin.kv_state_end_forward")
    rng = np.random.default_rng(2)
    keys, values = [], []
    for n in (5, 1, 1):
        qkv = rng.standard_normal((1, n, HEADS + 2 * KV_HEADS, HEAD_DIM)).astype("float32")
        q, k, v = qkv[0, :, :HEADS], qkv[0, :, HEADS:HEADS + KV_HEADS], qkv[0, :, HEADS + KV_HEADS:]
        keys.append(k)
        values.append(v)
        begin(cache, shape([0]), shape([n]))
        out = vm["forward"](tvm.runtime.tensor(qkv, dev), cache, []).numpy()[0]
        end(cache)
        want = _causal_attention(q, np.concatenate(keys), np.concatenate(values))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"step of {n} token(s)")
    # Negative control: attention that forgets the causal mask (prefill) / the cache (decode) does not match.
    assert not np.allclose(out, _causal_attention(q, k, v), rtol=1e-5, atol=1e-5)
