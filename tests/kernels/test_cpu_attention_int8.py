"""An int8 KV cache's CPU kernels (kernels/cpu_attention.py on kv_cache_dtype.Carrier): decode, ragged and
paged prefill, split + RoPE + quantize, merge of attention states, each on buffers laid out as TVM's runtime
allocates the float32 carrier, against numpy: K/V quantized the same way (scale = max|x| / 127 per token and KV
head), attention over the dequantized values (test_cpu_attention.py's references). SmolLM2's geometry (9 query
heads, 3 KV heads, head_dim 64: GQA group 3), contexts on and off page boundaries; negative control: a wrong
stored scale is caught. ReplaceCPUAttention on a tiny model's int8 module."""

import functools

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

from compiler.errors import MobilecError
from compiler.kernels.cpu_attention import (
    ATTN_LOGIT_CAP_ATTR,
    DECODE_SYMBOL,
    MERGE_SYMBOL,
    PAGED_PREFILL_SYMBOL,
    RAGGED_SYMBOL,
    SLIDING_WINDOW_ATTR,
    SPLIT_ROTARY_SYMBOL,
    AttentionShape,
    attention_decode,
    attention_prefill_paged,
    attention_prefill_ragged,
    carrier_merge_state,
    quantized_split_rotary,
    vector_lanes,
)
from compiler.model_import.kv_cache_dtype import CODE_FORMATS, KV_FORMAT_ATTR, Carrier
from compiler.passes.replace_cpu_attention import ReplaceCPUAttention, float_split_rotary_for, in_place_of
from tests.kernels.test_cpu_attention import (
    PAGE,
    ROPE_SCALE,
    ROPE_THETA,
    RUN,
    SM_SCALE,
    D,
    _cache,
    _numpy_ragged,
    _numpy_reference,
    _ragged_data,
)

# Llama 3's RoPE scaling (TVM's rope_freq_llama3), with head_dim 64 and theta 1e4: pairs of wavelength below 16
# tokens unscaled, above 64 divided by 8, 3 pairs smoothed between
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

H_QO, H_KV = 9, 3
SHAPE = AttentionShape(H_KV, H_QO, D, "int8", PAGE)
CARRIER = Carrier(CODE_FORMATS["int8"], H_QO, H_KV, D)
HQ_DECL, HKV_DECL, CELL = SHAPE.declared


def test_carrier_geometry():
    """SmolLM2: 16 floats a cell, 3 code rows + 1 scale row, 60 fused rows, 52 declared query heads."""
    assert (CARRIER.cell, CARRIER.declared_kv_heads, CARRIER.fused_rows, CARRIER.declared_heads) == (16, 4, 60, 52)
    assert CARRIER.declared_heads * CARRIER.cell >= H_QO * D
    odd = Carrier(CODE_FORMATS["int8"], 4, 2, 16)  # the tiny test model: 4-float cells, one scale row for 2 heads
    assert (odd.declared_kv_heads, odd.declared_heads) == (3, 26)


@functools.cache
def _build(kind: str):
    lanes = vector_lanes(RUN)
    func = {"decode": lambda: attention_decode(SHAPE, lanes),
            "ragged": lambda: attention_prefill_ragged(SHAPE, lanes),
            "paged": lambda: attention_prefill_paged(SHAPE, lanes),
            "split": lambda: quantized_split_rotary(SHAPE, ROPE_THETA, ROPE_SCALE),
            "merge": lambda: carrier_merge_state(SHAPE)}[kind]()
    return tvm.tirx.build(tvm.IRModule({"main": func}), target=RUN)["main"]


def quantize(x: np.ndarray):
    """int8 codes and float32 scales per row of the last axis: scale = max|x| / 127, code = round(x / scale)."""
    amax = np.abs(x).max(axis=-1).astype("float32")
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype("float32")
    return np.round(x * inv[..., None]).astype("int8"), (amax / np.float32(127)).astype("float32")


