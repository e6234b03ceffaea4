"""Attention over a float16 paged KV cache, as the phones run it, on Intel's OpenCL CPU runtime (the platform here
with cl_khr_fp16) against numpy: softmax(q k^T * sm_scale) v in float64 with the causal mask and GQA, the keys read
through the page table as TVM's runtime lays them out (pages [page, K/V, KV head, row, channel], a sequence's pages
page_values[page_indptr[b]:page_indptr[b + 1]], length_info[b] rows used in its last page).

The kernels: TVM's decode, paged prefill and ragged prefill as SmolLM2's float16 adreno build has them (what a model
without a window or capped scores runs), and ours (kernels/gpu_attention.py), which ReplaceGPUAttention puts in
their place on a float16 cache for a model with a window or capped scores (here with both: window 24, cap 5); the
merge of attention states, ours on every GPU build. Our split + RoPE + quantize and carrier merge serve only the
int8/int4 caches (float32 carriers: tests/kernels/test_gpu_attention_quantized.py).

Tolerance: the kernels read float16 and compute in float32 (u32 = 2^-24), storing float16 (unit roundoff u = 2^-11):
the store is off by at most 2 u |out| (one rounding, of any mode); the float32 scores, sums of D products, by
~8 sqrt(D) u32 max|s| each, which moves an output by at most twice that times max|v| (the softmax's derivative);
the weighted sum of L values by ~8 sqrt(L) u32 max|v|. lse (float32, log2 units) gets the score and sum terms. A
wrong page, head, scale or mask moves outputs by more (negative controls)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from tvm import tirx

from compiler.kernels.gpu_attention import (
    gpu_attention_decode,
    gpu_attention_prefill_paged,
    gpu_attention_prefill_ragged,
)
from compiler.passes.replace_cpu_attention import decode_shape
from compiler.testing import pocl
from tests.helpers.pocl_device import NEEDS_X86_FOR_FP16, fp16_platform_installed
from tests.helpers.scheduled_kernels import kernels

pytestmark = [pytest.mark.slow, NEEDS_X86_FOR_FP16]

U16, U32 = 2.0 ** -11, 2.0 ** -24
LOG2E = math.log2(math.e)
CTX = [37, 20]  # cached keys of two sequences: three pages (the last one part full) and two
PREFILL = [7, 5]  # new rows per sequence in a prefill
# ours: a window (the first sequence outgrows it) and a cap (scores here reach ~8; capping at 5 changes the large)
WINDOW, CAP = 24, 5.0
TVM_NAMES = {"decode": "batch_decode_paged_kv", "paged": "batch_prefill_paged_kv", "ragged": "batch_prefill_ragged_kv"}


def _tvm_kernels():
    """(spec, {name: TVM's PrimFunc}) as SmolLM2's float16 adreno build schedules them."""
    spec, pairs = kernels("android-adreno", "q4f16_g32", "float16")
    return spec, {name: pairs[name][0] for name in [*TVM_NAMES.values(), "tir_attention_merge_state"]}


@functools.cache
def _kernel(which: str, kind: str) -> tuple[tirx.PrimFunc, int, float]:
    """(PrimFunc, window, cap) of TVM's or our (kind) decode, paged or ragged prefill; ours for the cache TVM's
    were built for, as ReplaceGPUAttention builds them for a model with a window and capped scores."""
    if which == "tvm":
        return _tvm_kernels()[1][TVM_NAMES[kind]], 0, 0.0
    shape = decode_shape(_tvm_kernels()[1][TVM_NAMES["decode"]])
    assert shape is not None and shape.dtype == "float16", shape
    build = {"decode": gpu_attention_decode, "paged": gpu_attention_prefill_paged,
             "ragged": gpu_attention_prefill_ragged}[kind]
    return build(shape, window=WINDOW, logit_cap=CAP), WINDOW, CAP


@functools.cache
def _build(func: tirx.PrimFunc) -> pocl.OpenCLBuild:
    return pocl.build_opencl(func, _tvm_kernels()[0].tvm_target())


def _run(func: tirx.PrimFunc, args: list) -> list:
    """Every argument after a run on Intel's runtime; the symbolic sizes read from the arrays."""
    sizes = {}
    for param, value in zip(func.params, args):
        if pocl.is_buffer(param):
            sizes.update({dim.name: n for dim, n in zip(param.shape, value.shape) if isinstance(dim, tirx.Var)})
    return pocl.run_pocl(_build(func), args, sizes, platform=pocl.INTEL)


def _cache(seed: int) -> dict:
    """Sequences of CTX keys in shuffled pages (two spare), NaN in the rows past each sequence's end (a kernel that
    reads them fails), float16 queries for decode and prefill, and the new rows' K and V of a ragged prefill."""
    rng = np.random.default_rng(seed)
    decode = _tvm_kernels()[1][TVM_NAMES["decode"]]
    _, kv_heads, page, dim = (int(x) for x in decode.params[1].shape[1:])  # pages [page, 2, KV head, row, D]
    heads = int(decode.params[0].shape[1])  # Q [B, heads, D]
    n_pages = [-(-c // page) for c in CTX]
    pages = rng.standard_normal((sum(n_pages) + 2, 2, kv_heads, page, dim)).astype("float16")
    values = rng.permutation(len(pages))[:sum(n_pages)].astype("int32")
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype("int32")
    last = np.array([c - (n - 1) * page for c, n in zip(CTX, n_pages)], "int32")
    for s, n in enumerate(n_pages):
        pages[values[indptr[s] + n - 1], :, :, last[s]:] = np.nan
    rows = sum(PREFILL)
    return {"pages": pages, "values": values, "indptr": indptr, "last": last, "page": page,
            "q_decode": (2 * rng.standard_normal((len(CTX), heads, dim))).astype("float16"),
            "q": (2 * rng.standard_normal((rows, heads, dim))).astype("float16"),
            "q_indptr": np.concatenate([[0], np.cumsum(PREFILL)]).astype("int32"),
            "k": rng.standard_normal((rows, kv_heads, dim)).astype("float16"),
            "v": rng.standard_normal((rows, kv_heads, dim)).astype("float16"),
            "sm_scale": 1 / math.sqrt(dim)}


def _paged_rows(cache: dict, s: int, kv: int) -> np.ndarray:
    """K (kv 0) or V (kv 1) of sequence s's keys [L, KV heads, D], read through the page table."""
    ids = cache["values"][cache["indptr"][s]:cache["indptr"][s + 1]]
    length = (len(ids) - 1) * cache["page"] + cache["last"][s]
    rows = cache["pages"][ids, kv].transpose(0, 2, 1, 3)  # [page, row, KV head, D]
    return rows.reshape(-1, *rows.shape[2:])[:length]


def _numpy_attention(q, q_indptr, keys, values, end_aligned: bool, sm_scale: float, window: int, cap: float):
    """(out, lse in log2 units, max |score|, max |v|, most keys seen) in float64. Row i of n new rows of a sequence
    with L keys is at position L - n + i (`end_aligned`: the keys end with the new rows) or L + i (all before them)
    and sees the keys up to its own, the last `window` of them with a window; query head h reads KV head
    h // (heads / KV heads); capped scores are cap * tanh(s / cap)."""
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    top_score = top_v = most = 0.0
    group = q.shape[1] // keys[0].shape[1]
    for s, (k, v) in enumerate(zip(keys, values)):
        k, v = k.astype("float64"), v.astype("float64")
        n = q_indptr[s + 1] - q_indptr[s]
        for i in range(n):
            position = len(k) - n + i if end_aligned else len(k) + i
            last = min(position + 1, len(k))
            first = max(position + 1 - window, 0) if window else 0
            most = max(most, last - first)
            for h in range(q.shape[1]):
                scores = k[first:last, h // group] @ q[q_indptr[s] + i, h].astype("float64") * sm_scale
                top_score = max(top_score, np.abs(scores).max())
                scores = cap * np.tanh(scores / cap) if cap else scores
                weights = np.exp(scores - scores.max())
                out[q_indptr[s] + i, h] = weights @ v[first:last, h // group] / weights.sum()
                lse[q_indptr[s] + i, h] = (scores.max() + np.log(weights.sum())) * LOG2E
                top_v = max(top_v, np.abs(v[first:last, h // group]).max())
    return out, lse, top_score, top_v, most


def _attention(which: str, kind: str, cache: dict, causal: int = 1, sm_scale: float | None = None):
    """(output, lse) of TVM's or our kernel on `cache` (decode: one query per sequence; paged: the prefill rows
    against the cached pages, `causal` as the runtime passes it; ragged: the new rows among themselves)."""
    func, _, _ = _kernel(which, kind)
    sm_scale = cache["sm_scale"] if sm_scale is None else sm_scale
    rope = [0, 1.0, 1e4, sm_scale]  # rotary_mode 0 (K stored after RoPE), rope_scale, rope_theta, sm_scale
    b = len(CTX)
    q = cache["q_decode"] if kind == "decode" else cache["q"]
    out, lse = np.zeros(q.shape, "float16"), np.zeros(q.shape[:2], "float32")
    if kind == "decode":
        args = [q, cache["pages"], cache["indptr"], cache["values"], cache["last"], np.zeros(b, "int32"),
                np.zeros(b, "int32"), out, lse, *rope]
    elif kind == "paged":
        args = [q, cache["q_indptr"], cache["pages"], cache["indptr"], cache["values"], cache["last"],
                np.zeros(b, "int32"), np.zeros(len(q), "int32"), out, lse, causal, *rope]
    else:
        args = [q, cache["q_indptr"], cache["k"], cache["v"], cache["q_indptr"], np.zeros(len(q), "int32"),
                np.zeros(b, "int32"), out, lse, causal, *rope]
    got = _run(func, args)
    at = next(i for i, arg in enumerate(args) if arg is out)  # lse follows the output
    return got[at], got[at + 1]


def _expected(which: str, kind: str, cache: dict, causal: int = 1):
    """_numpy_attention of what _attention runs: decode and the ragged prefill end with their rows (causal), the
    paged prefill's keys end with its rows with causal 1 and come before them with causal 0."""
    _, window, cap = _kernel(which, kind)
    b = len(CTX)
    if kind == "ragged":
        bounds = cache["q_indptr"]
        keys, values = ([cache[x][bounds[s]:bounds[s + 1]] for s in range(b)] for x in ("k", "v"))
    else:
        keys, values = ([_paged_rows(cache, s, kv) for s in range(b)] for kv in (0, 1))
    q, q_indptr = (cache["q_decode"], np.arange(b + 1)) if kind == "decode" else (cache["q"], cache["q_indptr"])
    return _numpy_attention(q, q_indptr, keys, values, kind != "paged" or causal > 0, cache["sm_scale"], window, cap)


def _errors(got: tuple, want: tuple) -> tuple[float, float, float, float]:
    """(output error, its tolerance, lse error, its tolerance): the module docstring's bounds; NaN counts as inf."""
    out, lse, top_score, top_v, most = want
    dim = out.shape[-1]
    score_error = 8 * math.sqrt(dim) * U32 * top_score

    def worst(a, b):
        diff = np.abs(a.astype("float64") - b)
        return math.inf if np.isnan(diff).any() else float(diff.max())

    sum_error = 8 * math.sqrt(most) * U32
    out_tol = 2 * U16 * np.abs(out).max() + (2 * score_error + sum_error) * top_v
    lse_tol = LOG2E * score_error + sum_error + 2 * U32 * np.abs(lse).max()
    return worst(got[0], out), out_tol, worst(got[1], lse), lse_tol


RUNS = [("decode", 1), ("paged", 0), ("paged", 1), ("ragged", 1)]


@pytest.mark.parametrize("which", ["tvm", "ours"])
def test_float16_attention_matches_numpy(which):
    """Decode, the paged prefill (causal 0 and 1) and the ragged prefill of two sequences on float16 pages."""
    fp16_platform_installed()
    cache = _cache(0)
    rows, failures = [], []
    for kind, causal in RUNS:
        got, want = _attention(which, kind, cache, causal), _expected(which, kind, cache, causal)
        err, tol, lse_err, lse_tol = _errors(got, want)
        rows.append(f"  {which} {kind:6s} causal={causal} max_abs_err={err:.3g} tol={tol:.3g} lse_err={lse_err:.3g} "
                    f"tol={lse_tol:.3g}{'' if err <= tol and lse_err <= lse_tol else '  FAIL'}")
        if not (err <= tol and lse_err <= lse_tol):
            failures.append(rows[-1])
    print("\n" + "\n".join(rows))
    assert not failures, "\n".join(failures)


def _swap_first_pages(cache: dict) -> dict:
    values = cache["values"].copy()
    first = cache["indptr"][:-1]
    values[first[0]], values[first[1]] = values[first[1]], values[first[0]]
    return dict(cache, values=values)


# Negative controls: what a kernel is given, altered; its output against the true inputs' reference must fail.
WRONG = {
    "a page of the other sequence": lambda cache: (_swap_first_pages(cache), {}),
    "KV heads swapped": lambda cache: (dict(cache, pages=np.roll(cache["pages"], 1, axis=2)), {}),
    "a key dropped": lambda cache: (dict(cache, last=cache["last"] - 1), {}),
    "sm_scale 1/D": lambda cache: (cache, {"sm_scale": cache["sm_scale"] ** 2}),
    "no causal mask": lambda cache: (cache, {"causal": 0}),
}


@pytest.mark.parametrize("which", ["tvm", "ours"])
@pytest.mark.parametrize("kind,wrong", [("decode", "a page of the other sequence"), ("decode", "KV heads swapped"),
                                        ("decode", "a key dropped"), ("decode", "sm_scale 1/D"),
                                        ("ragged", "no causal mask")])
def test_attention_fed_a_wrong_page_head_scale_or_mask_fails(which, kind, wrong):
    fp16_platform_installed()
    cache = _cache(1)
    altered, options = WRONG[wrong](cache)
    err, tol, _, _ = _errors(_attention(which, kind, altered, **options), _expected(which, kind, cache))
    print(f"\n  {which} {kind} {wrong}: max_abs_err={err:.3g} tol={tol:.3g}")
    assert err > tol, (err, tol)


def test_float16_merge_of_attention_states_matches_numpy():
    """V, S <- the merge of (V, S) and (V_other, S_other), S in log2 units (ours on every GPU build); negative
    control: the two states' S exchanged."""
    fp16_platform_installed()
    func = _tvm_kernels()[1]["tir_attention_merge_state"]
    rng = np.random.default_rng(2)
    n, heads, dim = 5, 9, 64
    v, v_other = (rng.standard_normal((n, heads, dim)).astype("float16") for _ in range(2))
    s, s_other = (rng.standard_normal((n, heads)).astype("float32") for _ in range(2))
    top = np.maximum(s, s_other)
    w, w_other = np.exp2(s - top), np.exp2(s_other - top)
    want_v = (v.astype("float64") * w[..., None] + v_other.astype("float64") * w_other[..., None]) / (
        w + w_other)[..., None]
    want_s = np.log2(w + w_other) + top
    tol_v = 2 * U16 * np.abs(want_v).max() + 8 * U32 * np.abs(v).max()  # the float16 store, float32 arithmetic
    tol_s = 8 * U32 * np.abs(want_s).max()
    got_v, got_s = _run(func, [v.copy(), s.copy(), v_other, s_other])[:2]
    assert np.abs(got_v - want_v).max() <= tol_v and np.abs(got_s - want_s).max() <= tol_s
    wrong_v, _ = _run(func, [v.copy(), s_other.copy(), v_other, s])[:2]
    assert np.abs(wrong_v - want_v).max() > tol_v
