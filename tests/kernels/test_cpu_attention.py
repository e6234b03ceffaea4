"""Vectorized CPU attention kernels of the paged KV cache: decode, prefill self-attention (ragged) and prefill
against the cached pages (paged), numerics
against TVM's own CPU kernels and a numpy softmax on random data (context lengths on and off page/block boundaries,
GQA groups 1 and 3, batches of 1 to 3 sequences, causal or not, float16), the sliding-window
variants of decode and paged prefill and capped scores (Gemma 2) against numpy, negative controls (a wrong page table,
a shifted causal mask, the window or the cap ignored), rotary_mode 1 (inline RoPE) refused, and ReplaceCPUAttention's
swap (LLVM targets only)."""

import functools
import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache
from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu, _attention_prefill_ragged_cpu

from compiler.codegen import pipeline
from compiler.errors import MobilecError
from compiler.kernels.cpu_attention import (
    ATTN_LOGIT_CAP_ATTR,
    DECODE_SYMBOL,
    LAYER_SLIDING_WINDOW_ATTR,
    PAGED_PREFILL_SYMBOL,
    RAGGED_SYMBOL,
    ROTARY_REFUSAL,
    SLIDING_SUFFIX,
    AttentionShape,
    attention_decode,
    attention_prefill_paged,
    attention_prefill_ragged,
    vector_lanes,
)
from compiler.passes.replace_cpu_attention import ReplaceCPUAttention, decode_shape, ragged_shape
from compiler.target.build_plan import resolve_plan
from compiler.target.isa import cpu_isa
from tests.helpers.cpu import X86_FAMILY_TARGETS, assembly, innermost_loops, runs_here

AVX512 = X86_FAMILY_TARGETS["avx512bw"]
AVX2 = X86_FAMILY_TARGETS["avx2"]
ARM = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]})
# The widest x86 variant this CPU executes (16 lanes with AVX-512, else 8); the other is compiled and its assembly
# checked (test_each_width_emits_its_vectors).
RUN = AVX512 if runs_here(AVX512) else AVX2
PAGE = 16
D = 64
SM_SCALE = 1 / np.sqrt(D)
ROPE_SCALE, ROPE_THETA = 1.0, 10000.0


@functools.cache
def _kernels(h_kv: int, h_qo: int, dtype: str = "float32", target=RUN):
    """(ours, TVM's), built for `target` (one this CPU runs)."""
    ours = attention_decode(AttentionShape(h_kv, h_qo, D, dtype, PAGE), vector_lanes(target))
    theirs = _attention_decode_cpu(h_kv, h_qo, D, dtype, False, {})
    return tuple(tvm.tirx.build(tvm.IRModule({"main": f}), target=target)["main"] for f in (ours, theirs))


