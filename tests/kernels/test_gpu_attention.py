"""The GPU attention kernels (compiler/kernels/gpu_attention.py), built for android-adreno and run on PoCL, against
numpy on the CPU kernels' test data (tests/kernels/test_cpu_attention.py): plain decode and prefill (GQA, batches,
empty sequences, causal or not), every layer's window, the "mha_sliding" layers' length_info layout (a window's
pages from an offset, attention sinks, as TVM's kernels map them; every page with the window by position, as Gemma
runs on a GPU), capped scores, the merge of attention states; negative controls (the window, the cap ignored, the
causal mask off, TVM's racy merge); float16 builds for the real device."""

import functools

import numpy as np
import pytest
from tvm import tirx
from tvm.relax.frontend.nn.llm._decode_kernels import _merge_state_inplace

from compiler.kernels.cpu_attention import AttentionShape
from compiler.kernels.gpu_attention import (
    THREADS,
    gpu_attention_decode,
    gpu_attention_prefill_paged,
    gpu_attention_prefill_ragged,
    gpu_merge_state,
)
from compiler.target.targets import load_target
from compiler.testing import pocl
from tests.kernels import test_cpu_attention as cpu

D, PAGE = cpu.D, cpu.PAGE
TARGET = load_target("android-adreno").tvm_target()


@pytest.fixture(autouse=True, scope="module")
def _needs_pocl():
    try:
        pocl._context()  # pylint: disable=protected-access
    except (pocl.Unsupported, ImportError) as err:
        pytest.skip(str(err))


class _OnPocl:
    """A GPU kernel called as a built CPU function is (tvm tensors and scalars, outputs written in place), run on
    PoCL: the test_cpu_attention runners then drive it unchanged."""

    def __init__(self, func: tirx.PrimFunc):
        self.func, self.build = func, pocl.build_opencl(func, TARGET)

    def __call__(self, *args):
        arrays = [a.numpy() if hasattr(a, "numpy") else a for a in args]
        bindings = {}
        for param, value in zip(self.func.params, arrays):
            if pocl.is_buffer(param):
                bindings.update({dim.name: n for dim, n in zip(param.shape, value.shape) if isinstance(dim, tirx.Var)})
        for arg, result in zip(args, pocl.run_pocl(self.build, arrays, bindings)):
            if hasattr(arg, "copyfrom"):
                arg.copyfrom(result)


@functools.cache
def _kernels(h_kv: int = 3, h_qo: int = 9, window: int = 0, cap: float = 0.0):
    """(decode, ragged prefill, paged prefill) with every layer's `window` and the score `cap`."""
    shape = AttentionShape(h_kv, h_qo, D, "float32", PAGE)
    return (_OnPocl(gpu_attention_decode(shape, window=window, logit_cap=cap)),
            _OnPocl(gpu_attention_prefill_ragged(shape, window=window, logit_cap=cap)),
            _OnPocl(gpu_attention_prefill_paged(shape, window=window, logit_cap=cap)))


@functools.cache
def _sliding_kernels(window: int = 0, cap: float = 0.0):
    """(decode, paged prefill) of the "mha_sliding" layers (length_info [3, b]) with a `window` by position."""
    shape = AttentionShape(3, 9, D, "float32", PAGE)
    return (_OnPocl(gpu_attention_decode(shape, sliding=True, window=window, logit_cap=cap)),
            _OnPocl(gpu_attention_prefill_paged(shape, sliding=True, window=window, logit_cap=cap)))


EVERY_PAGE = 10 ** 6  # a window no test sequence fills: _window_view passes every page, offset 0


@pytest.mark.parametrize("ctx,h_kv,h_qo", [([1], 3, 9), ([37], 3, 9), ([130, 5], 3, 9), ([64, 0], 3, 9),
                                          ([200, 17], 2, 2)])
def test_decode_matches_numpy(ctx, h_kv, h_qo):
    cache = cpu._cache(ctx, h_kv, h_qo)
    out, lse = cpu._run(_kernels(h_kv, h_qo)[0], cache)
    want_out, want_lse = cpu._numpy_reference(cache)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=3e-5)