def pack_rows(x: np.ndarray) -> np.ndarray:
    """Real K or V rows (..., H_KV, D), the KV head axis third from last or last-but-one -> the carrier's
    (..., HKV_DECL, CELL) float32 rows of codes and scales; returns (carrier, dequantized x)."""
    codes, scales = quantize(x)
    head_axis = x.ndim - 2
    lead = x.shape[:head_axis]
    out = np.zeros((*lead, HKV_DECL, CELL), "float32")
    out.view("int8").reshape(*lead, HKV_DECL, D)[..., :H_KV, :] = codes
    for h in range(H_KV):
        out[..., H_KV + h // CELL, h % CELL] = scales[..., h]
    return out, codes.astype("float32") * scales[..., None]


def pack_pages(pages: np.ndarray):
    """Float pages (n, 2, H_KV, P, D) -> the carrier pages (n, 2, HKV_DECL, P, CELL) and the dequantized pages."""
    t = np.nan_to_num(pages.transpose(0, 1, 3, 2, 4))  # (n, 2, P, H_KV, D)
    carrier, deq = pack_rows(t)
    carrier = np.ascontiguousarray(carrier.transpose(0, 1, 3, 2, 4))
    deq = deq.transpose(0, 1, 3, 2, 4)
    # the rows past a sequence's end (NaN in _cache) get NaN scales: a kernel reading them gives NaN
    carrier[:, :, H_KV:].transpose(0, 1, 3, 2, 4)[np.isnan(pages[:, :, 0, :, 0])] = np.nan
    return carrier, deq.astype("float32")


def to_q_carrier(q: np.ndarray) -> np.ndarray:
    out = np.zeros((q.shape[0], HQ_DECL * CELL), "float32")
    out[:, :H_QO * D] = q.reshape(q.shape[0], -1)
    return out.reshape(q.shape[0], HQ_DECL, CELL)


def from_q_carrier(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1)[:, :H_QO * D].reshape(x.shape[0], H_QO, D)


def _int8_cache(ctx, seed=0):
    cache = _cache(ctx, H_KV, H_QO, seed=seed)
    carrier, deq = pack_pages(cache["pages"])
    return dict(cache, pages=carrier), dict(cache, pages=deq)


def _decode(cache: dict, q: np.ndarray):
    b = q.shape[0]
    out, lse = tvm.runtime.empty((b, HQ_DECL, CELL), "float32"), tvm.runtime.empty((b, HQ_DECL), "float32")
    _build("decode")(tvm.runtime.tensor(to_q_carrier(q)), tvm.runtime.tensor(cache["pages"]),
                     tvm.runtime.tensor(cache["indptr"]), tvm.runtime.tensor(cache["values"]),
                     tvm.runtime.tensor(cache["last"]), tvm.runtime.tensor(np.zeros(b, "int32")),
                     tvm.runtime.tensor(np.zeros(b, "int32")), out, lse, 0, ROPE_SCALE, ROPE_THETA, SM_SCALE)
    return from_q_carrier(out.numpy()), lse.numpy()[:, :H_QO]


@pytest.mark.parametrize("ctx", [[1], [16], [37], [130, 5], [300]])
def test_decode_matches_numpy_on_dequantized_values(ctx):
    packed, deq = _int8_cache(ctx)
    out, lse = _decode(packed, packed["q"])
    ref_out, ref_lse = _numpy_reference(deq)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=3e-5)
    # and close to attention over the unquantized values (what int8 costs: ~1e-2 here)
    float_out, _ = _numpy_reference(_cache(ctx, H_KV, H_QO))
    assert np.abs(out - float_out).max() < 0.1


def test_decode_negative_control_wrong_scales():
    """Scales doubled (V's: the output doubles; K's: the softmax sharpens) and codes of another head are caught."""
    packed, deq = _int8_cache([70])
    good, _ = _decode(packed, packed["q"])
    ref, _ = _numpy_reference(deq)
    np.testing.assert_allclose(good, ref, rtol=1e-5, atol=3e-6)
    for kv in (0, 1):
        bad = packed["pages"].copy()
        bad[:, kv, H_KV:] *= 2
        out, _ = _decode(dict(packed, pages=bad), packed["q"])
        assert np.abs(out - ref).max() > 1e-2, kv


