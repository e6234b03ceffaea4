"""Group-wise packing and dequantization: numpy reference, the TE kernel, padding, and GGUF blocks."""

import gguf
import numpy as np
import pytest
import tvm
from tvm import te

from compiler.quantization import dequantize_te as D
from compiler.quantization import group as G
from compiler.quantization.gguf_blocks import LAYOUTS, convert_blocks, convert_joined
from compiler.quantization.schemes import SCHEMES

LAYOUTS_UNDER_TEST = [s.layout for s in SCHEMES.values() if s.layout is not None]


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 1 << bits, size=(5, 64), dtype=np.uint8)
    packed = G.pack_codes(codes, bits)
    assert packed.shape == (5, 64 * bits // 8) and packed.dtype == np.uint8
    assert np.array_equal(G.unpack_codes(packed, bits), codes)
    if bits == 4:  # ggml's nibble order: code j low and code j + 16 high in byte j of each 32-code block
        assert packed[0, 0] == codes[0, 0] | (codes[0, 16] << 4) and packed[0, 16] == codes[0, 32] | (codes[0, 48] << 4)


@pytest.mark.parametrize("layout", LAYOUTS_UNDER_TEST, ids=lambda l: l.describe())
@pytest.mark.parametrize("k", [576, 72, 100])  # 576 % 128 != 0 and 100 % 32 != 0: padded, not refused
def test_quantize_error_is_bounded_by_half_a_step(layout, k):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, k)).astype(np.float32)
    stored = G.quantize(w, layout)
    for suffix, (shape, dtype) in layout.shapes(16, k).items():
        assert stored[suffix].shape == shape and stored[suffix].dtype == np.dtype(dtype), suffix
    back = G.dequantize(stored, layout, k)
    assert back.shape == w.shape
    step = np.abs(np.repeat(stored["q_scale"].astype(np.float32), layout.group, axis=1)[:, :k])
    err = np.abs(back - w) - 2e-3 * np.abs(w) - 1e-6  # allow for the scale's own rounding to its dtype
    if layout.symmetric:
        # Values inside the grid's range are rounded to the nearest level; the searched scale may clip the rest.
        inside = (np.abs(w) <= (layout.offset - 1) * step)
        assert np.all(err[inside] <= 0.5 * step[inside])
        assert inside.mean() > 0.9
        # The search never loses to the plain rule (largest magnitude onto -2^(bits-1)) by more than its codes'
        # rounding; at 8 bits it wins on some Gaussian groups by widening the grid.
        groups = np.pad(w, ((0, 0), (0, layout.padded_k(k) - k))).reshape(16, -1, layout.group)
        peak = np.take_along_axis(groups, np.abs(groups).argmax(axis=2)[:, :, None], axis=2)
        s = (peak / -layout.offset).astype(layout.scale_dtype).astype(np.float32)
        codes = np.clip(np.round(groups / s) + layout.offset, 0, (1 << layout.bits) - 1)
        plain_back = ((codes - layout.offset) * s).reshape(16, -1)[:, :k]
        per_group = lambda x: np.pad(np.square(x - w), ((0, 0), (0, layout.padded_k(k) - k))).reshape(16, -1, layout.group).sum(2)
        assert np.all(per_group(back) <= per_group(plain_back) * (1 + 1e-2) + 1e-9)
        if layout.bits == 8:
            assert (per_group(back) < 0.99 * per_group(plain_back)).any()
        else:  # 4 bits keep the plain grid, codes taken as llama.cpp's Q4_0 takes them (group._symmetric)
            base = peak / np.float32(-layout.offset)
            llama_codes = np.clip(np.floor(groups * (np.float32(1) / base) + np.float32(layout.offset + 0.5)), 0, 15)
            np.testing.assert_allclose(back, ((llama_codes - layout.offset) * s).reshape(16, -1)[:, :k], rtol=1e-6,
                                       atol=1e-7)
    else:
        assert np.all(err <= 0.5 * step)
        # The extremes of each group are represented (almost) exactly: outliers matter most in LLMs.
        groups = np.pad(w, ((0, 0), (0, layout.padded_k(k) - k))).reshape(16, -1, layout.group)
        peak = np.abs(groups).argmax(axis=2)
        cols = (np.arange(groups.shape[1])[None, :] * layout.group + peak).clip(max=k - 1)
        np.testing.assert_allclose(np.take_along_axis(back, cols, 1), np.take_along_axis(w, cols, 1), rtol=2e-3, atol=1e-6)
    # negative control: a different layout's dequantization of the same words is far off
    other = G.GroupLayout(layout.bits, layout.group, not layout.symmetric, layout.scale_dtype)
    if other.symmetric:
        assert np.abs(G.dequantize({"q_weight": stored["q_weight"], "q_scale": stored["q_scale"]}, other, k) - w).max() > 0.1


