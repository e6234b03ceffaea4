"""Time the CPU prefill attention kernels (kernels/cpu_attention.py) on a chat turn's shape: --new tokens against
--cached ones (the paged kernel) and among themselves (the ragged one, causal), SmolLM2's 9 query heads, 3 KV heads,
head_dim 64, float16 pages of 16. Two steps, so that two versions of the kernels run side by side in one process:
`--export LIB.so` builds the kernels of the `compiler` package on PYTHONPATH for --target (register tiles for the
kernels' default of 16 vector registers, AVX2's); then the libraries given run interleaved, --repeat rounds of 5
calls each, and the median ms a call (one layer) is printed with its range: wall time, and the CPU time of this
thread, which with TVM_NUM_THREADS=1 (the kernels then run on it) is the kernel's work whatever else the machine
runs.

    PYTHONPATH=/path/to/before python bench/prefill_attention_kernels.py --export before.so
    PYTHONPATH=$PWD python bench/prefill_attention_kernels.py --export after.so
    TVM_NUM_THREADS=1 PYTHONPATH=$PWD python bench/prefill_attention_kernels.py before.so after.so --repeat 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import tvm

H_KV, H_QO, D, PAGE = 3, 9, 64, 16


def export(path: str, target: str, dtype: str) -> None:
    from compiler.kernels.cpu_attention import (AttentionShape, attention_prefill_paged, attention_prefill_ragged,
                                                vector_lanes)

    target = tvm.target.Target(json.loads(target))
    lanes = vector_lanes(target)
    shape = AttentionShape(H_KV, H_QO, D, dtype, PAGE)
    mod = tvm.IRModule({"paged": attention_prefill_paged(shape, lanes).with_attr("global_symbol", "paged"),
                        "ragged": attention_prefill_ragged(shape, lanes).with_attr("global_symbol", "ragged")})
    tvm.tirx.build(mod, target=target).export_library(path)


def arguments(new: int, cached: int, dtype: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    pages = -(-cached // PAGE)
    q = tvm.runtime.tensor((2 * rng.standard_normal((new, H_QO, D))).astype(dtype))
    k = tvm.runtime.tensor(rng.standard_normal((new, H_KV, D)).astype(dtype))
    v = tvm.runtime.tensor(rng.standard_normal((new, H_KV, D)).astype(dtype))
    store = tvm.runtime.tensor(rng.standard_normal((pages + 3, 2, H_KV, PAGE, D)).astype(dtype))
    i32 = lambda *x: tvm.runtime.tensor(np.array(x, "int32"))  # noqa: E731
    out = tvm.runtime.empty((new, H_QO, D), dtype)
    lse = tvm.runtime.empty((new, H_QO), "float32")
    position = tvm.runtime.tensor(np.arange(new, dtype="int32") + cached)
    paged = (q, i32(0, new), store, i32(0, pages), tvm.runtime.tensor(rng.permutation(pages + 3)[:pages].astype("int32")),
             i32(cached - (pages - 1) * PAGE), i32(0), position, out, lse, 0, 0, 1.0, 10000.0, 1 / np.sqrt(D))
    ragged = (q, i32(0, new), k, v, i32(0, new), position, i32(0), out, lse, 1, 0, 1.0, 10000.0, 1 / np.sqrt(D))
    return {"paged": paged, "ragged": ragged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="*")
    parser.add_argument("--export")
    parser.add_argument("--target", default='{"kind": "llvm", "mcpu": "x86-64-v3", "mtriple": "x86_64-unknown-linux-gnu"}',
                        help="a TVM target, JSON (default: x86-64-v3, AVX2)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--new", type=int, default=301)
    parser.add_argument("--cached", type=int, default=1328)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    if args.export:
        export(args.export, args.target, args.dtype)
        return
    libs = [tvm.runtime.load_module(path) for path in args.libraries]
    calls = arguments(args.new, args.cached, args.dtype)
    wall: dict = {(path, kernel): [] for path in args.libraries for kernel in calls}
    cpu: dict = {key: [] for key in wall}
    for _ in range(args.repeat):
        for path, lib in zip(args.libraries, libs):
            for kernel, call in calls.items():
                lib[kernel](*call)  # warm
                start, cpu_start = time.perf_counter(), time.thread_time()
                for _ in range(5):
                    lib[kernel](*call)
                wall[path, kernel].append((time.perf_counter() - start) / 5 * 1e3)
                cpu[path, kernel].append((time.thread_time() - cpu_start) / 5 * 1e3)
    for key in wall:
        print(f"{key[0]} {key[1]}, ms a layer, medians of {args.repeat} rounds (min-max): wall "
              f"{statistics.median(wall[key]):.2f} ({min(wall[key]):.2f}-{max(wall[key]):.2f}), CPU of this thread "
              f"{statistics.median(cpu[key]):.2f} ({min(cpu[key]):.2f}-{max(cpu[key]):.2f})")


if __name__ == "__main__":
    main()