def test_decode_negative_control_wrong_page_table():
    cache = cpu._cache([130], 3, 9, seed=3)
    good, _ = cpu._run(_kernels()[0], cache)
    shuffled = dict(cache, values=np.roll(cache["values"], 1))
    shuffled["pages"] = np.nan_to_num(cache["pages"])  # the rolled table ends inside a full page
    assert np.abs(cpu._run(_kernels()[0], shuffled)[0] - good).max() > 1e-2


@pytest.mark.parametrize("q_lens,kv_lens,h_kv,h_qo,causal", [
    ([37], [37], 3, 9, 1), ([20, 0, 7], [20, 0, 7], 3, 9, 1), ([4], [21], 3, 9, 1), ([19, 6], [19, 6], 2, 2, 0),
    ([THREADS + 6], [THREADS + 6], 3, 9, 1),  # more keys than a block
])
def test_ragged_prefill_matches_numpy(q_lens, kv_lens, h_kv, h_qo, causal):
    data = cpu._ragged_data(q_lens, kv_lens, h_kv, h_qo)
    out, lse = cpu._run_ragged(_kernels(h_kv, h_qo)[1], data, causal)
    want_out, want_lse = cpu._numpy_ragged(data, causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=3e-5)
    if causal and max(q_lens) > 1:  # negative control: the mask off
        assert np.abs(cpu._run_ragged(_kernels(h_kv, h_qo)[1], data, 0)[0] - out).max() > 1e-2


