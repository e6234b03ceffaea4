"""An int4 KV cache's CPU kernels (kernels/cpu_attention.py on kv_cache_dtype.Carrier in the int4 format): decode,
ragged and paged prefill, split + RoPE + quantize, merge of attention states, each on buffers laid out as TVM's
runtime allocates the float32 carrier, against numpy: K/V quantized the same way (per token, KV head and group of 16
channels, scale = (max - min) / 15 and min, codes round((x - min) / scale), code 2j in byte j's low nibble),
attention over the dequantized values (test_cpu_attention.py's references). SmolLM2's geometry (9 query heads,
3 KV heads, head_dim 64: GQA group 3), contexts on and off page boundaries; negative controls: a wrong stored scale
or min is caught, and so are nibbles read in the wrong order. Both quantized formats refuse rotary_mode 1.
ReplaceCPUAttention on a tiny model's int4 module; NEON-width builds."""

import functools
import re

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

from compiler.errors import MobilecError
from compiler.kernels.cpu_attention import (
    DECODE_SYMBOL,
    MERGE_SYMBOL,
    PAGED_PREFILL_SYMBOL,
    RAGGED_SYMBOL,
    ROTARY_REFUSAL,
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
from compiler.passes.replace_cpu_attention import ReplaceCPUAttention
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
from tests.kernels.test_cpu_attention_int8 import _numpy_rope

H_QO, H_KV = 9, 3
SHAPE = AttentionShape(H_KV, H_QO, D, "int4", PAGE)
CARRIER = Carrier(CODE_FORMATS["int4"], H_QO, H_KV, D)
HQ_DECL, HKV_DECL, CELL = SHAPE.declared


def test_carrier_geometry():
    """SmolLM2: 8 floats a cell, 3 code rows + 3 parameter rows (a cell for each of K's 8 groups and V's 4 of each
    of 3 heads: the K plane's 24 cells), 120 fused rows, 108 declared query heads of which the first 72 hold q."""
    assert ((CARRIER.group(0), CARRIER.group(1)), CARRIER.cell, CARRIER.declared_kv_heads, CARRIER.fused_rows,
            CARRIER.declared_heads, CARRIER.q_rows) == ((8, 16), 8, 6, 120, 108, 72)
    k_cells = [CARRIER.param_position(h, g, 0) for h in range(H_KV) for g in range(8)]
    assert k_cells == [(3 + j // 8, j % 8) for j in range(24)]
    v_cells = [CARRIER.param_position(h, g, 1) for h in range(H_KV) for g in range(4)]
    assert v_cells == [(3 + j // 8, j % 8) for j in range(12)]
    assert CARRIER.declared_heads * CARRIER.cell >= H_QO * D
    tiny = Carrier(CODE_FORMATS["int4"], 4, 2, 16)  # K: 2 groups of 8, V: 1 of 16; 2-float cells: K's 4 take 2 rows
    assert ((tiny.group(0), tiny.group(1)), tiny.cell, tiny.param_rows, tiny.declared_kv_heads,
            tiny.declared_heads) == ((8, 16), 2, 2, 4, 56)
    assert (Carrier(CODE_FORMATS["int4"], 4, 2, 40).group(0), Carrier(CODE_FORMATS["int4"], 4, 2, 40).group(1)) \
        == (8, 8)


@functools.cache
def _build(kind: str, dtype: str = "int4", lanes: int | None = None):
    lanes = lanes or vector_lanes(RUN)
    shape = AttentionShape(H_KV, H_QO, D, dtype, PAGE)
    func = {"decode": lambda: attention_decode(shape, lanes),
            "ragged": lambda: attention_prefill_ragged(shape, lanes),
            "paged": lambda: attention_prefill_paged(shape, lanes),
            "split": lambda: quantized_split_rotary(shape, ROPE_THETA, ROPE_SCALE),
            "merge": lambda: carrier_merge_state(shape)}[kind]()
    return tvm.tirx.build(tvm.IRModule({"main": func}), target=RUN)["main"]


def bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to bfloat16 (nearest, ties to even), as float32."""
    bits = np.asarray(x, "float32").view("uint32").astype("uint64")
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype("uint32").view("float32")


def cells(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Parameter cells: bfloat16 scale in the low half, min in the high half (cpu_attention.param_cell)."""
    return ((bfloat16(scales).view("uint32") >> 16) | bfloat16(mins).view("uint32")).view("float32")


def uncell(cell: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    bits = np.asarray(cell, "float32").view("uint32")
    return (bits << 16).view("float32"), (bits & 0xFFFF0000).view("float32")


def quantize(x: np.ndarray, kv: int):
    """int4 codes (uint8, 0..15, the shape of x), scales and mins (bfloat16 values; x's shape with the last axis
    cut to its groups) of K (kv 0) or V (kv 1) rows, as the split kernel makes them."""
    gs = CARRIER.group(kv)
    grouped = x.reshape(*x.shape[:-1], D // gs, gs)
    lo, hi = grouped.min(axis=-1).astype("float32"), grouped.max(axis=-1).astype("float32")
    scales, mins = bfloat16((hi - lo) / np.float32(15)), bfloat16(lo)
    inv = np.where(scales > 0, np.float32(1) / np.where(scales > 0, scales, 1), 0).astype("float32")
    codes = np.clip(np.round((grouped - mins[..., None]) * inv[..., None]), 0, 15).astype("uint8")
    return codes.reshape(x.shape), scales, mins


def dequantize(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, kv: int) -> np.ndarray:
    gs = CARRIER.group(kv)
    grouped = codes.reshape(*codes.shape[:-1], D // gs, gs).astype("float32")
    return (grouped * scales[..., None] + mins[..., None]).reshape(codes.shape)


def pack_rows(x: np.ndarray, kv: int):
    """Real K (kv 0) or V (kv 1) rows (..., H_KV, D) -> the carrier's (..., HKV_DECL, CELL) float32 rows of packed
    codes and parameter cells; returns (carrier, dequantized x)."""
    codes, scales, mins = quantize(x, kv)
    lead = x.shape[:-2]
    out = np.zeros((*lead, HKV_DECL, CELL), "float32")
    out.view("uint8").reshape(*lead, HKV_DECL, D // 2)[..., :H_KV, :] = codes[..., 0::2] | codes[..., 1::2] << 4
    packed = cells(scales, mins)
    for h in range(H_KV):
        for group in range(D // CARRIER.group(kv)):
            row, cell = CARRIER.param_position(h, group, kv)
            out[..., row, cell] = packed[..., h, group]
    return out, dequantize(codes, scales, mins, kv)


def scaled_param(carrier: np.ndarray, kv: int, i: int, group: int, factor: float) -> np.ndarray:
    """Carrier pages (n, 2, HKV_DECL, P, CELL) with parameter i (0: scale, 1: min) of group `group` of every K
    (kv 0) or V (kv 1) row times `factor`."""
    bad = carrier.copy()
    for h in range(H_KV):
        row, cell = CARRIER.param_position(h, group, kv)
        params = list(uncell(bad[:, kv, row, :, cell]))
        params[i] = params[i] * np.float32(factor)
        bad[:, kv, row, :, cell] = cells(*params)
    return bad


def pack_pages(pages: np.ndarray):
    """Float pages (n, 2, H_KV, P, D) -> the carrier pages (n, 2, HKV_DECL, P, CELL) and the dequantized pages."""
    t = np.nan_to_num(pages.transpose(0, 1, 3, 2, 4))  # (n, 2, P, H_KV, D)
    packed = [pack_rows(t[:, kv], kv) for kv in (0, 1)]
    carrier, deq = (np.stack([p[j] for p in packed], axis=1) for j in (0, 1))
    carrier = np.ascontiguousarray(carrier.transpose(0, 1, 3, 2, 4))
    # the rows past a sequence's end (NaN in _cache) get NaN parameters: a kernel reading them gives NaN
    carrier[:, :, H_KV:].transpose(0, 1, 3, 2, 4)[np.isnan(pages[:, :, 0, :, 0])] = np.nan
    return carrier, deq.transpose(0, 1, 3, 2, 4).astype("float32")


def to_q_carrier(q: np.ndarray) -> np.ndarray:
    out = np.zeros((q.shape[0], HQ_DECL * CELL), "float32")
    out[:, :H_QO * D] = q.reshape(q.shape[0], -1)
    return out.reshape(q.shape[0], HQ_DECL, CELL)


def from_q_carrier(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1)[:, :H_QO * D].reshape(x.shape[0], H_QO, D)


def _int4_cache(ctx, seed=0):
    cache = _cache(ctx, H_KV, H_QO, seed=seed)
    carrier, deq = pack_pages(cache["pages"])
    return dict(cache, pages=carrier), dict(cache, pages=deq)


def _decode(cache: dict, q: np.ndarray, rotary_mode: int = 0, dtype: str = "int4"):
    b = q.shape[0]
    out, lse = tvm.runtime.empty((b, HQ_DECL, CELL), "float32"), tvm.runtime.empty((b, HQ_DECL), "float32")
    _build("decode", dtype)(tvm.runtime.tensor(to_q_carrier(q)), tvm.runtime.tensor(cache["pages"]),
                            tvm.runtime.tensor(cache["indptr"]), tvm.runtime.tensor(cache["values"]),
                            tvm.runtime.tensor(cache["last"]), tvm.runtime.tensor(np.zeros(b, "int32")),
                            tvm.runtime.tensor(np.zeros(b, "int32")), out, lse, rotary_mode, ROPE_SCALE, ROPE_THETA,
                            SM_SCALE)
    return from_q_carrier(out.numpy()), lse.numpy()[:, :H_QO]


@pytest.mark.parametrize("ctx", [[1], [16], [37], [130, 5], [300], [64, 0]])
def test_decode_matches_numpy_on_dequantized_values(ctx):
    packed, deq = _int4_cache(ctx)
    out, lse = _decode(packed, packed["q"])
    ref_out, ref_lse = _numpy_reference(deq)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=3e-5)
    # and near attention over the unquantized values (what int4 costs on random normal rows: 0.12-0.36 here)
    float_out, _ = _numpy_reference(_cache(ctx, H_KV, H_QO))
    assert np.abs(out - float_out).max() < 0.6


@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_decode_at_every_vector_width(lanes):
    """NEON's 4 lanes (a vector within a group), AVX2's 8 (K's group exactly) and AVX-512's 16 (two K groups and one
    V group in a vector: the parameters go lane by lane)."""
    packed, deq = _int4_cache([45, 3])
    b = packed["q"].shape[0]
    out, lse = tvm.runtime.empty((b, HQ_DECL, CELL), "float32"), tvm.runtime.empty((b, HQ_DECL), "float32")
    _build("decode", "int4", lanes)(
        tvm.runtime.tensor(to_q_carrier(packed["q"])), tvm.runtime.tensor(packed["pages"]),
        tvm.runtime.tensor(packed["indptr"]), tvm.runtime.tensor(packed["values"]),
        tvm.runtime.tensor(packed["last"]), tvm.runtime.tensor(np.zeros(b, "int32")),
        tvm.runtime.tensor(np.zeros(b, "int32")), out, lse, 0, ROPE_SCALE, ROPE_THETA, SM_SCALE)
    ref_out, _ = _numpy_reference(deq)
    np.testing.assert_allclose(from_q_carrier(out.numpy()), ref_out, rtol=1e-5, atol=3e-6)


def test_decode_negative_controls():
    """The second groups' scales or mins doubled (K's: the scores change; V's: the output) are caught, and so are
    the two nibbles of
    each byte swapped. (A shift of every K row's min by one constant would not be: it adds the same q . shift to
    every score of a query, which the softmax cancels.)"""
    packed, deq = _int4_cache([70])
    good, _ = _decode(packed, packed["q"])
    ref, _ = _numpy_reference(deq)
    np.testing.assert_allclose(good, ref, rtol=1e-5, atol=3e-6)
    for kv in (0, 1):
        for i in (0, 1):
            bad = scaled_param(packed["pages"], kv, i, 1, 2.0)  # the second group's
            out, _ = _decode(dict(packed, pages=bad), packed["q"])
            assert np.abs(out - ref).max() > 1e-2, (kv, i)
    bad = packed["pages"].copy()
    code_bytes = bad.view("uint8")[:, :, :H_KV]  # (pages, 2, H_KV, P, D / 2)
    code_bytes[:] = (code_bytes >> 4) | (code_bytes << 4)
    out, _ = _decode(dict(packed, pages=bad), packed["q"])
    assert np.abs(out - ref).max() > 1e-2


@pytest.mark.parametrize("q_lens,causal", [([5], 1), ([37], 1), ([20, 0, 7], 1), ([19, 6], 0)])
def test_ragged_prefill_matches_numpy(q_lens, causal):
    data = _ragged_data(q_lens, q_lens, H_KV, H_QO)
    k_car, k_deq = pack_rows(data["k"], 0)
    v_car, v_deq = pack_rows(data["v"], 1)
    n = data["q"].shape[0]
    out, lse = tvm.runtime.empty((n, HQ_DECL, CELL), "float32"), tvm.runtime.empty((n, HQ_DECL), "float32")
    _build("ragged")(tvm.runtime.tensor(to_q_carrier(data["q"])), tvm.runtime.tensor(data["q_indptr"]),
                     tvm.runtime.tensor(k_car), tvm.runtime.tensor(v_car), tvm.runtime.tensor(data["kv_indptr"]),
                     tvm.runtime.tensor(data["q_pos"]), tvm.runtime.tensor(data["k_offset"]), out, lse, causal, 0,
                     ROPE_SCALE, ROPE_THETA, SM_SCALE)
    ref_out, ref_lse = _numpy_ragged(dict(data, k=k_deq, v=v_deq), causal)
    np.testing.assert_allclose(from_q_carrier(out.numpy()), ref_out, rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse.numpy()[:, :H_QO], ref_lse, rtol=1e-5, atol=3e-5)


def _paged(packed: dict, q: np.ndarray, q_indptr: np.ndarray, rotary_mode: int = 0, dtype: str = "int4"):
    n = q.shape[0]
    out, lse = tvm.runtime.empty((n, HQ_DECL, CELL), "float32"), tvm.runtime.empty((n, HQ_DECL), "float32")
    _build("paged", dtype)(tvm.runtime.tensor(to_q_carrier(q)), tvm.runtime.tensor(q_indptr),
                           tvm.runtime.tensor(packed["pages"]), tvm.runtime.tensor(packed["indptr"]),
                           tvm.runtime.tensor(packed["values"]), tvm.runtime.tensor(packed["last"]),
                           tvm.runtime.tensor(np.zeros(len(q_indptr) - 1, "int32")),
                           tvm.runtime.tensor(np.zeros(n, "int32")), out, lse, 0, rotary_mode, ROPE_SCALE,
                           ROPE_THETA, SM_SCALE)
    return from_q_carrier(out.numpy()), lse.numpy()[:, :H_QO]


@pytest.mark.parametrize("q_lens,ctx", [([5], [37]), ([16, 3], [128, 45]), ([3, 4], [20, 0])])
def test_paged_prefill_matches_numpy(q_lens, ctx):
    packed, deq = _int4_cache(ctx, seed=6)
    q = (2 * np.random.default_rng(7).standard_normal((sum(q_lens), H_QO, D))).astype("float32")
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype("int32")
    out, lse = _paged(packed, q, q_indptr)
    # not causal: each query row is a decode step against its sequence's pages
    rows = [dict(deq, q=q[q_indptr[s]:q_indptr[s + 1]][i:i + 1], indptr=deq["indptr"][s:s + 2],
                 last=deq["last"][s:s + 1]) for s in range(len(q_lens)) for i in range(q_lens[s])]
    refs = [_numpy_reference(r) for r in rows]
    np.testing.assert_allclose(out, np.concatenate([r[0] for r in refs]), rtol=1e-5, atol=3e-6)
    np.testing.assert_allclose(lse, np.concatenate([r[1] for r in refs]), rtol=1e-5, atol=3e-5)


@functools.cache
def _tvm_split():
    func = llama_rope_with_position_map(ROPE_THETA, ROPE_SCALE, D, H_QO, H_KV, "float32", {})
    return tvm.tirx.build(tvm.IRModule({"main": func}), target=RUN)["main"]


@pytest.mark.parametrize("apply_rope", [1, 0])
def test_split_rotary_quantizes_k_after_rope_and_v(apply_rope):
    n = 21
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype("float32")
    qkv[4, H_QO + H_KV] = 0.25  # a constant V row: scale 0, every code 0, the min is the value
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
    rope = _numpy_rope if apply_rope else lambda x, _: x
    np.testing.assert_allclose(tvm_q.numpy(), rope(qkv[:, :H_QO], pos), atol=3e-4)
    for kv, got, want in ((0, k.numpy(), tvm_k.numpy()), (1, v.numpy(), tvm_v.numpy())):
        groups = D // CARRIER.group(kv)
        ref_car, ref_deq = pack_rows(want, kv)
        ref_scales, ref_mins = quantize(want, kv)[1:]
        got_bytes = got.view("uint8").reshape(n, HKV_DECL, D // 2)[:, :H_KV]
        codes = np.stack([got_bytes & 15, got_bytes >> 4], axis=-1).reshape(n, H_KV, D).astype(int)
        ref_codes = quantize(want, kv)[0].astype(int)
        assert np.abs(codes - ref_codes).max() <= 1 and (codes == ref_codes).mean() > 0.99
        scales, mins = (np.stack([np.stack([uncell(got[:, row, cell])[i] for row, cell in (
            CARRIER.param_position(h, g, kv) for g in range(groups))], -1) for h in range(H_KV)], 1) for i in (0, 1))
        # bfloat16 values: the kernel's k (its own RoPE) may round to the neighbour of TVM's
        np.testing.assert_allclose(scales, ref_scales, rtol=2**-7)
        np.testing.assert_allclose(mins, ref_mins, rtol=2**-7, atol=1e-30)
        got_deq = dequantize(codes, scales, mins, kv)
        np.testing.assert_allclose(got_deq, ref_deq, atol=1.01 * scales.max() + 1e-6)
        # half a step from the codes, and the min's bfloat16 rounding; negative control: truncated codes are not
        bound = 0.51 * scales.max() + 2**-8 * np.abs(mins).max() + 1e-6
        assert np.abs(got_deq - want).max() <= bound
        steps = (want.reshape(*scales.shape, -1) - mins[..., None]) / np.where(scales > 0, scales, 1)[..., None]
        truncated = np.clip(np.floor(steps), 0, 15).reshape(want.shape)
        assert np.abs(dequantize(truncated, scales, mins, kv) - want).max() > bound
    constant = v.numpy()[4]
    for group in range(D // CARRIER.group(1)):
        scale, low = uncell(constant[CARRIER.param_position(0, group, 1)])
        assert (scale, low) == (0, np.float32(0.25))
    assert not constant[0].view("uint8").any()


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


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_quantized_kernels_refuse_inline_rope(dtype):
    """K is stored after RoPE: rotary_mode 1 fails with the reason instead of attending without RoPE (as the float
    caches' kernels do: test_cpu_attention.py); mode 0 runs (one sequence of 5 zero rows)."""
    hq, hkv, cell = AttentionShape(H_KV, H_QO, D, dtype, PAGE).declared

    def zeros(*shape):
        return tvm.runtime.tensor(np.zeros(shape, "float32"))

    def ints(*values):
        return tvm.runtime.tensor(np.array(values, "int32"))

    q, out, lse = zeros(1, hq, cell), zeros(1, hq, cell), zeros(1, hq)
    pages, rows = zeros(1, 2, hkv, PAGE, cell), zeros(1, hkv, cell)
    rope = (ROPE_SCALE, ROPE_THETA, SM_SCALE)
    calls = {
        "decode": lambda mode: _build("decode", dtype)(q, pages, ints(0, 1), ints(0), ints(5), ints(0), ints(0), out,
                                                       lse, mode, *rope),
        "ragged": lambda mode: _build("ragged", dtype)(q, ints(0, 1), rows, rows, ints(0, 1), ints(0), ints(0), out,
                                                       lse, 1, mode, *rope),
        "paged": lambda mode: _build("paged", dtype)(q, ints(0, 1), pages, ints(0, 1), ints(0), ints(5), ints(0),
                                                     ints(0), out, lse, 1, mode, *rope),
    }
    for kind, call in calls.items():
        call(0)
        with pytest.raises(Exception, match=re.escape(ROTARY_REFUSAL)):
            call(1)
            pytest.fail(kind)


# ---------------------------------------------------------------------------------------------------------
# The pass, on a tiny Llama's exported module


@pytest.fixture(scope="module")
def tiny_int4_module(tmp_path_factory):
    from compiler.model_import.importer import import_model, open_model
    from compiler.target.build_plan import resolve_plan
    from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

    d = tmp_path_factory.mktemp("tiny") / "hf"
    save_compilable_checkpoint(build_model("llama_gqa"), d)
    with open_model(str(d)) as ckpt:
        return import_model(ckpt, resolve_plan("host", "q0f32", kv_dtype="int4"), 64).mod


def test_pass_replaces_all_five_kernels_of_an_int4_cache(tiny_int4_module):
    mod = tiny_int4_module
    assert str(mod.attrs[KV_FORMAT_ATTR]["format"]) == "int4"
    swapped = ReplaceCPUAttention(8)(mod)
    shape = AttentionShape(2, 4, 16, "int4", PAGE)  # the tiny model's real geometry, from the module attr
    theta = float(mod.attrs[KV_FORMAT_ATTR]["rope_theta"])
    for symbol, build in ((DECODE_SYMBOL, lambda: attention_decode(shape, 8)),
                          (RAGGED_SYMBOL, lambda: attention_prefill_ragged(shape, 8)),
                          (PAGED_PREFILL_SYMBOL, lambda: attention_prefill_paged(shape, 8)),
                          (SPLIT_ROTARY_SYMBOL, lambda: quantized_split_rotary(shape, theta)),
                          (MERGE_SYMBOL, lambda: carrier_merge_state(shape))):
        old, new = mod[symbol], swapped[symbol]
        tvm.ir.assert_structural_equal(new, build().with_attrs({**dict(old.attrs), "tirx.noalias": True}))
    # negative control: the int8 variant of the same geometry is another kernel
    with pytest.raises(ValueError):
        tvm.ir.assert_structural_equal(swapped[DECODE_SYMBOL], attention_decode(
            AttentionShape(2, 4, 16, "int8", PAGE), 8).with_attrs(dict(swapped[DECODE_SYMBOL].attrs)))


def test_pass_refuses_an_int4_geometry_the_kernels_do_not_take(tiny_int4_module):
    """head_dim 16 in 32-lane vectors: TVM's kernels would misread the carrier, so the build fails, in one line."""
    with pytest.raises(MobilecError, match="--kv-dtype int4"):
        ReplaceCPUAttention(32)(tiny_int4_module)


def test_neon_width_builds_for_aarch64():
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]})
    lanes = vector_lanes(arm)
    for func in (attention_decode(SHAPE, lanes), attention_prefill_ragged(SHAPE, lanes),
                 attention_prefill_paged(SHAPE, lanes)):
        assert "fmla" in tvm.tirx.build(tvm.IRModule({"main": func}), target=arm).inspect_source("asm")