def _assert_te_dequantize_reads(stored: dict, layout: G.GroupLayout, k: int, want: np.ndarray) -> None:
    """The TE dequantize of `stored` (in `layout`) gives `want` exactly."""
    names = ["q_weight", "q_scale"] + ([] if layout.symmetric else ["q_min"])
    placeholders = [te.placeholder(stored[x].shape, str(stored[x].dtype), x) for x in names]
    out = D.dequantize_te(layout, k, "float32")(*placeholders)
    lib = tvm.compile(te.create_prim_func([*placeholders, out]), target="llvm")
    result = tvm.runtime.tensor(np.zeros(want.shape, np.float32))
    lib(*[tvm.runtime.tensor(stored[x]) for x in names], result)
    np.testing.assert_array_equal(result.numpy(), want)


@pytest.mark.parametrize("layout", LAYOUTS_UNDER_TEST, ids=lambda l: l.describe())
def test_te_dequantize_matches_numpy(layout):
    n, k = 8, 100
    rng = np.random.default_rng(2)
    stored = G.quantize(rng.standard_normal((n, k)).astype(np.float32), layout)
    _assert_te_dequantize_reads(stored, layout, k, G.dequantize(stored, layout, k))


NEON_LAYOUTS = [G.GroupLayout(8, 32, True, "float16"), G.GroupLayout(8, 128, True, "float16"),
                G.GroupLayout(8, 32, False, "float32")]


@pytest.mark.parametrize("layout", NEON_LAYOUTS, ids=lambda l: l.describe())
@pytest.mark.parametrize("k", [576, 160, 100])  # 576: 4 sets and 2 blocks in place; 160: 1 and 1; 100: codes past
def test_neon_code_order_interleaves_8_bit_steps_by_words(layout, k):
    """The ARM kernels' order of 8-bit codes: each set of 4 blocks (128 bytes) interleaved by 4 bytes, word c of
    block i at word 4 c + i, so that 16 bytes hold word c of the 4 blocks; the blocks past the last set in place,
    codes about 128 signed; numpy and the TE dequantize read it back to the plain order's values. Negative control:
    the stored bytes read as the plain order are other values. 16-value groups keep the plain order."""
    neon = layout.with_code_order("neon")
    assert neon.code_order == "neon"
    for other in (G.GroupLayout(8, 16, True, "float32"), G.GroupLayout(4, 16, True, "float32")):
        assert other.with_code_order("neon").code_order == "plain"
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, k)).astype(np.float32)
    plain, ordered = G.quantize(w, layout), G.quantize(w, neon)
    assert np.array_equal(G.plain_codes(ordered["q_weight"], neon), plain["q_weight"])
    np.testing.assert_array_equal(G.dequantize(ordered, neon, k), G.dequantize(plain, layout, k))
    row, stored = plain["q_weight"][3], ordered["q_weight"][3] ^ (0x80 if neon.signed_codes else 0)
    assert neon.signed_codes == layout.symmetric
    sets = layout.stored_k(k) // 128 * 128  # bytes in whole sets of 4 blocks of 32 bytes
    for byte in range(sets):
        s, c, i, t = byte // 128, byte % 128 // 16, byte % 16 // 4, byte % 4
        assert stored[byte] == row[s * 128 + i * 32 + c * 4 + t]
    assert np.array_equal(stored[sets:], row[sets:])  # the blocks past the last set (and codes past the blocks)
    if sets or neon.signed_codes:
        assert np.abs(G.dequantize(ordered, layout, k) - G.dequantize(plain, layout, k)).max() > 0.1
    _assert_te_dequantize_reads(ordered, neon, k, G.dequantize(plain, layout, k))


@pytest.mark.parametrize("layout", [G.GroupLayout(4, 32, True, "float16"), G.GroupLayout(4, 32, False, "float16"),
                                    G.GroupLayout(4, 128, True, "float16")], ids=lambda l: l.describe())