@pytest.mark.parametrize("q_lens,ctx", [([5], [37]), ([16, 3], [128, 45]), ([3, 4], [20, 0])])
def test_paged_prefill_matches_numpy(q_lens, ctx):
    """New tokens against all cached ones (causal 0, what the cache runs): each row a decode step."""
    cache = cpu._cache(ctx, 3, 9, seed=6)
    q = (2 * np.random.default_rng(7).standard_normal((sum(q_lens), 9, D))).astype("float32")
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype("int32")
    out, _ = cpu._run_paged_prefill(_kernels()[2], cache, q, q_indptr, 0)
    rows = [dict(cache, q=q[q_indptr[s]:q_indptr[s + 1]][i:i + 1], indptr=cache["indptr"][s:s + 2],
                 last=cache["last"][s:s + 1]) for s in range(len(q_lens)) for i in range(q_lens[s])]
    np.testing.assert_allclose(out, np.concatenate([cpu._numpy_reference(r)[0] for r in rows]), rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("ctx,window", [([37, 130], 24), ([16, 15], 16), ([200, 5, 300], 64), ([150], 100)])
def test_windowed_decode_sees_the_last_keys(ctx, window):
    cache = cpu._cache(ctx, 3, 9, seed=11)
    cpu._assert_decode_sees_the_last_keys(cpu._run(_kernels(window=window)[0], cache)[0], cache, ctx, window)


@pytest.mark.parametrize("q_lens,window", [([30, 30], 8), ([37, 5], 16), ([90], 70)])
def test_windowed_ragged_prefill_sees_the_last_keys(q_lens, window):
    data = cpu._ragged_data(q_lens, q_lens, 3, 9, seed=12)
    out, _ = cpu._run_ragged(_kernels(window=window)[1], data, causal=1)
    for s in range(len(q_lens)):
        start = data["q_indptr"][s]
        for i in range(q_lens[s]):
            first = max(i - window + 1, 0)
            for h in range(9):
                want = cpu._numpy_attention(data["q"][start + i, h], data["k"][start + first:start + i + 1, h // 3],
                                            data["v"][start + first:start + i + 1, h // 3])
                np.testing.assert_allclose(out[start + i, h], want, rtol=1e-5, atol=3e-6)
    assert np.abs(cpu._run_ragged(_kernels()[1], data, causal=1)[0] - out).max() > 1e-2  # negative control


@pytest.mark.parametrize("q_lens,ctx,window,causal", [([5], [37], 8, 0), ([3, 8], [130, 45], 24, 0),
                                                       ([7, 2], [40, 7], 16, 1)])
def test_windowed_paged_prefill_sees_the_last_keys(q_lens, ctx, window, causal):
    cache = cpu._cache(ctx, 3, 9, seed=13)
    q = (2 * np.random.default_rng(14).standard_normal((sum(q_lens), 9, D))).astype("float32")
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype("int32")
    out, _ = cpu._run_paged_prefill(_kernels(window=window)[2], cache, q, q_indptr, causal=causal)
    for s, c in enumerate(ctx):
        k, v = cpu._keys(cache, s, c)
        for i in range(q_lens[s]):
            position = c - q_lens[s] + i if causal else c + i
            first, end = max(position - window + 1, 0), min(position + 1, c)
            for h in range(9):
                got = out[q_indptr[s] + i, h]
                if first >= end:
                    assert not got.any()
                    continue
                want = cpu._numpy_attention(q[q_indptr[s] + i, h], k[h // 3, first:end], v[h // 3, first:end])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-6)
    whole, _ = cpu._run_paged_prefill(_kernels()[2], cache, q, q_indptr, causal=causal)
    assert np.abs(whole - out).max() > 1e-2  # negative control: every page key


@pytest.mark.parametrize("ctx,window", [([37, 130], 24), ([16, 15], 16), ([200, 5], 64)])
def test_sliding_decode_sees_only_the_window(ctx, window):
    cache = cpu._cache(ctx, 3, 9, seed=8)
    out, _ = cpu._run(_sliding_kernels()[0], cpu._window_view(cache, ctx, window))
    cpu._assert_decode_sees_the_last_keys(out, cache, ctx, window)


@pytest.mark.parametrize("ctx,window", [([37, 130], 24), ([200, 5], 64)])
def test_sliding_layers_with_every_page_mask_by_position(ctx, window):
    """Gemma on a GPU: the sliding layers get every page (length_info [3, b], offset 0) and the kernels apply the
    window; decode sees the last `window` keys, the paged prefill rows theirs: all after the pages with causal 1 (TVM's
    sliding cross attention), the pages ending with them with causal 0 (appended first), as every layer's window
    with causal 0 and 1."""
    cache = cpu._cache(ctx, 3, 9, seed=16)
    view = cpu._window_view(cache, ctx, EVERY_PAGE)
    assert (view["indptr"] == cache["indptr"]).all() and not view["last"][1:].any()
    decode, prefill = _sliding_kernels(window)
    cpu._assert_decode_sees_the_last_keys(cpu._run(decode, view)[0], cache, ctx, window)
    q = (2 * np.random.default_rng(17).standard_normal((6, 9, D))).astype("float32")
    q_indptr = np.array([0, 4, 6], "int32")
    for causal in (0, 1):
        out, _ = cpu._run_paged_prefill(prefill, view, q, q_indptr, causal=1 - causal)
        windowed, _ = cpu._run_paged_prefill(_kernels(window=window)[2], cache, q, q_indptr, causal=causal)
        np.testing.assert_allclose(out, windowed, rtol=1e-6, atol=1e-7)  # as every layer's window, tested above
        whole, _ = cpu._run_paged_prefill(_sliding_kernels()[1], view, q, q_indptr, causal=1 - causal)
        assert np.abs(whole - out).max() > 1e-2


def test_sliding_decode_reads_attention_sinks_as_tvm_maps_them():
    """Sink rows (the sequence's first ones, kept before the window) come first: with 4 sinks, a 40-token sequence's
    keys are its rows 0-3 and the window's."""
    cache = cpu._cache([40], 3, 9, seed=11)
    view = cpu._window_view(cache, [40], 24, sink=4)
    view["values"] = np.concatenate([cache["values"][:1], view["values"]]).astype("int32")  # the sinks' page first
    view["indptr"] = view["indptr"] + np.array([0, 1], "int32")
    view["last"][1] += PAGE  # the window's offset, counted from the sinks' page
    out, _ = cpu._run(_sliding_kernels()[0], view)
    k, v = cpu._keys(cache, 0, 40)
    keys = np.r_[0:4, 40 - 24:40]
    for h in range(9):
        want = cpu._numpy_attention(cache["q"][0, h], k[h // 3, keys], v[h // 3, keys])
        np.testing.assert_allclose(out[0, h], want, rtol=1e-5, atol=3e-6)


def test_capped_scores_match_numpy():
    cap = cpu.CAP
    ctx = [37, 130]
    cache = cpu._cache(ctx, 3, 9, seed=12)
    out, _ = cpu._run(_kernels(cap=cap)[0], cache)
    for s, c in enumerate(ctx):
        k, v = cpu._keys(cache, s, c)
        for h in range(9):
            np.testing.assert_allclose(out[s, h], cpu._numpy_attention(cache["q"][s, h], k[h // 3], v[h // 3], cap),
                                       rtol=1e-5, atol=3e-6)
    assert np.abs(cpu._run(_kernels()[0], cache)[0] - out).max() > 1e-2  # negative control: no cap
    data = cpu._ragged_data([9, 20], [9, 20], 3, 9, seed=13)
    out, _ = cpu._run_ragged(_kernels(cap=cap)[1], data, causal=1)
    for s in range(2):
        q0, k0 = data["q_indptr"][s], data["kv_indptr"][s]
        for i in range(data["q_indptr"][s + 1] - q0):
            for h in range(9):
                want = cpu._numpy_attention(data["q"][q0 + i, h], data["k"][k0:k0 + i + 1, h // 3],
                                            data["v"][k0:k0 + i + 1, h // 3], cap)
                np.testing.assert_allclose(out[q0 + i, h], want, rtol=1e-5, atol=3e-6)
    q = (2 * np.random.default_rng(14).standard_normal((3, 9, D))).astype("float32")
    cache = cpu._cache([37], 3, 9, seed=15)
    out, _ = cpu._run_paged_prefill(_sliding_kernels(24, cap)[1], cpu._window_view(cache, [37], EVERY_PAGE), q,
                                    np.array([0, 3], "int32"), causal=1)
    k, v = cpu._keys(cache, 0, 37)
    for i in range(3):  # row i at position 37 + i sees the cached keys from 37 + i - 23
        for h in range(9):
            want = cpu._numpy_attention(q[i, h], k[h // 3, 37 + i - 23:], v[h // 3, 37 + i - 23:], cap)
            np.testing.assert_allclose(out[i, h], want, rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_float16_kernels_build_for_the_device(head_dim):
    """The device's float16 cache (PoCL has no fp16 to run them): halves loaded and widened, float32 arithmetic;
    head sizes not a multiple of THREADS (80) and above it (256, Gemma's)."""
    shape = AttentionShape(1, 4, head_dim, "float16", PAGE)
    for func in (gpu_attention_decode(shape, window=32), gpu_attention_prefill_ragged(shape, logit_cap=50.0),
                 gpu_attention_prefill_paged(shape, sliding=True, window=512)):
        source = pocl.build_opencl(func, TARGET).source
        assert "half* restrict q" in source or "half* restrict Q" in source, source[:400]


@pytest.mark.parametrize("heads,head_dim", [(4, 16), (9, 64), (3, 80), (2, 256)])
def test_merge_state_matches_numpy(heads, head_dim):
    """V, S <- the merge of (V, S) and (V_other, S_other) (S in log2 units); negative control: TVM's kernel, whose
    work-items each read S and write it back, merges twice on PoCL."""
    rng = np.random.default_rng(heads)
    v, v_other = (rng.standard_normal((5, heads, head_dim)).astype("float32") for _ in range(2))
    s, s_other = (rng.standard_normal((5, heads)).astype("float32") for _ in range(2))
    top = np.maximum(s, s_other)
    w, w_other = np.exp2(s - top), np.exp2(s_other - top)
    want_v = (v * w[..., None] + v_other * w_other[..., None]) / (w + w_other)[..., None]
    bindings = {"N": 5, "H": heads, "D": head_dim}

    def merged(func):
        return pocl.run_pocl(pocl.build_opencl(func, TARGET), [v.copy(), s.copy(), v_other, s_other], bindings)[:2]

    got_v, got_s = merged(gpu_merge_state("float32"))
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_s, np.log2(w + w_other) + top, rtol=1e-5, atol=1e-6)
    assert np.abs(merged(_merge_state_inplace(heads, head_dim, "float32", TARGET))[1] - got_s).max() > 1e-2