def _cache(ctx: list[int], h_kv: int, h_qo: int, seed: int = 0, dtype: str = "float32"):
    """A paged KV cache holding sequences of `ctx` tokens in shuffled pages (three spare pages), NaN in the rows
    past each sequence's end, and one query token per sequence."""
    rng = np.random.default_rng(seed)
    n_pages = [-(-c // PAGE) for c in ctx]
    total = sum(n_pages) + 3
    pages = rng.standard_normal((total, 2, h_kv, PAGE, D)).astype(dtype)
    order = rng.permutation(total)[: sum(n_pages)].astype("int32")
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype("int32")
    last = np.array([c - (n - 1) * PAGE if n else 0 for c, n in zip(ctx, n_pages)], "int32")
    for s, n in enumerate(n_pages):
        if n:
            pages[order[indptr[s] + n - 1], :, :, last[s]:] = np.nan  # a kernel reading past the end gives NaN
    q = (2 * rng.standard_normal((len(ctx), h_qo, D))).astype(dtype)
    return {"q": q, "pages": pages, "indptr": indptr, "values": order, "last": last}


def _run(fn, c: dict, rotary_mode: int = 0):
    b, h_qo = c["q"].shape[:2]
    out = tvm.runtime.empty((b, h_qo, D), str(c["q"].dtype))
    lse = tvm.runtime.empty((b, h_qo), "float32")
    fn(tvm.runtime.tensor(c["q"]), tvm.runtime.tensor(c["pages"]), tvm.runtime.tensor(c["indptr"]),
       tvm.runtime.tensor(c["values"]), tvm.runtime.tensor(c["last"]),
       tvm.runtime.tensor(np.arange(b, dtype="int32") * 3),  # k_rope_pos_offset
       tvm.runtime.tensor(np.arange(b, dtype="int32") * 5 + 200),  # q_rope_position
       out, lse, rotary_mode, ROPE_SCALE, ROPE_THETA, SM_SCALE)
    return out.numpy().astype("float32"), lse.numpy()


def _numpy_reference(c: dict):
    """softmax(q K^T * sm_scale) V per sequence and query head; lse in TVM's log2 units."""
    q, pages = c["q"].astype("float64"), c["pages"].astype("float64")
    b, h_qo = q.shape[:2]
    group = h_qo // pages.shape[2]
    out, lse = np.zeros((b, h_qo, D)), np.full((b, h_qo), -5e4)
    for s in range(b):
        page_ids = c["values"][c["indptr"][s]:c["indptr"][s + 1]]
        length = (len(page_ids) - 1) * PAGE + c["last"][s] if len(page_ids) else 0
        if not length:
            continue
        k = pages[page_ids, 0].transpose(1, 0, 2, 3).reshape(pages.shape[2], -1, D)[:, :length]
        v = pages[page_ids, 1].transpose(1, 0, 2, 3).reshape(pages.shape[2], -1, D)[:, :length]
        for h in range(h_qo):
            scores = k[h // group] @ q[s, h] * SM_SCALE
            top = scores.max()
            weights = np.exp(scores - top)
            out[s, h] = weights @ v[h // group] / weights.sum()
            lse[s, h] = (top + np.log(weights.sum())) * np.log2(np.e)
    return out, lse


CASES = [  # (context lengths, KV heads, query heads)
    ([1], 3, 9),
    ([16], 3, 9),
    ([37], 3, 9),
    ([128], 3, 9),
    ([130, 5], 3, 9),
    ([64, 0], 3, 9),  # a sequence with no KV rows: output 0, lse -5e4 as TVM's kernel writes
    ([33], 3, 3),
    ([200, 17], 2, 2),
]


@pytest.mark.parametrize("ctx,h_kv,h_qo", CASES)
def test_matches_tvm_kernel_and_numpy(ctx, h_kv, h_qo):
    ours, theirs = _kernels(h_kv, h_qo)
    cache = _cache(ctx, h_kv, h_qo)
    out, lse = _run(ours, cache)
    ref_out, ref_lse = _run(theirs, cache)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=2e-5)
    np_out, np_lse = _numpy_reference(cache)
    np.testing.assert_allclose(out, np_out, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(lse, np_lse, rtol=1e-5, atol=2e-5)


def test_float16_cache_matches_tvm_kernel():
    ours, theirs = _kernels(3, 9, "float16")
    cache = _cache([150, 3], 3, 9, seed=2, dtype="float16")  # two chunks of pages, merged
    out, lse = _run(ours, cache)
    ref_out, ref_lse = _run(theirs, cache)
    np.testing.assert_allclose(out, ref_out, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_negative_control_wrong_page_table():
    ours, _ = _kernels(3, 9)
    cache = _cache([40], 3, 9)
    good, _ = _run(ours, cache)
    swapped = dict(cache, values=cache["values"][[1, 0, 2]])  # first two pages exchanged: same rows, new positions
    np.testing.assert_allclose(_run(ours, swapped)[0], good, rtol=1e-5, atol=2e-6)  # attention is order-free...
    other = dict(cache, values=cache["values"].copy())
    other["values"][0] = next(p for p in range(cache["pages"].shape[0]) if p not in cache["values"])
    bad, _ = _run(ours, other)  # ...but a page that is not the sequence's is not
    assert np.isfinite(bad).all() and np.abs(bad - good).max() > 1e-2
    mixed = dict(cache, last=np.array([7], "int32"))  # a shorter last page drops rows
    assert np.abs(_run(ours, mixed)[0] - good).max() > 1e-3


def test_vector_width_follows_the_target():
    assert vector_lanes(AVX512) == 16 and vector_lanes(AVX2) == 8 and vector_lanes(ARM) == 4
    assert vector_lanes(tvm.target.Target({"kind": "cuda"})) is None
    assert not AttentionShape(3, 9, 72, "float32", 16).supported(16)  # head_dim not a whole number of vectors
    assert AttentionShape(3, 9, 72, "float32", 16).supported(8)


def test_avx2_and_neon_widths_build_and_match():
    """The 8-lane (AVX2) kernel runs here too, and the 4-lane one (NEON's width) built for x86; the NEON kernel
    is checked to build for aarch64."""
    ours, theirs = _kernels(3, 9, target=AVX2)
    cache = _cache([150], 3, 9, seed=3)
    np.testing.assert_allclose(_run(ours, cache)[0], _run(theirs, cache)[0], rtol=1e-5, atol=2e-6)
    four = tvm.tirx.build(tvm.IRModule({"main": attention_decode(AttentionShape(3, 9, D, "float32", PAGE), 4)}),
                          target=RUN)["main"]
    np.testing.assert_allclose(_run(four, cache)[0], _run(theirs, cache)[0], rtol=1e-5, atol=2e-6)
    func = attention_decode(AttentionShape(3, 9, D, "float32", PAGE), vector_lanes(ARM))
    lowered = tvm.tirx.build(tvm.IRModule({"main": func}), target=ARM)
    assert "fmla" in lowered.inspect_source("asm")


@pytest.mark.parametrize("target,register", [(AVX512, "zmm"), (AVX2, "ymm")])
def test_each_width_emits_its_vectors(target, register):
    """Each x86 width compiled (not run), whatever this CPU has: 16 lanes in zmm FMAs, 8 in ymm ones (no zmm)."""
    shape = AttentionShape(3, 9, D, "float32", PAGE)
    decode = assembly(tvm.tirx.build(tvm.IRModule({"main": attention_decode(shape, vector_lanes(target))}),
                                     target=target))
    for asm in (decode, _prefill_assembly(target)):
        assert "vfmadd" in asm and f"%{register}" in asm
        assert (register == "zmm") == ("%zmm" in asm)


@functools.cache
def _prefill_assembly(target) -> str:
    """The ragged prefill kernel (the paged one's tiles too) at the target's lanes and vector registers, compiled."""
    isa = cpu_isa(target)
    func = attention_prefill_ragged(AttentionShape(3, 9, D, "float32", PAGE), isa.float_lanes,
                                    registers=isa.vector_registers)
    return assembly(tvm.tirx.build(tvm.IRModule({"main": func}), target=target))


# x86: vfmadd231ps of a broadcast and a vector; NEON: fmla by element or of a ld1r broadcast
FMA = re.compile(r"^(vfmadd\w+ps|fmla)\s")
HORIZONTAL = re.compile(r"^(vhadd|vperm|vshuf|vextract|vinsert|vunpck|faddp|fmaxp|addv|ext|zip|uzp|dup)")


@pytest.mark.parametrize("target,fmas", [
    (AVX2, 12),  # 4 keys x 3 vectors of 8 rows (the 24 rows of a tile of 8 query rows x 3 heads) in 16 ymm
    (AVX512, 16),  # 8 keys x 2 vectors of 16 (the rows padded to 32) in 32 zmm
    (ARM, 24),  # 4 keys x 6 vectors of 4 in 32 NEON registers
])
def test_prefill_micro_kernels_are_register_tiles_of_fmas(target, fmas):
    """The prefill kernels' products (scores = K q^T, output^T += V^T p) are loops of `fmas` independent FMAs (a
    register tile: keys or head_dim columns x vectors of rows) of broadcast elements, with no horizontal sum, shuffle
    or spill in them; compiled, not run."""
    tiles = [body for body in innermost_loops(_prefill_assembly(target)) if sum(bool(FMA.match(i)) for i in body) == fmas]
    assert len(tiles) >= 2, f"no loop of {fmas} FMAs"  # the scores' and the output's
    for body in tiles:
        assert not [i for i in body if HORIZONTAL.match(i) or re.search(r"\(%rsp\)|\[sp", i)], body


# ---------------------------------------------------------------------------------------------------------
# Prefill self-attention (ragged q, k, v of the new tokens)


@functools.cache
def _ragged_kernels(h_kv: int, h_qo: int):
    ours = attention_prefill_ragged(AttentionShape(h_kv, h_qo, D, "float32", PAGE), vector_lanes(RUN))
    theirs = _attention_prefill_ragged_cpu(h_kv, h_qo, D, D, "float32", {})
    return tuple(tvm.tirx.build(tvm.IRModule({"main": f}), target=RUN)["main"] for f in (ours, theirs))


def _ragged_data(q_lens: list[int], kv_lens: list[int], h_kv: int, h_qo: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, m = sum(q_lens), sum(kv_lens)
    return {"q": (2 * rng.standard_normal((n, h_qo, D))).astype("float32"),
            "q_indptr": np.concatenate([[0], np.cumsum(q_lens)]).astype("int32"),
            "k": rng.standard_normal((m, h_kv, D)).astype("float32"),
            "v": rng.standard_normal((m, h_kv, D)).astype("float32"),
            "kv_indptr": np.concatenate([[0], np.cumsum(kv_lens)]).astype("int32"),
            "q_pos": (np.arange(n) + 7).astype("int32"), "k_offset": (np.arange(len(q_lens)) * 3).astype("int32")}


def _run_ragged(fn, data: dict, causal: int = 1, rotary_mode: int = 0):
    n, h_qo = data["q"].shape[:2]
    out, lse = tvm.runtime.empty((n, h_qo, D), "float32"), tvm.runtime.empty((n, h_qo), "float32")
    fn(*(tvm.runtime.tensor(data[x]) for x in ("q", "q_indptr", "k", "v", "kv_indptr", "q_pos", "k_offset")),
       out, lse, causal, rotary_mode, ROPE_SCALE, ROPE_THETA, SM_SCALE)
    return out.numpy(), lse.numpy()


def _numpy_ragged(data: dict, causal: int):
    q, k, v = (data[x].astype("float64") for x in ("q", "k", "v"))
    group = q.shape[1] // k.shape[1]
    out, lse = np.zeros(q.shape), np.full(q.shape[:2], -5e4)
    for s in range(len(data["q_indptr"]) - 1):
        q0, q1 = data["q_indptr"][s], data["q_indptr"][s + 1]
        k0, k1 = data["kv_indptr"][s], data["kv_indptr"][s + 1]
        for i in range(q1 - q0):
            visible = min(k1 - k0, (k1 - k0) - (q1 - q0) + i + 1) if causal else k1 - k0
            for h in range(q.shape[1]):
                scores = k[k0:k0 + visible, h // group] @ q[q0 + i, h] * SM_SCALE
                weights = np.exp(scores - scores.max())
                out[q0 + i, h] = weights @ v[k0:k0 + visible, h // group] / weights.sum()
                lse[q0 + i, h] = (scores.max() + np.log(weights.sum())) * np.log2(np.e)
    return out, lse


RAGGED_CASES = [  # (query lengths, key lengths, KV heads, query heads, causal)
    ([5], [5], 3, 9, 1),
    ([37], [37], 3, 9, 1),
    ([130], [130], 3, 9, 1),
    ([20, 0, 7], [20, 0, 7], 3, 9, 1),  # an empty sequence in the batch
    ([4], [21], 3, 9, 1),  # fewer queries than keys: the causal window is aligned at the end
    ([19, 6], [19, 6], 2, 2, 0),
]


@pytest.mark.parametrize("q_lens,kv_lens,h_kv,h_qo,causal", RAGGED_CASES)
def test_ragged_prefill_matches_tvm_kernel_and_numpy(q_lens, kv_lens, h_kv, h_qo, causal):
    ours, theirs = _ragged_kernels(h_kv, h_qo)
    data = _ragged_data(q_lens, kv_lens, h_kv, h_qo)
    out, lse = _run_ragged(ours, data, causal)
    ref_out, ref_lse = _run_ragged(theirs, data, causal)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=3e-5)
    np_out, np_lse = _numpy_ragged(data, causal)
    np.testing.assert_allclose(out, np_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, np_lse, rtol=1e-5, atol=3e-5)


def test_ragged_prefill_negative_control_mask():
    """Without the causal mask, or with the keys of the other sequence, the result is not the causal one."""
    ours, _ = _ragged_kernels(3, 9)
    data = _ragged_data([30, 30], [30, 30], 3, 9, seed=5)
    good, _ = _run_ragged(ours, data, causal=1)
    assert np.abs(_run_ragged(ours, data, causal=0)[0][:29] - good[:29]).max() > 1e-2
    assert np.allclose(_run_ragged(ours, data, causal=0)[0][29], good[29], atol=1e-5)  # the last row sees all
    swapped = dict(data, k=np.concatenate([data["k"][30:], data["k"][:30]]))
    assert np.abs(_run_ragged(ours, swapped)[0] - good).max() > 1e-2


# ---------------------------------------------------------------------------------------------------------
# Prefill against the cached pages (a prompt after earlier tokens, or a chunked prefill)


@functools.cache
def _paged_prefill_kernels(h_kv: int, h_qo: int):
    ours = attention_prefill_paged(AttentionShape(h_kv, h_qo, D, "float32", PAGE), vector_lanes(RUN))
    theirs = _attention_prefill_cpu(h_kv, h_qo, D, "float32", False, {})
    return tuple(tvm.tirx.build(tvm.IRModule({"main": f}), target=RUN)["main"] for f in (ours, theirs))


def _run_paged_prefill(fn, cache: dict, q: np.ndarray, q_indptr: np.ndarray, causal: int, rotary_mode: int = 0):
    n, h_qo = q.shape[:2]
    out, lse = tvm.runtime.empty((n, h_qo, D), "float32"), tvm.runtime.empty((n, h_qo), "float32")
    fn(tvm.runtime.tensor(q), tvm.runtime.tensor(q_indptr), tvm.runtime.tensor(cache["pages"]),
       tvm.runtime.tensor(cache["indptr"]), tvm.runtime.tensor(cache["values"]), tvm.runtime.tensor(cache["last"]),
       tvm.runtime.tensor(np.arange(len(q_indptr) - 1, dtype="int32") * 3),  # k_rope_pos_offset
       tvm.runtime.tensor(np.arange(n, dtype="int32") + 40),  # q_rope_position
       out, lse, causal, rotary_mode, ROPE_SCALE, ROPE_THETA, SM_SCALE)
    return out.numpy(), lse.numpy()


@pytest.mark.parametrize("q_lens,ctx,causal", [
    ([5], [37], 0),  # what the KV cache runs: new tokens against all cached ones
    ([16, 3], [128, 45], 0),
    ([7, 2], [7, 40], 1),
    ([3, 4], [20, 0], 0),  # a sequence with no cached pages: output 0, lse -5e4
    ([6, 9], [50, 21], 0),
    ([11, 19], [40, 50], 1),  # tiles of QUERY_TILE rows: a short last one, rows of a tile seeing different keys
])
def test_paged_prefill_matches_tvm_kernel(q_lens, ctx, causal):
    ours, theirs = _paged_prefill_kernels(3, 9)
    cache = _cache(ctx, 3, 9, seed=6)
    q = (2 * np.random.default_rng(7).standard_normal((sum(q_lens), 9, D))).astype("float32")
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype("int32")
    out, lse = _run_paged_prefill(ours, cache, q, q_indptr, causal)
    ref_out, ref_lse = _run_paged_prefill(theirs, cache, q, q_indptr, causal)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=3e-5)
    if not causal:  # each query row is a decode step against the same pages
        rows = [dict(cache, q=q[q_indptr[s]:q_indptr[s + 1]][i:i + 1], indptr=cache["indptr"][s:s + 2],
                     last=cache["last"][s:s + 1]) for s in range(len(q_lens)) for i in range(q_lens[s])]
        np.testing.assert_allclose(out, np.concatenate([_numpy_reference(r)[0] for r in rows]), rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("lanes,registers", [
    (16, 32),  # AVX-512's tile: 8 keys x 2 vectors of 16 rows, the 24 rows padded to 32
    (4, 32),  # NEON's: 4 keys x 6 vectors of 4 rows
])
def test_paged_prefill_tiles_of_other_targets_match_tvm_kernel(lanes, registers):
    """The register tiles of AVX-512 and NEON (their lanes and 32 registers), built for RUN (LLVM splits or joins
    the vectors), give TVM's results: padded rows, a short last tile, rows of a tile seeing different keys."""
    ours = tvm.tirx.build(tvm.IRModule({"main": attention_prefill_paged(
        AttentionShape(3, 9, D, "float32", PAGE), lanes, registers=registers)}), target=RUN)["main"]
    cache = _cache([40, 50], 3, 9, seed=6)
    q = (2 * np.random.default_rng(7).standard_normal((30, 9, D))).astype("float32")
    q_indptr = np.array([0, 11, 30], "int32")
    out, lse = _run_paged_prefill(ours, cache, q, q_indptr, causal=1)
    ref_out, ref_lse = _run_paged_prefill(_paged_prefill_kernels(3, 9)[1], cache, q, q_indptr, causal=1)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=3e-5)


def test_kernels_refuse_inline_rope():
    """rotary_mode 1 (RoPE inside attention, RopeMode.INLINE): each of our kernels fails with the reason instead of
    attending without RoPE (TVM's kernels apply it)."""
    cache, q, q_indptr = _cache([37], 3, 9, seed=1), np.zeros((2, 9, D), "float32"), np.array([0, 2], "int32")
    decode, sliding_decode = _kernels(3, 9)[0], _sliding_kernels(3, 9, 24)[0]
    for run in (lambda: _run(decode, cache, rotary_mode=1),
                lambda: _run_ragged(_ragged_kernels(3, 9)[0], _ragged_data([9], [9], 3, 9), rotary_mode=1),
                lambda: _run_paged_prefill(_paged_prefill_kernels(3, 9)[0], cache, q, q_indptr, 0, rotary_mode=1),
                lambda: _run(sliding_decode, _window_view(cache, [37], 24), rotary_mode=1),
                lambda: _run_paged_prefill(_sliding_kernels(3, 9, 24)[1], _window_view(cache, [37], 24), q, q_indptr,
                                           1, rotary_mode=1)):
        with pytest.raises(RuntimeError, match=re.escape(ROTARY_REFUSAL)):
            run()
    _run(decode, cache)  # rotary_mode 0 runs


def test_decode_kernel_has_no_rope():
    """The decode kernel computes no RoPE (no cos, sin or pow, which TVM's `_rope` expression calls): an inline-RoPE
    path made its LLVM codegen 20-30x slower, some 12 s of every compile."""
    script = attention_decode(AttentionShape(3, 9, D, "float32", PAGE), 16).script()
    assert "T.log2(" in script  # the lse: the script shows the kernel's calls
    assert not [call for call in ("T.cos(", "T.sin(", "T.pow(") if call in script]
    # negative control: TVM's kernel, with the inline path, has them
    assert "T.cos(" in _attention_decode_cpu(3, 9, D, "float32", False, {}).script()


# ---------------------------------------------------------------------------------------------------------
# Sliding-window variants (the "mha_sliding" layers): the cache passes the window's pages and length_info [3, b]


@functools.cache
def _sliding_kernels(h_kv: int, h_qo: int, window: int):
    """(decode, paged prefill), ours for the sliding layers, built for RUN."""
    shape = AttentionShape(h_kv, h_qo, D, "float32", PAGE)
    return tuple(tvm.tirx.build(tvm.IRModule({"main": f}), target=RUN)["main"] for f in (
        attention_decode(shape, vector_lanes(RUN), sliding=True),
        attention_prefill_paged(shape, vector_lanes(RUN), sliding_window=window)))


def _window_view(cache: dict, ctx: list[int], window: int, sink: int = 0) -> dict:
    """What TVM's cache passes a sliding layer's kernels (paged_kv_cache.cc, GetLayerSlidingWindowOffset/NumPages):
    the last pages of each sequence holding its last `window` tokens, and [last page rows, offset of the window in
    its first page, sink rows]."""
    values, indptr, offsets = [], [0], []
    for s, c in enumerate(ctx):
        n_pages = cache["indptr"][s + 1] - cache["indptr"][s]
        offset = (c - window) % PAGE if c > window else 0
        n_window = min(n_pages, -(-(offset + min(c, window)) // PAGE)) if c else 0
        values += list(cache["values"][cache["indptr"][s + 1] - n_window:cache["indptr"][s + 1]])
        indptr.append(indptr[-1] + n_window)
        offsets.append(offset)
    info = np.stack([cache["last"], offsets, [sink] * len(ctx)]).astype("int32")
    return dict(cache, values=np.array(values, "int32"), indptr=np.array(indptr, "int32"), last=info)


def _numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cap: float | None = None) -> np.ndarray:
    """softmax(q k^T * sm_scale) v for one query head: q [D], k and v [n, D]; scores capped as Gemma 2 with a cap."""
    scores = k.astype("float64") @ q.astype("float64") * SM_SCALE
    if cap is not None:
        scores = cap * np.tanh(scores / cap)
    weights = np.exp(scores - scores.max())
    return weights @ v.astype("float64") / weights.sum()


def _keys(cache: dict, s: int, c: int):
    """Sequence s's K and V [h_kv, c, D] in token order."""
    page_ids = cache["values"][cache["indptr"][s]:cache["indptr"][s + 1]]
    k, v = (cache["pages"][page_ids, kv].transpose(1, 0, 2, 3).reshape(cache["pages"].shape[2], -1, D)[:, :c]
            for kv in (0, 1))
    return k, v


def _assert_decode_sees_the_last_keys(out: np.ndarray, cache: dict, ctx: list[int], window: int) -> None:
    """Each sequence's decode output is numpy's attention over its last `window` keys; negative control: the plain
    kernel over every key differs where the window binds."""
    for s, c in enumerate(ctx):
        k, v = _keys(cache, s, c)
        for h in range(9):
            want = _numpy_attention(cache["q"][s, h], k[h // 3, -window:], v[h // 3, -window:])
            np.testing.assert_allclose(out[s, h], want, rtol=1e-5, atol=3e-6)
    whole, _ = _run(_kernels(3, 9)[0], cache)
    if max(ctx) > window:
        assert np.abs(whole - out).max() > 1e-2


@pytest.mark.parametrize("ctx,window", [([37, 130], 24), ([16, 15], 16), ([40], 17), ([200, 5], 64)])
def test_sliding_decode_sees_only_the_window(ctx, window):
    decode, _ = _sliding_kernels(3, 9, window)
    cache = _cache(ctx, 3, 9, seed=8)
    _assert_decode_sees_the_last_keys(_run(decode, _window_view(cache, ctx, window))[0], cache, ctx, window)


@pytest.mark.parametrize("q_lens,ctx,window", [([5], [37], 8), ([3, 8], [130, 45], 24), ([4], [10], 16)])
def test_sliding_paged_prefill_sees_only_the_window(q_lens, ctx, window):
    """New tokens (rows i of each sequence, at positions ctx + i) against the cached ones: causal, each row sees
    the cached keys at positions > ctx + i - window (the new ones are the ragged kernel's)."""
    _, prefill = _sliding_kernels(3, 9, window)
    cache = _cache(ctx, 3, 9, seed=9)
    q = (2 * np.random.default_rng(10).standard_normal((sum(q_lens), 9, D))).astype("float32")
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype("int32")
    out, _ = _run_paged_prefill(prefill, _window_view(cache, ctx, window), q, q_indptr, causal=1)
    for s, c in enumerate(ctx):
        k, v = _keys(cache, s, c)
        for i in range(q_lens[s]):
            first = max(c + i - window + 1, 0)
            for h in range(9):
                got = out[q_indptr[s] + i, h]
                if first >= c:  # no cached key in the window: output 0 (lse -5e4), merged away by the runtime
                    assert not got.any()
                    continue
                want = _numpy_attention(q[q_indptr[s] + i, h], k[h // 3, first:], v[h // 3, first:])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-6)
    whole, _ = _run_paged_prefill(_paged_prefill_kernels(3, 9)[0], cache, q, q_indptr, causal=0)
    if any(c + n > window for c, n in zip(ctx, q_lens)):  # negative control: every cached key
        assert np.abs(whole - out).max() > 1e-2
    else:  # the window holds every key
        np.testing.assert_allclose(out, whole, rtol=1e-5, atol=3e-6)


# Every layer's window (SLIDING_WINDOW_ATTR: Mistral, Phi-3): the plain kernels, every page passed; a query at
# position p sees the keys at positions > p - window


# the kernels at RUN's width and at NEON's (4 lanes, built for RUN): the window's masks are per vector of rows
WINDOW_LANES = [vector_lanes(RUN), vector_lanes(ARM)]


@functools.cache
def _windowed_kernels(h_kv: int, h_qo: int, window: int, lanes: int):
    """(decode, ragged prefill, paged prefill) with every layer's window at `lanes`, built for RUN."""
    shape = AttentionShape(h_kv, h_qo, D, "float32", PAGE)
    return tuple(tvm.tirx.build(tvm.IRModule({"main": f}), target=RUN)["main"] for f in (
        attention_decode(shape, lanes, window=window), attention_prefill_ragged(shape, lanes, window=window),
        attention_prefill_paged(shape, lanes, window=window)))


@pytest.mark.parametrize("lanes", WINDOW_LANES)
@pytest.mark.parametrize("ctx,window", [([37, 130], 24), ([16, 15], 16), ([40], 17), ([200, 5, 300], 64)])
def test_windowed_decode_sees_the_last_keys(ctx, window, lanes):
    """Every page is passed (pages before the window, a window starting inside a page, chunks of the decode task
    wholly before it: 300 keys), and the query, the last key, sees the last `window` keys."""
    decode = _windowed_kernels(3, 9, window, lanes)[0]
    cache = _cache(ctx, 3, 9, seed=11)
    _assert_decode_sees_the_last_keys(_run(decode, cache)[0], cache, ctx, window)


@pytest.mark.parametrize("lanes", WINDOW_LANES)
@pytest.mark.parametrize("q_lens,window", [([30, 30], 8), ([37, 5], 16), ([20], 32)])
def test_windowed_ragged_prefill_sees_the_last_keys(q_lens, window, lanes):
    """New tokens among themselves, causal: row i sees rows i - window + 1 .. i."""
    ragged = _windowed_kernels(3, 9, window, lanes)[1]
    data = _ragged_data(q_lens, q_lens, 3, 9, seed=12)
    out, _ = _run_ragged(ragged, data, causal=1)
    q, k, v = data["q"], data["k"], data["v"]
    for s in range(len(q_lens)):
        start = data["q_indptr"][s]
        for i in range(q_lens[s]):
            first = max(i - window + 1, 0)
            for h in range(9):
                want = _numpy_attention(q[start + i, h], k[start + first:start + i + 1, h // 3],
                                        v[start + first:start + i + 1, h // 3])
                np.testing.assert_allclose(out[start + i, h], want, rtol=1e-5, atol=3e-6)
    whole, _ = _run_ragged(_ragged_kernels(3, 9)[0], data, causal=1)
    if max(q_lens) > window:  # negative control: the causal keys without the window
        assert np.abs(whole - out).max() > 1e-2
    else:
        np.testing.assert_allclose(out, whole, rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("q_lens,ctx,window,causal", [
    ([5], [37], 8, 0), ([3, 8], [130, 45], 24, 0), ([4], [10], 16, 0),  # the cached keys, all before the new rows
    ([7, 2], [40, 7], 16, 1),  # the pages end with the new rows
])
@pytest.mark.parametrize("lanes", WINDOW_LANES)
def test_windowed_paged_prefill_sees_the_last_keys(q_lens, ctx, window, causal, lanes):
    """Row i of each sequence is at position p = ctx + i (causal 0: every page is before the new rows) or
    ctx - q_len + i (causal 1); it sees the page keys at positions > p - window (and, causal, <= p)."""
    prefill = _windowed_kernels(3, 9, window, lanes)[2]
    cache = _cache(ctx, 3, 9, seed=13)
    q = (2 * np.random.default_rng(14).standard_normal((sum(q_lens), 9, D))).astype("float32")
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype("int32")
    out, _ = _run_paged_prefill(prefill, cache, q, q_indptr, causal=causal)
    for s, c in enumerate(ctx):
        k, v = _keys(cache, s, c)
        for i in range(q_lens[s]):
            position = c - q_lens[s] + i if causal else c + i
            first, end = max(position - window + 1, 0), min(position + 1, c)
            for h in range(9):
                got = out[q_indptr[s] + i, h]
                if first >= end:  # no page key in the window: output 0 (lse -5e4), merged away by the runtime
                    assert not got.any()
                    continue
                want = _numpy_attention(q[q_indptr[s] + i, h], k[h // 3, first:end], v[h // 3, first:end])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-6)
    whole, _ = _run_paged_prefill(_paged_prefill_kernels(3, 9)[0], cache, q, q_indptr, causal=causal)
    if any(c + (0 if causal else n) > window for c, n in zip(ctx, q_lens)):  # negative control: every page key
        assert np.abs(whole - out).max() > 1e-2
    else:  # the window holds every key
        np.testing.assert_allclose(out, whole, rtol=1e-5, atol=3e-6)


def test_sliding_kernels_refuse_attention_sinks():
    decode, prefill = _sliding_kernels(3, 9, 24)
    cache = _cache([40], 3, 9, seed=11)
    with pytest.raises(RuntimeError, match="sinks"):
        _run(decode, _window_view(cache, [40], 24, sink=4))
    q = np.zeros((2, 9, D), "float32")
    with pytest.raises(RuntimeError, match="sinks"):
        _run_paged_prefill(prefill, _window_view(cache, [40], 24, sink=4), q, np.array([0, 2], "int32"), causal=1)


CAP = 1.5  # scores here are ~N(0, 2): capping at 1.5 changes most of them


@functools.cache
def _capped_kernels(h_kv: int, h_qo: int, window: int):
    """(decode, ragged prefill, sliding paged prefill) with scores capped at CAP, built for RUN."""
    shape, lanes = AttentionShape(h_kv, h_qo, D, "float32", PAGE), vector_lanes(RUN)
    return tuple(tvm.tirx.build(tvm.IRModule({"main": f}), target=RUN)["main"] for f in (
        attention_decode(shape, lanes, logit_cap=CAP), attention_prefill_ragged(shape, lanes, logit_cap=CAP),
        attention_prefill_paged(shape, lanes, sliding_window=window, logit_cap=CAP)))


def test_capped_scores_match_numpy():
    decode, ragged, paged = _capped_kernels(3, 9, 24)
    ctx = [37, 130]
    cache = _cache(ctx, 3, 9, seed=12)
    out, _ = _run(decode, cache)
    for s, c in enumerate(ctx):
        k, v = _keys(cache, s, c)
        for h in range(9):
            np.testing.assert_allclose(out[s, h], _numpy_attention(cache["q"][s, h], k[h // 3], v[h // 3], CAP),
                                       rtol=1e-5, atol=3e-6)
    assert np.abs(_run(_kernels(3, 9)[0], cache)[0] - out).max() > 1e-2  # negative control: no cap
    data = _ragged_data([9, 20], [9, 20], 3, 9, seed=13)
    out, _ = _run_ragged(ragged, data, causal=1)
    for s in range(2):
        q0, k0 = data["q_indptr"][s], data["kv_indptr"][s]
        for i in range(data["q_indptr"][s + 1] - q0):
            for h in range(9):
                want = _numpy_attention(data["q"][q0 + i, h], data["k"][k0:k0 + i + 1, h // 3],
                                        data["v"][k0:k0 + i + 1, h // 3], CAP)
                np.testing.assert_allclose(out[q0 + i, h], want, rtol=1e-5, atol=3e-6)
    q = (2 * np.random.default_rng(14).standard_normal((3, 9, D))).astype("float32")
    cache = _cache([37], 3, 9, seed=15)
    out, _ = _run_paged_prefill(paged, _window_view(cache, [37], 24), q, np.array([0, 3], "int32"), causal=1)
    k, v = _keys(cache, 0, 37)
    for i in range(3):
        for h in range(9):
            want = _numpy_attention(q[i, h], k[h // 3, 37 + i - 23:], v[h // 3, 37 + i - 23:], CAP)
            np.testing.assert_allclose(out[i, h], want, rtol=1e-5, atol=3e-6)


# ---------------------------------------------------------------------------------------------------------
# The pass


def _kv_cache_module(head_dim: int = D):
    """A module holding TVM's CPU attention kernels as TIRPagedKVCache adds them (bb.add_func), and a Relax
    function that refers to them by GlobalVar, as the KV cache creation call does."""
    bb = relax.BlockBuilder()
    kernels = [
        bb.add_func(_attention_decode_cpu(3, 9, head_dim, "float32", False, {}), "tir_attention_decode_cpu"),
        bb.add_func(_attention_decode_cpu(3, 9, head_dim, "float32", True, {}),
                    "tir_attention_decode_cpu_sliding_window"),
        bb.add_func(_attention_prefill_ragged_cpu(3, 9, head_dim, head_dim, "float32", {}),
                    "tir_attention_prefill_ragged_cpu"),
        bb.add_func(_attention_prefill_cpu(3, 9, head_dim, "float32", False, {}), "tir_attention_prefill_cpu"),
        bb.add_func(_attention_prefill_cpu(3, 9, head_dim, "float32", True, {}, sliding_window_size=24),
                    "tir_attention_prefill_cpu_sliding_window"),
    ]
    with bb.function("create", []):
        bb.emit_func_output(relax.call_pure_packed("test.kv_cache_create", *kernels, ty_args=relax.AnyType()))
    return bb.get()


def test_pass_swaps_the_kernels():
    mod = _kv_cache_module()
    swapped = ReplaceCPUAttention(vector_lanes(AVX512))(mod)
    for name, symbol, read_shape, build in (
            ("tir_attention_decode_cpu", DECODE_SYMBOL, decode_shape, attention_decode),
            ("tir_attention_prefill_ragged_cpu", RAGGED_SYMBOL, ragged_shape, attention_prefill_ragged),
            ("tir_attention_prefill_cpu", PAGED_PREFILL_SYMBOL, lambda f: decode_shape(f, pages_param=2),
             attention_prefill_paged)):
        new, old = swapped[name], mod[name]
        # IR out: our kernel for the shape TVM's was built with, under TVM's attributes (and noalias)
        tvm.ir.assert_structural_equal(new, build(read_shape(old), 16).with_attrs({**dict(old.attrs),
                                                                                   "tirx.noalias": True}))
        assert not new.same_as(old) and new.attrs["global_symbol"] == symbol
        assert "T.parallel" in new.script() and "T.parallel" not in old.script()
        assert read_shape(new) == read_shape(old)
        assert [str(p.name) for p in new.params] == [str(p.name) for p in old.params]
    # the sliding-window variant and the Relax function stay TVM's
    assert swapped["tir_attention_decode_cpu_sliding_window"].same_as(mod["tir_attention_decode_cpu_sliding_window"])
    assert swapped["create"].same_as(mod["create"])


def _tvm_cache_module(rope_mode: RopeMode):
    """A module creating TVM's own paged KV cache (TIRPagedKVCache, as models/llama.py does) with `rope_mode`."""
    bb = relax.BlockBuilder()
    with bb.function("create", []):
        cache = TIRPagedKVCache(
            attn_kind="mha", max_batch_size=1, max_total_seq_len=64, prefill_chunk_size=64, page_size=PAGE,
            support_sliding_window=0, layer_partition=relax.ShapeExpr([0, 1]), num_hidden_layers=1,
            num_attention_heads=9, num_key_value_heads=3, qk_head_dim=D, v_head_dim=D, mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0, rope_mode=rope_mode, rope_scale=1, rope_theta=10000, rope_scaling={},
            rope_ext_factors=relax.prim_value(0), rotary_dim=D, enable_disaggregation=False, dtype="float32",
            target=tvm.target.Target("llvm"))
        bb.emit_func_output(cache._expr)  # pylint: disable=protected-access
    return bb.get()


def test_pass_refuses_a_cache_with_inline_rope():
    """Our kernels read K stored after RoPE: a cache created with RopeMode.INLINE fails the build, in one line; one
    with RopeMode.NORMAL gets our kernels."""
    with pytest.raises(MobilecError, match="RopeMode.INLINE"):
        ReplaceCPUAttention(vector_lanes(AVX512))(_tvm_cache_module(RopeMode.INLINE))
    mod = _tvm_cache_module(RopeMode.NORMAL)
    swapped = ReplaceCPUAttention(vector_lanes(AVX512))(mod)
    assert not swapped["tir_attention_decode_cpu"].same_as(mod["tir_attention_decode_cpu"])


def test_pipeline_swaps_attention_on_llvm_cpu_targets_only():
    """The step's condition is in the pipeline's list: CPU targets have it, and Hexagon (its attention runs on the
    ARM host: ours at NEON's lanes); GPU targets (TVM's GPU kernels, ours only for windows and caps) do not."""
    for name, has_step in (("host", True), ("linux-arm64", True), ("android-arm64", True),
                           ("android-adreno", False), ("android-mali", False), ("hexagon-npu", True)):
        names = [step for step, _ in pipeline.steps(resolve_plan(name))]
        assert ("cpu-attention" in names) == has_step, name


def test_pass_swaps_the_sliding_window_kernels_of_a_model_with_a_window():
    """With LAYER_SLIDING_WINDOW_ATTR (a model with "mha_sliding" layers) the sliding variants become ours, with
    that window; a shape our kernels do not take fails the build instead of keeping TVM's."""
    mod = _kv_cache_module().with_attr(LAYER_SLIDING_WINDOW_ATTR, 24)
    swapped = ReplaceCPUAttention(vector_lanes(AVX512))(mod)
    for name, build in (("tir_attention_decode_cpu_sliding_window",
                         lambda shape: attention_decode(shape, 16, sliding=True)),
                        ("tir_attention_prefill_cpu_sliding_window",
                         lambda shape: attention_prefill_paged(shape, 16, sliding_window=24))):
        old = mod[name]
        tvm.ir.assert_structural_equal(swapped[name], build(decode_shape(old, 2 if "prefill" in name else 1))
                                       .with_attrs({**dict(old.attrs), "tirx.noalias": True}))
        assert swapped[name].attrs["global_symbol"].endswith(SLIDING_SUFFIX)
    with pytest.raises(MobilecError, match="a sliding window needs mobilec's CPU attention kernels"):
        ReplaceCPUAttention(vector_lanes(AVX512))(_kv_cache_module(head_dim=72).with_attr(LAYER_SLIDING_WINDOW_ATTR,
                                                                                            24))


def test_pass_builds_every_kernel_with_the_logit_cap_of_a_model_with_one():
    """With ATTN_LOGIT_CAP_ATTR (Gemma 2) all three kernels are ours with the cap; a shape ours do not take fails
    the build (TVM's kernels have no cap)."""
    mod = _kv_cache_module().with_attr(ATTN_LOGIT_CAP_ATTR, 20.0)
    swapped = ReplaceCPUAttention(vector_lanes(AVX512))(mod)
    old = mod["tir_attention_decode_cpu"]
    tvm.ir.assert_structural_equal(swapped["tir_attention_decode_cpu"], attention_decode(
        decode_shape(old), 16, logit_cap=20.0).with_attrs({**dict(old.attrs), "tirx.noalias": True}))
    old = mod["tir_attention_prefill_ragged_cpu"]
    tvm.ir.assert_structural_equal(swapped["tir_attention_prefill_ragged_cpu"], attention_prefill_ragged(
        ragged_shape(old), 16, logit_cap=20.0).with_attrs({**dict(old.attrs), "tirx.noalias": True}))
    with pytest.raises(MobilecError, match="capped attention scores needs"):
        ReplaceCPUAttention(vector_lanes(AVX512))(_kv_cache_module(head_dim=72).with_attr(ATTN_LOGIT_CAP_ATTR, 20.0))


def test_pass_keeps_shapes_it_does_not_take():
    mod = _kv_cache_module(head_dim=72)
    # head_dim 72: not a whole number of 16-lane vectors
    assert ReplaceCPUAttention(vector_lanes(AVX512))(mod).same_as(mod)