@pytest.mark.parametrize("k", [576, 128, 96, 100])  # 576: 4 sets and 2 blocks in place; 96: no whole set
def test_neon_code_order_interleaves_4_bit_steps_by_words(layout, k):
    """The ARM kernels' order of 4-bit codes: each set of 4 blocks (64 bytes) interleaved by 4 bytes, word c of
    block i at word 4 c + i, so that 16 bytes hold word c of the 4 blocks (what an `ld4` gives from plain bytes);
    the blocks past the last set in place, codes unsigned. numpy and the TE dequantize read it back to the plain
    order's values. Negative control: the stored bytes read as the plain order are other values."""
    neon = layout.with_code_order("neon")
    assert neon.code_order == "neon" and not neon.signed_codes
    rng = np.random.default_rng(6)
    w = rng.standard_normal((8, k)).astype(np.float32)
    plain, ordered = G.quantize(w, layout), G.quantize(w, neon)
    assert np.array_equal(G.plain_codes(ordered["q_weight"], neon), plain["q_weight"])
    np.testing.assert_array_equal(G.dequantize(ordered, neon, k), G.dequantize(plain, layout, k))
    row, stored = plain["q_weight"][3], ordered["q_weight"][3]
    sets = layout.stored_k(k) // 128 * 64  # bytes in whole sets of 4 blocks of 16 bytes
    for byte in range(sets):
        s, c, i, t = byte // 64, byte % 64 // 16, byte % 16 // 4, byte % 4
        assert stored[byte] == row[s * 64 + i * 16 + c * 4 + t]
    assert np.array_equal(stored[sets:], row[sets:])  # the blocks past the last set
    if sets:
        assert np.abs(G.dequantize(ordered, layout, k) - G.dequantize(plain, layout, k)).max() > 0.1
    _assert_te_dequantize_reads(ordered, neon, k, G.dequantize(plain, layout, k))


@pytest.mark.parametrize("layout", [G.GroupLayout(4, 32, True, "float16"), G.GroupLayout(4, 32, False, "float16"),
                                    G.GroupLayout(4, 128, True, "float16")], ids=lambda l: l.describe())
@pytest.mark.parametrize("k", [576, 96, 100])
def test_neon_pairs_order_merges_two_rows_a_nibble_each(layout, k):
    """4-bit codes of an even number of rows: per pair and 16-byte chunk of the neon order, 32 bytes, the chunk's
    low nibbles of both rows then its high ones, the first row's code low and the second's ^ 8 high, so that a byte
    read as int8 is c + 16 (c' - 8). numpy and the TE dequantize (and the row gather) read it back to the plain
    order's values. Odd rows or 8-bit codes fall back to the neon order. Negative control: the bytes read as the
    neon order are other values."""
    pairs = layout.with_code_order("neon_pairs", 8)
    assert pairs.code_order == "neon_pairs"
    assert layout.with_code_order("neon_pairs", 7).code_order == "neon"
    assert G.GroupLayout(8, 32, True, "float16").with_code_order("neon_pairs", 8).code_order == "neon"
    with pytest.raises(ValueError, match="rows"):
        layout.with_code_order("neon_pairs")
    rng = np.random.default_rng(8)
    w = rng.standard_normal((8, k)).astype(np.float32)
    neon_layout = layout.with_code_order("neon")
    plain, neon, paired = G.quantize(w, layout), G.quantize(w, neon_layout), G.quantize(w, pairs)
    assert np.array_equal(G.plain_codes(paired["q_weight"], pairs), plain["q_weight"])
    np.testing.assert_array_equal(G.dequantize(paired, pairs, k), G.dequantize(plain, layout, k))
    stored = paired["q_weight"].reshape(4, -1)  # a pair's bytes: its two rows one after the other
    rows = neon["q_weight"]
    for pair, chunk, nibble, byte in [(0, 0, 0, 0), (1, 2, 1, 5), (3, rows.shape[1] // 16 - 1, 1, 15)]:
        first, second = (int(rows[2 * pair + r, chunk * 16 + byte]) >> (4 * nibble) & 15 for r in (0, 1))
        value = int(stored[pair, chunk * 32 + nibble * 16 + byte])
        assert value == first | ((second ^ 8) << 4)
        assert value - 256 * (value >= 128) == first + 16 * (second - 8)  # the byte as int8
    assert np.abs(G.dequantize(paired, neon_layout, k) - G.dequantize(plain, layout, k)).max() > 0.1
    _assert_te_dequantize_reads(paired, pairs, k, G.dequantize(plain, layout, k))
    names = ["q_weight", "q_scale"] + ([] if layout.symmetric else ["q_min"])
    placeholders = [te.placeholder(paired[x].shape, str(paired[x].dtype), x) for x in names]
    ids = np.array([7, 0, 3, 3], dtype=np.int32)  # both rows of pairs, odd and even
    ph_ids = te.placeholder((4,), "int32", "ids")
    taken = D.take_dequantize_te(pairs, k, "float32")(ph_ids, *placeholders)
    lib = tvm.compile(te.create_prim_func([ph_ids, *placeholders, taken]), target="llvm")
    result = tvm.runtime.tensor(np.zeros((4, k), np.float32))
    lib(tvm.runtime.tensor(ids), *[tvm.runtime.tensor(paired[x]) for x in names], result)
    np.testing.assert_array_equal(result.numpy(), G.dequantize(plain, layout, k)[ids])


def test_take_dequantize_gathers_rows():
    layout = SCHEMES["q4f16_g32"].layout
    rng = np.random.default_rng(3)
    stored = G.quantize(rng.standard_normal((10, 64)).astype(np.float32), layout)
    ids = np.array([7, 0, 7, 3], dtype=np.int32)
    ph_ids = te.placeholder((4,), "int32", "ids")
    ph = [te.placeholder(stored[x].shape, str(stored[x].dtype), x) for x in ("q_weight", "q_scale")]
    out = D.take_dequantize_te(layout, 64, "float32")(ph_ids, *ph)
    lib = tvm.compile(te.create_prim_func([ph_ids, *ph, out]), target="llvm")
    result = tvm.runtime.tensor(np.zeros((4, 64), np.float32))
    lib(tvm.runtime.tensor(ids), tvm.runtime.tensor(stored["q_weight"]), tvm.runtime.tensor(stored["q_scale"]), result)
    np.testing.assert_array_equal(result.numpy(), G.dequantize(stored, layout, 64)[ids])


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])  # K-quants: tests/quantization/test_gguf_k_quants.py
def test_gguf_blocks_keep_exact_values(ggml_type):
    """Our re-layout of Q4_0/Q4_1/Q8_0 dequantizes to exactly what ggml's reference dequantizer gives."""
    qtype = gguf.GGMLQuantizationType[ggml_type]
    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 192)).astype(np.float32)  # 6 blocks: a 4-bit set of 4 and 2 in place
    raw = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(raw, qtype).reshape(6, 192)
    # as ARM targets store them: 4-bit rows in pairs, 8-bit in the neon order
    for layout in (LAYOUTS[ggml_type], LAYOUTS[ggml_type].with_code_order("neon_pairs", 6)):
        assert (layout.code_order != "plain") == (layout is not LAYOUTS[ggml_type])
        got = G.dequantize(convert_blocks(ggml_type, raw.reshape(6, -1), layout), layout, 192)
        np.testing.assert_array_equal(got, want)
    if ggml_type == "Q8_0":  # the neon order's signed codes are the file's own bytes
        layout = LAYOUTS[ggml_type].with_code_order("neon")
        stored = convert_blocks(ggml_type, raw.reshape(6, -1), layout)["q_weight"]
        unpaired = G.plain_codes(stored, layout) ^ np.uint8(0x80)  # plain_codes also undoes the sign
        np.testing.assert_array_equal(unpaired.reshape(6, -1, 32), raw.reshape(6, -1, 34)[..., 2:])


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
def test_parts_of_a_fused_weight_are_paired_once_joined(ggml_type):
    """A fused weight (q, k, v; gate, up) is its parts joined along N: each part is converted unpaired and the rows
    are paired once joined, so parts of 3 and 5 rows give the 8-row weight's pairs (the same bytes as the weight
    converted whole), dequantized exactly as ggml does. Control: the bytes read unpaired are other values."""
    qtype = gguf.GGMLQuantizationType[ggml_type]
    w = np.random.default_rng(9).standard_normal((8, 192)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype).reshape(8, -1)
    layout = LAYOUTS[ggml_type].with_code_order("neon_pairs", 8)
    joined = convert_joined([(ggml_type, raw[:3]), (ggml_type, raw[3:])], layout)
    np.testing.assert_array_equal(joined["q_weight"], convert_blocks(ggml_type, raw, layout)["q_weight"])
    want = gguf.quants.dequantize(raw, qtype).reshape(8, 192)
    np.testing.assert_array_equal(G.dequantize(joined, layout, 192), want)
    assert np.abs(G.dequantize(joined, G.unpaired(layout), 192) - want).max() > 0.1