@pytest.mark.parametrize("q_lens,causal", [([5], 1), ([37], 1), ([20, 0, 7], 1), ([19, 6], 0)])
def test_ragged_prefill_matches_numpy(q_lens, causal):
    data = _ragged_data(q_lens, q_lens, H_KV, H_QO)
    k_car, k_deq = pack_rows(data["k"])
    v_car, v_deq = pack_rows(data["v"])
    n = data["q"].shape[0]
    out, lse = tvm.runtime.empty((n, HQ_DECL, CELL), "float32"), tvm.runtime.empty((n, HQ_DECL), "float32")
    _build("ragged")(tvm.runtime.tensor(to_q_carrier(data["q"])), tvm.runtime.tensor(data["q_indptr"]),
                     tvm.runtime.tensor(k_car), tvm.runtime.tensor(v_car), tvm.runtime.tensor(data["kv_indptr"]),
                     tvm.runtime.tensor(data["q_pos"]), tvm.runtime.tensor(data["k_offset"]), out, lse, causal, 0,
                     ROPE_SCALE, ROPE_THETA, SM_SCALE)
    ref_out, ref_lse = _numpy_ragged(dict(data, k=k_deq, v=v_deq), causal)
    np.testing.assert_allclose(from_q_carrier(out.numpy()), ref_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse.numpy()[:, :H_QO], ref_lse, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("q_lens,ctx", [([5], [37]), ([16, 3], [128, 45]), ([3, 4], [20, 0])])
def test_paged_prefill_matches_numpy(q_lens, ctx):
    packed, deq = _int8_cache(ctx, seed=6)
    q = (2 * np.random.default_rng(7).standard_normal((sum(q_lens), H_QO, D))).astype("float32")
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype("int32")
    n = q.shape[0]
    out, lse = tvm.runtime.empty((n, HQ_DECL, CELL), "float32"), tvm.runtime.empty((n, HQ_DECL), "float32")
    _build("paged")(tvm.runtime.tensor(to_q_carrier(q)), tvm.runtime.tensor(q_indptr),
                    tvm.runtime.tensor(packed["pages"]), tvm.runtime.tensor(packed["indptr"]),
                    tvm.runtime.tensor(packed["values"]), tvm.runtime.tensor(packed["last"]),
                    tvm.runtime.tensor(np.zeros(len(q_lens), "int32")), tvm.runtime.tensor(np.zeros(n, "int32")),
                    out, lse, 0, 0, ROPE_SCALE, ROPE_THETA, SM_SCALE)
    # not causal: each query row is a decode step against its sequence's pages
    rows = [dict(deq, q=q[q_indptr[s]:q_indptr[s + 1]][i:i + 1], indptr=deq["indptr"][s:s + 2],
                 last=deq["last"][s:s + 1]) for s in range(len(q_lens)) for i in range(q_lens[s])]
    refs = [_numpy_reference(r) for r in rows]
    np.testing.assert_allclose(from_q_carrier(out.numpy()), np.concatenate([r[0] for r in refs]),
                               rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse.numpy()[:, :H_QO], np.concatenate([r[1] for r in refs]), rtol=1e-5, atol=3e-5)


@functools.cache
def _tvm_split():
    func = llama_rope_with_position_map(ROPE_THETA, ROPE_SCALE, D, H_QO, H_KV, "float32", {})
    return tvm.tirx.build(tvm.IRModule({"main": func}), target=RUN)["main"]


def _numpy_rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of (n, heads, D) rows at positions pos."""
    half = D // 2
    freq = pos[:, None] * ROPE_SCALE / ROPE_THETA ** (np.arange(half) * 2 / D)
    cos, sin = np.cos(freq)[:, None], np.sin(freq)[:, None]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([cos * a - sin * b, cos * b + sin * a], axis=-1)


@pytest.mark.parametrize("apply_rope", [1, 0])
def test_split_rotary_quantizes_k_after_rope_and_v(apply_rope):
    n = 21
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype("float32")
    pos = (np.arange(n) * 37 + 5).astype("int32")
    q = tvm.runtime.empty((n, HQ_DECL, CELL), "float32")
    k = tvm.runtime.tensor(np.zeros((n, HKV_DECL, CELL), "float32"))
    v = tvm.runtime.tensor(np.zeros((n, HKV_DECL, CELL), "float32"))
    _build("split")(tvm.runtime.tensor(qkv.reshape(n, CARRIER.fused_rows, CELL)), tvm.runtime.tensor(pos), q, k, v,
                    apply_rope)
    # TVM's split + RoPE on the real geometry: the same q, and the k that is quantized
    tvm_q, tvm_k, tvm_v = (tvm.runtime.empty((n, h, D), "float32") for h in (H_QO, H_KV, H_KV))
    _tvm_split()(tvm.runtime.tensor(qkv), tvm.runtime.tensor(pos), tvm_q, tvm_k, tvm_v, apply_rope)
    np.testing.assert_allclose(from_q_carrier(q.numpy()), tvm_q.numpy(), rtol=1e-6, atol=1e-6)
    # numpy in float64 (float32 positions * frequencies round differently: 1e-4 at position 777)
    rope = _numpy_rope if apply_rope else lambda x, _: x
    np.testing.assert_allclose(tvm_q.numpy(), rope(qkv[:, :H_QO], pos), atol=3e-4)
    assert (np.abs(tvm_q.numpy() - qkv[:, :H_QO]).max() > 0.1) == bool(apply_rope)
    for got, want in ((k.numpy(), tvm_k.numpy()), (v.numpy(), tvm_v.numpy())):
        ref_car, ref_deq = pack_rows(want)
        codes = got.view("int8").reshape(n, HKV_DECL, D)[:, :H_KV]
        assert np.abs(codes.astype(int) - ref_car.view("int8").reshape(n, HKV_DECL, D)[:, :H_KV]).max() <= 1
        np.testing.assert_allclose(got[:, H_KV:], ref_car[:, H_KV:], rtol=1e-5)  # the scales
        scales = got[:, H_KV, :H_KV]
        np.testing.assert_allclose(codes * scales[..., None], ref_deq, atol=1.01 * scales.max())
        # rounded to the nearest code: every value within half its row's step (1e-5: the kernel's own RoPE);
        # negative control: truncated codes are not
        half_step = 0.5 * scales[..., None] + 1e-5
        assert (np.abs(codes * scales[..., None] - want) <= half_step).all()
        assert not (np.abs(np.trunc(want / scales[..., None]) * scales[..., None] - want) <= half_step).all()


def _split_pair(scale: float, scaling: dict):
    """(ours, TVM's) split + RoPE kernels for RoPE scale `scale` and TVM's rope_scaling dict `scaling`."""
    ours = quantized_split_rotary(SHAPE, ROPE_THETA, scale, scaling)
    theirs = llama_rope_with_position_map(ROPE_THETA, scale, D, H_QO, H_KV, "float32", scaling)
    return tuple(tvm.tirx.build(tvm.IRModule({"main": f}), target=RUN)["main"] for f in (ours, theirs))


@pytest.mark.parametrize("scale,scaling", [(1.0, LLAMA3), (0.25, {})], ids=["llama3", "linear"])
def test_split_rotary_applies_rope_scaling_as_tvm_does(scale, scaling):
    """Llama 3's scaled frequencies, and linear scaling (positions times rope_scale), as TVM's split kernel
    applies them: the same q, and k quantized from the same rotated values; negative control: plain RoPE's q
    differs."""
    ours, theirs = _split_pair(scale, scaling)
    n = 40
    qkv = np.random.default_rng(5).standard_normal((n, H_QO + 2 * H_KV, D)).astype("float32")
    pos = (np.arange(n) * 5 + 3).astype("int32")
    q = tvm.runtime.empty((n, HQ_DECL, CELL), "float32")
    k = tvm.runtime.tensor(np.zeros((n, HKV_DECL, CELL), "float32"))
    v = tvm.runtime.tensor(np.zeros((n, HKV_DECL, CELL), "float32"))
    ours(tvm.runtime.tensor(qkv.reshape(n, CARRIER.fused_rows, CELL)), tvm.runtime.tensor(pos), q, k, v, 1)
    tvm_q, tvm_k = (tvm.runtime.empty((n, h, D), "float32") for h in (H_QO, H_KV))
    theirs(tvm.runtime.tensor(qkv), tvm.runtime.tensor(pos), tvm_q, tvm_k, tvm.runtime.empty((n, H_KV, D), "float32"),
           1)
    np.testing.assert_allclose(from_q_carrier(q.numpy()), tvm_q.numpy(), rtol=1e-5, atol=1e-5)
    ref_car, _ = pack_rows(tvm_k.numpy())
    codes = k.numpy().view("int8").reshape(n, HKV_DECL, D)[:, :H_KV]
    assert np.abs(codes.astype(int) - ref_car.view("int8").reshape(n, HKV_DECL, D)[:, :H_KV]).max() <= 1
    np.testing.assert_allclose(k.numpy()[:, H_KV:], ref_car[:, H_KV:], rtol=1e-5)  # the scales
    plain_q = tvm.runtime.empty((n, HQ_DECL, CELL), "float32")
    _build("split")(tvm.runtime.tensor(qkv.reshape(n, CARRIER.fused_rows, CELL)), tvm.runtime.tensor(pos), plain_q,
                    k, v, 1)
    assert np.abs(from_q_carrier(plain_q.numpy()) - tvm_q.numpy()).max() > 0.1


def test_merge_state_merges_the_real_heads():
    rng = np.random.default_rng(4)
    n = 5
    v1, v2 = (rng.standard_normal((n, H_QO, D)).astype("float32") for _ in range(2))
    s1, s2 = (rng.standard_normal((n, HQ_DECL)).astype("float32") * 4 for _ in range(2))
    v = tvm.runtime.tensor(to_q_carrier(v1))
    s = tvm.runtime.tensor(s1)
    _build("merge")(v, s, tvm.runtime.tensor(to_q_carrier(v2)), tvm.runtime.tensor(s2))
    a, b = np.exp2(s1[:, :H_QO]), np.exp2(s2[:, :H_QO])
    want = (v1 * a[..., None] + v2 * b[..., None]) / (a + b)[..., None]
    np.testing.assert_allclose(from_q_carrier(v.numpy()), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.numpy()[:, :H_QO], np.log2(a + b), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# The pass, on a tiny Llama's exported module


@pytest.fixture(scope="module")
def tiny_int8_module(tmp_path_factory):
    from compiler.model_import.importer import import_model, open_model
    from compiler.target.build_plan import resolve_plan
    from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

    d = tmp_path_factory.mktemp("tiny") / "hf"
    save_compilable_checkpoint(build_model("llama_gqa"), d)
    with open_model(str(d)) as ckpt:
        return {name: import_model(ckpt, resolve_plan("host", "q0f32", kv_dtype=name), 64).mod
                for name in ("int8", "f32")}


def test_pass_replaces_all_five_kernels_of_an_int8_cache(tiny_int8_module):
    mod = tiny_int8_module["int8"]
    swapped = ReplaceCPUAttention(8)(mod)
    shape = AttentionShape(2, 4, 16, "int8", PAGE)  # the tiny model's real geometry, from the module attr
    theta = float(mod.attrs[KV_FORMAT_ATTR]["rope_theta"])
    for symbol, build in ((DECODE_SYMBOL, lambda: attention_decode(shape, 8)),
                          (RAGGED_SYMBOL, lambda: attention_prefill_ragged(shape, 8)),
                          (PAGED_PREFILL_SYMBOL, lambda: attention_prefill_paged(shape, 8)),
                          (SPLIT_ROTARY_SYMBOL, lambda: quantized_split_rotary(shape, theta)),
                          (MERGE_SYMBOL, lambda: carrier_merge_state(shape))):
        old, new = mod[symbol], swapped[symbol]
        tvm.ir.assert_structural_equal(new, build().with_attrs({**dict(old.attrs), "tirx.noalias": True}))
        assert [str(p.name) for p in new.params] == [str(p.name) for p in old.params]
    # TVM's copy kernels move whole cells: they stay
    for symbol in ("tir_kv_cache_transpose_append", "copy_single_page_cpu", "compact_kv_copy_cpu"):
        assert swapped[symbol].same_as(mod[symbol])
    # negative control: a float cache keeps TVM's merge, and its split + RoPE is the float one, not the int8 one
    f32 = tiny_int8_module["f32"]
    swapped = ReplaceCPUAttention(8)(f32)
    float_split = float_split_rotary_for(f32, f32[SPLIT_ROTARY_SYMBOL])
    assert float_split is not None
    tvm.ir.assert_structural_equal(swapped[SPLIT_ROTARY_SYMBOL], in_place_of(f32[SPLIT_ROTARY_SYMBOL], float_split))
    assert not tvm_ffi.structural_equal(swapped[SPLIT_ROTARY_SYMBOL], in_place_of(
        f32[SPLIT_ROTARY_SYMBOL], quantized_split_rotary(shape, theta)))
    assert swapped[MERGE_SYMBOL].same_as(f32[MERGE_SYMBOL])
    assert not swapped[DECODE_SYMBOL].same_as(f32[DECODE_SYMBOL])


def test_pass_gives_an_int8_caches_kernels_the_window_and_cap(tiny_int8_module):
    """A window on every layer and capped scores (SLIDING_WINDOW_ATTR, ATTN_LOGIT_CAP_ATTR) reach the three attention
    kernels of a quantized cache as they reach a float cache's; negative control: without them the kernels differ."""
    mod = tiny_int8_module["int8"]
    shape = AttentionShape(2, 4, 16, "int8", PAGE)
    swapped = ReplaceCPUAttention(8)(mod.with_attr(SLIDING_WINDOW_ATTR, 24).with_attr(ATTN_LOGIT_CAP_ATTR, 30.0))
    plain = ReplaceCPUAttention(8)(mod)
    for symbol, build in ((DECODE_SYMBOL, attention_decode), (RAGGED_SYMBOL, attention_prefill_ragged),
                          (PAGED_PREFILL_SYMBOL, attention_prefill_paged)):
        tvm.ir.assert_structural_equal(swapped[symbol], in_place_of(mod[symbol], build(
            shape, 8, window=24, logit_cap=30.0)))
        assert not tvm_ffi.structural_equal(swapped[symbol], plain[symbol])


def test_pass_gives_an_int8_cache_the_models_rope_scaling(tmp_path):
    """A Llama 3.x model's int8 cache: the split + RoPE kernel gets its RoPE scaling, recorded by the importer
    (ROPE_ATTR; the attention kernels read K after RoPE, and have none); negative control: the plain kernel
    differs."""
    from compiler.model_import.importer import import_model, open_model
    from compiler.target.build_plan import resolve_plan
    from tests.helpers.tiny_models import LLAMA3_ROPE, build_model, save_compilable_checkpoint

    save_compilable_checkpoint(build_model("llama3_rope"), tmp_path / "hf")
    with open_model(str(tmp_path / "hf")) as ckpt:
        mod = import_model(ckpt, resolve_plan("host", "q0f32", kv_dtype="int8"), 64).mod
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    swapped = ReplaceCPUAttention(8)(mod)
    shape = AttentionShape(2, 4, 16, "int8", PAGE)
    theta = float(mod.attrs[KV_FORMAT_ATTR]["rope_theta"])
    for symbol, build in ((DECODE_SYMBOL, lambda _: attention_decode(shape, 8)),
                          (RAGGED_SYMBOL, lambda _: attention_prefill_ragged(shape, 8)),
                          (PAGED_PREFILL_SYMBOL, lambda _: attention_prefill_paged(shape, 8)),
                          (SPLIT_ROTARY_SYMBOL, lambda s: quantized_split_rotary(shape, theta, 1.0, s))):
        attrs = {**dict(mod[symbol].attrs), "tirx.noalias": True}
        tvm.ir.assert_structural_equal(swapped[symbol], build(scaling).with_attrs(attrs))
    with pytest.raises(ValueError):
        tvm.ir.assert_structural_equal(swapped[SPLIT_ROTARY_SYMBOL],
                                       quantized_split_rotary(shape, theta).with_attrs(attrs))


def test_pass_refuses_an_int8_geometry_the_kernels_do_not_take(tiny_int8_module):
    """head_dim 16 in 32-lane vectors: TVM's kernels would misread the carrier, so the build fails, in one line."""
    with pytest.raises(MobilecError, match="--kv-dtype int8"):
        ReplaceCPUAttention(32)(tiny_int8_module["int8"])


def test_neon_width_builds_for_aarch64():
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]})
    lanes = vector_lanes(arm)
    for func in (attention_decode(SHAPE, lanes), attention_prefill_ragged(SHAPE, lanes),
                 attention_prefill_paged(SHAPE, lanes)):
        assert "fmla" in tvm.tirx.build(tvm.IRModule({"main": func}), target=arm).inspect_source("asm")