def test_q4f16_g32_is_gguf_q4_0_bit_for_bit():
    """The plain 4-bit grid's codes and float16 scales are the Q4_0 blocks gguf's quantizer (llama.cpp's rule) makes
    of the same weights: a q4f16_g32 artifact holds llama.cpp's own Q4_0 re-quantization. Negative control: codes
    taken against the rounded scale (the rule before) differ somewhere."""
    from gguf import GGMLQuantizationType, quants

    w = (np.random.default_rng(7).standard_normal((64, 576)) * 0.05).astype(np.float32)
    layout = G.GroupLayout(4, 32, True, "float16")
    ours = G.quantize(w, layout)
    blocks = quants.quantize(w, GGMLQuantizationType.Q4_0).reshape(64, -1, 18)
    np.testing.assert_array_equal(ours["q_scale"].view(np.uint8).reshape(64, -1, 2), blocks[..., :2])
    codes = G.unpack_codes(ours["q_weight"], 4).reshape(64, -1, 32)
    nibbles = blocks[..., 2:]
    np.testing.assert_array_equal(codes, np.concatenate([nibbles & 15, nibbles >> 4], axis=-1))
    s = ours["q_scale"].astype(np.float32)[:, :, None]
    rounded = G._symmetric_codes(w.reshape(64, -1, 32), s, layout)  # pylint: disable=protected-access
    assert (rounded != codes).any()
