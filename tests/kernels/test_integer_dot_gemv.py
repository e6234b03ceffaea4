"""Integer dot-product decode GEMV: numerics against numpy for every layout it takes and every x86 family this CPU
can run, the instructions of the families it cannot (assembly only: never executed), the shapes it refuses, and
negative controls (activations in the wrong order, a changed code). The aarch64 variants (dotprod, i8mm): their
assembly always, their numerics on the emulated arm64 device (qemu runs dotprod and i8mm) where root is available."""

import re

import numpy as np
import pytest
import tvm
from tvm.support import cc

from compiler.kernels.integer_dot_gemv import BATCH, GemvShape, family, gemv, quantize_activation
from compiler.quantization import group
from compiler.target.isa import cpu_isa
from tests.helpers.cpu import X86_FAMILY_TARGETS, assembly, innermost_loops, runs_here

N = 48
FAMILIES = list(X86_FAMILY_TARGETS)
RUNNABLE = [pytest.param(f, marks=pytest.mark.skipif(not runs_here(X86_FAMILY_TARGETS[f]),
                                                     reason=f"this CPU cannot run {f} code (its assembly is checked)"))
            for f in FAMILIES]


def _module(shape: GemvShape) -> tvm.IRModule:
    return tvm.IRModule({
        "quantize": quantize_activation(shape, (1, 1, shape.k)).with_attr("global_symbol", "quantize"),
        "gemv": gemv(shape, (1, 1, shape.n)).with_attr("global_symbol", "gemv"),
    })


def _build(shape: GemvShape):
    target = X86_FAMILY_TARGETS[shape.family]
    assert runs_here(target), f"a test must not execute {shape.family} code on this CPU"
    return tvm.tirx.build(_module(shape), target=target)


def _run(lib, shape: GemvShape, x: np.ndarray, arrays: dict, permute_activations=None, dev=None,
         names=("quantize", "gemv")) -> np.ndarray:
    """quantize then gemv, on `dev` (a remote device's CPU for the emulated arm64 device; this CPU by default)."""
    dev = dev or tvm.cpu()
    xq = tvm.runtime.empty((shape.k,), shape.act_dtype, dev)
    xs = tvm.runtime.empty((shape.lane_terms,), "float32", dev)
    xo = tvm.runtime.empty((shape.sum_terms,), "float32", dev)
    lib[names[0]](tvm.runtime.tensor(x.reshape(1, 1, -1), dev), xq, xs, xo)
    if permute_activations is not None:
        xq = tvm.runtime.tensor(permute_activations(xq.numpy()), dev)
    stored = [tvm.runtime.tensor(arrays[name], dev) for name in ("q_weight", "q_scale", "q_min") if name in arrays]
    y = tvm.runtime.empty((1, 1, shape.n), "float32", dev)
    lib[names[1]](xq, xs, xo, *stored, y)
    return y.numpy().reshape(-1)


def _layout(bits, grp, symmetric, scale_dtype, code_order="plain", n=N):
    return group.GroupLayout(bits, grp, symmetric, scale_dtype).with_code_order(code_order, n)


def _case(bits, grp, symmetric, scale_dtype, k, seed=0, act_bits=16, dot_family="avx2", n=N, code_order="plain"):
    layout = _layout(bits, grp, symmetric, scale_dtype, code_order, n)
    shape = GemvShape(n, k, bits, grp, symmetric, scale_dtype, act_bits, dot_family, code_order=layout.code_order)
    rng = np.random.default_rng(seed)
    arrays = group.quantize(rng.standard_normal((n, k)).astype("float32"), layout)
    # activations with an outlier per row, as LLM hidden states have: per-32 scales must absorb it
    x = rng.standard_normal(k).astype("float32")
    x[5] = 40.0
    return shape, arrays, x, group.dequantize(arrays, layout, k) @ x


LAYOUTS = [
    (4, 32, True, "float16", 576),  # q4f16_g32 / GGUF Q4_0, SmolLM2's hidden size
    (4, 32, False, "float16", 192),  # q4f16_g32_asym / GGUF Q4_1: 6 mins, all in the scalar tail
    (4, 32, False, "float16", 1536),  # 48 mins: three 16-wide vector steps
    (4, 128, True, "float16", 640),  # q4f16_g128: K not a multiple of the group (a short last group)
    (4, 32, True, "float32", 128),  # q4f32_g32
    (8, 128, True, "float16", 576),  # q8f16_g128
    (8, 32, True, "float16", 96),  # GGUF Q8_0 (the embedding / lm_head)
]


@pytest.mark.parametrize("dot_family", RUNNABLE)
@pytest.mark.parametrize("bits,grp,symmetric,scale_dtype,k", LAYOUTS)
def test_matches_the_dequantized_weights_times_float_activations(bits, grp, symmetric, scale_dtype, k, dot_family):
    shape, arrays, x, ref = _case(bits, grp, symmetric, scale_dtype, k, dot_family=dot_family)
    assert shape.supported()
    got = _run(_build(shape), shape, x, arrays)
    # int16 activations, one scale per 32 values: errors ~1/65534 of a block's largest value
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def _assert_int8_rounding(got, ref, x, arrays, layout, k):
    """`got` is exactly what int8 activations (a scale per 32 values) give, and within their rounding of `ref`."""
    blocks = x.reshape(-1, 32)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / 127
    x8 = (np.round(blocks / scale) * scale).reshape(-1)
    exact = group.dequantize(arrays, layout, k) @ x8
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    assert np.abs(got - ref).max() < 2e-2 * np.abs(ref).max()


@pytest.mark.parametrize("dot_family", RUNNABLE)
@pytest.mark.parametrize("bits,grp,symmetric,scale_dtype,k", LAYOUTS)
def test_int8_activations_match_within_int8_rounding(bits, grp, symmetric, scale_dtype, k, dot_family):
    """vpmaddubsw (8-bit codes centred) or VNNI (vpdpbusd): errors ~1/254 of a block's largest value, and exactly
    what the int8 activations give (no int16 overflow in the pair sums)."""
    shape, arrays, x, ref = _case(bits, grp, symmetric, scale_dtype, k, act_bits=8, dot_family=dot_family)
    got = _run(_build(shape), shape, x, arrays)
    _assert_int8_rounding(got, ref, x, arrays, group.GroupLayout(bits, grp, symmetric, scale_dtype), k)


@pytest.mark.parametrize("dot_family", [f for f in RUNNABLE if f.values[0] in ("avx2", "avxvnni")])
def test_ymm_int16_8_bit_steps_take_two_blocks(dot_family):
    """AVX2 int16, 8-bit codes (GGUF Q8_0) with an even number of blocks: a step is two 16-byte halves of each of
    two blocks, lanes 0-3 one block and 4-7 the other, and matches numpy; an odd number keeps a block a step. The
    activations of the other order (a block a step) give a wrong product: the order is the kernel's."""
    shape, arrays, x, ref = _case(8, 32, True, "float16", 576, dot_family=dot_family)
    assert (shape.blocks_per_step, shape.lanes_per_block) == (2, 4)
    assert _case(8, 32, True, "float16", 96, dot_family=dot_family)[0].blocks_per_step == 1
    lib = _build(shape)
    assert "vinserti128" in assembly(lib)
    got = _run(lib, shape, x, arrays)
    tol = 2e-4 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=tol)

    def block_order(xq):  # the activations as a step of one block stores them: even codes, then odd, per block
        values = np.empty_like(xq)
        for b in range(shape.k // 32):
            for j in range(32):
                values[b * 32 + j % 2 * 16 + j // 2] = xq[b // 2 * 64 + (j // 16 * 2 + j % 2) * 16 + b % 2 * 8
                                                          + j % 16 // 2]
        return values

    assert np.abs(_run(lib, shape, x, arrays, permute_activations=block_order) - ref).max() > 100 * tol


@pytest.mark.parametrize("dot_family", RUNNABLE)
@pytest.mark.parametrize("k", [576, 960])
@pytest.mark.parametrize("act_bits", [16, 8])
def test_asymmetric_rows_whose_mins_leave_a_partial_vector(k, act_bits, dot_family):
    """GGUF Q4_1 at SmolLM2-135M's and -360M's K: 18 and 30 groups, whose mins' term ends in a vector that overlaps
    the last whole one (the lanes counted twice are zeroed); a changed min of the overlap shows in its row only."""
    shape, arrays, x, ref = _case(4, 32, False, "float16", k, act_bits=act_bits, dot_family=dot_family)
    assert shape.k // shape.group % shape.lanes > 0 and shape.k // shape.group > shape.lanes
    lib = _build(shape)
    got = _run(lib, shape, x, arrays)
    if act_bits == 16:
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    else:
        _assert_int8_rounding(got, ref, x, arrays, group.GroupLayout(4, 32, False, "float16"), k)
    overlap = shape.k // shape.group - shape.lanes  # counted by the last whole vector and the overlapping one
    changed = dict(arrays, q_min=arrays["q_min"].copy())
    changed["q_min"][3, overlap] += 1
    diff = np.abs(_run(lib, shape, x, changed) - got)
    block = x[overlap * 32:(overlap + 1) * 32]
    expected = abs(np.abs(block).max() / shape.qmax * np.round(block / (np.abs(block).max() / shape.qmax)).sum())
    assert diff[3] == pytest.approx(expected, rel=1e-2) and np.delete(diff, 3).max() == 0


def test_zmm_int16_4_bit_steps_take_four_blocks_and_end_in_two():
    """AVX-512 int16, 4-bit codes: 64 code bytes a step as 32 words, a block in each 4 of the 16 lanes; a K of 4 n + 2
    blocks (SmolLM2's 576) ends in a ymm step of 2 blocks (numerics: the LAYOUTS tests); 4 n + 1 or 3 is refused.
    8-bit codes: 2 blocks a step, 8 lanes each, for an even number of blocks (else one, widened by vpmovzxbw)."""
    shape = GemvShape(N, 576, 4, 32, True, "float16", 16, "avx512bw")
    assert shape.supported()
    assert (shape.blocks_per_step, shape.lanes_per_block, shape.steps, shape.tail_blocks) == (4, 4, 4, 2)
    assert GemvShape(N, 1536, 4, 32, False, "float16", 16, "avx512vnni").tail_blocks == 0
    assert not GemvShape(N, 544, 4, 32, True, "float16", 16, "avx512bw").supported()
    assert GemvShape(N, 576, 8, 32, True, "float16", 16, "avx512bw").lanes_per_block == 8
    assert GemvShape(N, 96, 8, 32, True, "float16", 16, "avx512bw").blocks_per_step == 1
    # the 4 lanes of each block hold its codes' products: the activations of the ymm order give another sum
    if runs_here(X86_FAMILY_TARGETS["avx512bw"]):
        _, arrays, x, ref = _case(4, 32, True, "float16", 576, dot_family="avx512bw")
        lib = _build(shape)
        tol = 2e-4 * np.abs(ref).max()
        np.testing.assert_allclose(_run(lib, shape, x, arrays), ref, rtol=2e-4, atol=tol)

        def ymm_order(xq):  # blocks by pairs (the AVX2 order) where the whole steps take them by fours
            values = xq.copy()
            for b in range(16):
                for j in range(32):
                    nibble = j // 16 + j % 16 % 2 * 2
                    values[b // 2 * 64 + nibble * 16 + b % 2 * 8 + j % 16 // 2] = xq[
                        b // 4 * 128 + nibble * 32 + b % 4 * 8 + j % 16 // 2]
            return values

        assert np.abs(_run(lib, shape, x, arrays, permute_activations=ymm_order) - ref).max() > 100 * tol
        shape8, arrays8, x8, ref8 = _case(8, 32, True, "float16", 576, dot_family="avx512bw")
        lib8 = _build(shape8)
        np.testing.assert_allclose(_run(lib8, shape8, x8, arrays8), ref8, rtol=2e-4, atol=2e-4 * np.abs(ref8).max())

        def block_order(xq):  # a block a step (vpmovzxbw: its codes in order) where steps take blocks by pairs
            values = xq.copy()
            for b in range(18):
                for j in range(32):
                    values[b * 32 + j] = xq[b // 2 * 64 + j % 2 * 32 + b % 2 * 16 + j // 2]
            return values

        wrong = _run(lib8, shape8, x8, arrays8, permute_activations=block_order)
        assert np.abs(wrong - ref8).max() > 100 * 2e-4 * np.abs(ref8).max()


def test_negative_controls_fail_the_same_tolerance():
    shape, arrays, x, ref = _case(4, 32, True, "float16", 192)
    lib = _build(shape)
    tol = 2e-4 * np.abs(ref).max()
    # activations in natural order against codes stored low nibbles first: the kernel's layout matters
    natural = _run(lib, shape, x, arrays, permute_activations=lambda q: np.roll(q, 16))
    assert np.abs(natural - ref).max() > 100 * tol
    changed = dict(arrays, q_weight=arrays["q_weight"].copy())
    changed["q_weight"][7, 5] ^= 0x88  # one byte: codes 5 (x = 40) and 21 of row 7, each by 8
    diff = np.abs(_run(lib, shape, x, changed) - ref)
    assert diff[7] > 100 * tol and np.delete(diff, 7).max() < tol



def _batched_module(shape: GemvShape, prefix: str = "") -> dict:
    """The one-row kernels and the batched ones (BATCH activation rows), named `prefix` + quantize/gemv[_batch]."""
    return {f"{prefix}{name}": func.with_attr("global_symbol", f"{prefix}{name}") for name, func in (
        ("quantize", quantize_activation(shape, (1, 1, shape.k))), ("gemv", gemv(shape, (1, 1, shape.n))),
        ("quantize_batch", quantize_activation(shape, (1, BATCH, shape.k))),
        ("gemv_batch", gemv(shape, (1, BATCH, shape.n))))}


def _run_batched(lib, shape: GemvShape, x: np.ndarray, arrays: dict, dev=None, prefix: str = "") -> np.ndarray:
    """x [rows, K] through the batched kernels -> y [rows, N]."""
    dev = dev or tvm.cpu()
    rows = x.shape[0]
    xq = tvm.runtime.empty((rows, shape.k), shape.act_dtype, dev)
    xs = tvm.runtime.empty((rows, shape.lane_terms), "float32", dev)
    xo = tvm.runtime.empty((rows, shape.sum_terms), "float32", dev)
    lib[f"{prefix}quantize_batch"](tvm.runtime.tensor(x.reshape(1, rows, -1), dev), xq, xs, xo)
    stored = [tvm.runtime.tensor(arrays[name], dev) for name in ("q_weight", "q_scale", "q_min") if name in arrays]
    y = tvm.runtime.empty((1, rows, shape.n), "float32", dev)
    lib[f"{prefix}gemv_batch"](xq, xs, xo, *stored, y)
    return y.numpy().reshape(rows, shape.n)


def _assert_batched_rows_are_the_one_row_results(lib, shape, arrays, k, dev=None, prefix=""):
    """Every row count a serving step takes (tiles of 4, then 2, then 1): each row bit-identical to the one-row
    kernels' result for it; rows swapped swap the results (negative control: each row reads its own activations)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, k)).astype("float32")
    x[:, 5] = 40.0
    alone = np.stack([_run(lib, shape, row, arrays, dev=dev, names=(f"{prefix}quantize", f"{prefix}gemv"))
                      for row in x])
    for rows in (1, 2, 3, 4, 5, 6, 7, 8):
        np.testing.assert_array_equal(_run_batched(lib, shape, x[:rows], arrays, dev, prefix), alone[:rows],
                                      err_msg=f"{rows} rows")
    swapped = _run_batched(lib, shape, x[[1, 0, 2]], arrays, dev, prefix)
    np.testing.assert_array_equal(swapped, alone[[1, 0, 2]])
    assert not np.array_equal(swapped, alone[:3])


@pytest.mark.parametrize("dot_family", RUNNABLE)
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("bits,grp,symmetric,scale_dtype,k", [LAYOUTS[0], LAYOUTS[2], LAYOUTS[5], LAYOUTS[6]])
def test_batched_rows_equal_one_row_each(bits, grp, symmetric, scale_dtype, k, act_bits, dot_family):
    """batch_decode's GEMV (a row per sequence): the same sums, in the same float order, as the decode GEMV gives
    each row alone, so a request's tokens do not depend on the requests beside it."""
    shape, arrays, _, _ = _case(bits, grp, symmetric, scale_dtype, k, act_bits=act_bits, dot_family=dot_family)
    lib = tvm.tirx.build(tvm.IRModule(_batched_module(shape)), target=X86_FAMILY_TARGETS[dot_family])
    _assert_batched_rows_are_the_one_row_results(lib, shape, arrays, k)

def test_batched_tiles_keep_their_accumulators_in_registers():
    """AVX2, int16 activations (the host default there), SmolLM2's Q4_1 rows: no inner loop of the batched kernel
    stores a vector to the stack. A tile of 4 rows stepping both FMA chains together (8 accumulators beside 4 widened
    code vectors) spilled 3 ymm per 2 steps; a pass per chain keeps 4 live (gemv's tile)."""
    shape = GemvShape(N, 576, 4, 32, False, "float16", 16, "avx2")
    func = gemv(shape, (1, BATCH, N)).with_attr("global_symbol", "gemv_batch")
    asm = assembly(tvm.tirx.build(tvm.IRModule({"gemv_batch": func}), target=X86_FAMILY_TARGETS["avx2"]))
    loops = [loop for loop in innermost_loops(asm) if any(line.startswith("vpmaddwd") for line in loop)]
    spills = [line for loop in loops for line in loop if re.match(r"v\w*mov\w*\s+%ymm\d+, .*\(%rsp\)", line)]
    assert loops and not spills, spills


@pytest.mark.parametrize("bits,grp,k,symmetric", [(4, 32, 96, True), (4, 48, 192, True), (4, 16, 64, True),
                                                   (4, 32, 100, True), (3, 32, 64, True), (4, 64, 128, False)])
def test_refuses_shapes_it_cannot_step_through(bits, grp, k, symmetric):
    """4-bit steps take two 32-code blocks (K/64 whole), groups hold whole blocks (8-bit codes: also halves,
    tests/quantization/test_gguf_k_quants.py), bits 4 or 8, mins per 32 (or 16)."""
    assert not GemvShape(N, k, bits, grp, symmetric, "float16").supported()


# family -> (act bits -> instructions its GEMV must contain, and must not); int16 4-bit codes are widened by shifts
# and masks of their int16 words, with no shuffle (vpunpck, vpmovzxbw)
INSTRUCTIONS = {
    "avx2": {16: (["vpmaddwd", "ymm", "vpsrlw"], ["zmm", "vpdpbusd", "vpunpck", "vpmovzxbw"]), 8: (["vpmaddubsw", "vpmaddwd"], ["zmm", "vpdpbusd"])},
    "avxvnni": {16: (["vpmaddwd", "ymm", "vpsrlw"], ["zmm", "vpunpck", "vpmovzxbw"]), 8: (["{vex} vpdpbusd"], ["vpmaddubsw", "zmm"])},
    "avx512bw": {16: (["vpmaddwd", "zmm", "vpsrlw"], ["vpdpbusd", "vpmovzxbw"]), 8: (["vpmaddubsw"], ["vpdpbusd"])},
    "avx512vnni": {16: (["vpmaddwd", "zmm", "vpsrlw"], ["vpmovzxbw"]), 8: (["vpdpbusd"], ["vpmaddubsw", "{vex}"])},
}


@pytest.mark.parametrize("dot_family", FAMILIES)
@pytest.mark.parametrize("act_bits", [16, 8])
def test_each_family_emits_its_instructions(dot_family, act_bits):
    """Compiled (not run) for every family, whatever this CPU has: the dot step is the family's instruction."""
    shape = GemvShape(N, 576, 4, 32, True, "float16", act_bits, dot_family)
    asm = assembly(tvm.tirx.build(_module(shape), target=X86_FAMILY_TARGETS[dot_family]))
    body = re.sub(r"\s+", " ", asm[asm.index("gemv"):])
    must, must_not = INSTRUCTIONS[dot_family][act_bits]
    for instruction in must:
        assert instruction in body, f"{dot_family} int{act_bits}: no {instruction}"
    for instruction in must_not:
        assert instruction not in body, f"{dot_family} int{act_bits}: unexpected {instruction}"


def test_family_follows_the_target():
    assert {name: family(cpu_isa(target)) for name, target in X86_FAMILY_TARGETS.items()} == {f: f for f in FAMILIES}
    assert ({name: family(cpu_isa(target)) for name, target in ARM_FAMILY_TARGETS.items()}
            == {f: f for f in ARM_FAMILIES})
    assert family(cpu_isa(tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu",
                                             "mcpu": "x86-64-v2"}))) is None
    # NEON without the dot product (Cortex-A53/A72 class): no variant, the float GEMV stays
    assert family(cpu_isa(tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                             "mcpu": "cortex-a72"}))) is None
    assert family(cpu_isa(tvm.target.Target({"kind": "opencl"}))) is None


# aarch64: one target per integer dot-product family (compiler/target/isa.py), as the shipped target files use them
ARM = {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}
ARM_FAMILY_TARGETS = {
    "dotprod": tvm.target.Target({**ARM, "mcpu": "cortex-a76", "mattr": ["+neon", "+dotprod"]}),
    "i8mm": tvm.target.Target({**ARM, "mcpu": "cortex-x3", "mattr": ["+neon", "+dotprod", "+i8mm", "+fullfp16"]}),
}
ARM_FAMILIES = list(ARM_FAMILY_TARGETS)
# (bits, group, symmetric, scale dtype, K, code order): the order ARM targets store codes in, where the layout
# takes it (neon_pairs: 4-bit codes of an even number of rows, else neon: codes in groups of whole blocks; the others
# stay plain), the neon order of unpaired rows, and the plain order
ARM_LAYOUTS = [(*layout, "neon_pairs") for layout in LAYOUTS] + [
    (4, 32, False, "float16", 576, "neon_pairs"),  # GGUF Q4_1 at SmolLM2's hidden size: 4 steps, a 2-block last step
    (8, 32, True, "float16", 576, "neon"),  # GGUF Q8_0 lm_head: signed codes
    (4, 128, True, "float16", 576, "neon"),  # q4f16_g128: a short last group inside the last step
    (8, 32, False, "float32", 576, "neon"),  # GGUF Q5_K re-laid: 8-bit codes, a float32 scale and min per 32
    # (dotprod: centred, the 128 joining each step's mins)
    (8, 16, True, "float32", 576, "neon"),  # a scale per 16 values (as GGUF Q6_K): a block per step, a half in 2 lanes
    (8, 16, False, "float32", 576, "neon"),  # and a min per 16 (Q4_K q/k joined with a Q6_K v)
    (8, 32, True, "float16", 608, "neon"),  # 19 blocks: 4 sets and a last step of 3 blocks in place
    (8, 32, True, "float16", 96, "plain"),  # unsigned 8-bit codes: usdot with i8mm, centred (eor) sdot without
    (4, 32, False, "float16", 576, "plain"),  # GGUF's own 4-bit block layout: whole steps de-interleaved by ld4
    (4, 32, True, "float16", 608, "neon_pairs"),  # rows in pairs, a 3-block last step (taken per pair)
    (4, 32, False, "float16", 608, "neon_pairs"),
    (4, 32, True, "float16", 576, "neon"),  # 5 rows: unpaired, a row at a time
    (4, 32, False, "float16", 576, "neon"),  # unpaired rows stepping 2 together
]
# rows: 48 steps 4 rows together (asymmetric 4-bit codes: 2); 6 (tasks of 2 rows) 2; 5 one
ARM_ROWS = {index: N for index in range(len(ARM_LAYOUTS))} | {1: 6, 8: 6, 18: 5}
# family -> (instructions its GEMVs must contain, must not); 8-bit codes about 128 stored signed: sdot, no eor
ARM_INSTRUCTIONS = {
    ("dotprod", 4): (["sdot", "addp", "scvtf"], ["usdot", "ucvtf", "smmla"]),
    ("dotprod", 8): (["sdot", "addp"], ["eor", "usdot", "ucvtf", "smmla"]),
    ("i8mm", 4): (["sdot", "addp"], ["ucvtf", "smmla"]),
    ("i8mm", 8): (["sdot", "addp"], ["eor", "usdot", "ucvtf", "smmla"]),
}


@pytest.mark.parametrize("dot_family", ARM_FAMILIES)
@pytest.mark.parametrize("bits,act_bits", [(4, 8), (4, 16), (8, 8), (8, 16)])
def test_each_aarch64_family_emits_its_instructions(dot_family, bits, act_bits):
    """Compiled for aarch64 (never run here): the step is NEON dot products, the float work one convert per 4 blocks."""
    def build(order):
        shape = GemvShape(N, 576, bits, 32, True, "float16", act_bits, dot_family, code_order=order)
        return assembly(tvm.tirx.build(tvm.IRModule({"gemv": gemv(shape, (1, 1, N)).with_attr(
            "global_symbol", "gemv")}), target=ARM_FAMILY_TARGETS[dot_family]))

    def has_ld4(text):
        return bool(re.search(r"^\s+ld4\s+\{", text, flags=re.MULTILINE))

    asm = build(_layout(bits, 32, True, "float16", "neon_pairs").code_order)  # as ARM targets store the codes
    # the vector instructions of the module (it holds only the GEMV)
    words = re.findall(r"^\s+([a-z][a-z0-9.]*)\s+v\d+\.", asm, flags=re.MULTILINE)
    # the neon order's whole steps (sets of 4 blocks) are plain 16-byte loads; control: GGUF's
    # plain 4-bit blocks are de-interleaved by 4 bytes in one ld4 per step (arm.py)
    assert not has_ld4(asm)
    assert has_ld4(build("plain")) == (bits == 4)
    must, must_not = ARM_INSTRUCTIONS[dot_family, bits]
    for instruction in must:
        assert instruction in words, f"{dot_family} int{bits} a{act_bits}: no {instruction}"
    for instruction in must_not:
        assert instruction not in words, f"{dot_family} int{bits} a{act_bits}: unexpected {instruction}"
    dots = sum(words.count(d) for d in ("sdot", "usdot"))
    # 576 codes per row: 36 dot products with int8 activations, 72 with int16 (two planes)
    assert dots >= 576 // 16 * (2 if act_bits == 16 else 1)
    assert words.count("scvtf") * 4 <= dots, "more than one int-to-float convert per 4 dot products"


@pytest.mark.parametrize("dot_family", ARM_FAMILIES)
def test_aarch64_8_bit_sets_sum_each_block_in_its_own_lane(dot_family):
    """8-bit codes in the neon order (sets of 4 blocks interleaved by 4 bytes): every `sdot` of a step adds to one
    accumulator, a lane per block, so whole steps need no `addp`. Control: plain 8-bit codes fold their blocks'
    4-lane sums with addp."""
    def words(order):
        shape = GemvShape(N, 512, 8, 32, True, "float16", 8, dot_family, code_order=order)
        asm = assembly(tvm.tirx.build(tvm.IRModule({"gemv": gemv(shape, (1, 1, N)).with_attr(
            "global_symbol", "gemv")}), target=ARM_FAMILY_TARGETS[dot_family]))
        return re.findall(r"^\s+([a-z][a-z0-9.]*)\s+v\d+\.", asm, flags=re.MULTILINE)

    neon = words("neon")
    assert "sdot" in neon and "addp" not in neon
    assert "addp" in words("plain")


def _vector_words(shape: GemvShape, dot_family: str = "i8mm") -> list[str]:
    """The vector instructions of the GEMV compiled for `dot_family` (never run here)."""
    module = tvm.IRModule({"gemv": gemv.__wrapped__(shape, (1, 1, shape.n)).with_attr("global_symbol", "gemv")})
    asm = assembly(tvm.tirx.build(module, target=ARM_FAMILY_TARGETS[dot_family]))
    return re.findall(r"^\s+([a-z][a-z0-9.]*)\s+v\d+\.", asm, flags=re.MULTILINE)


@pytest.mark.parametrize("dot_family", ARM_FAMILIES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [576, 608])
def test_aarch64_rows_in_pairs_split_each_byte_once(dot_family, symmetric, k):
    """4-bit codes in the neon_pairs order: 16 bytes hold 16 codes of each of two rows, so one AND (the first row's
    nibbles) and two `sdot`s (those and the raw bytes) take 32 codes, where unpaired rows take an AND, a shift and
    two `sdot`s: per dot product, half the nibble operations, no `ushr`; the second row's 16 (c - 8) is
    converted by a fixed-point scvtf (or, in a 2-block last step shared with the first row's, shifted exactly).
    Control: the neon order's unpaired rows. Numerics: the emulated device's test below (K = 576 and 608)."""
    def words(order):
        return _vector_words(GemvShape(N, k, 4, 32, symmetric, "float16", 8, dot_family, code_order=order), dot_family)

    paired, unpaired = words("neon_pairs"), words("neon")  # (unrolled differently: compared per sdot)
    assert "ushr" not in paired and "ushr" in unpaired
    assert 2 * paired.count("and") == paired.count("sdot") > 0
    assert unpaired.count("and") + unpaired.count("ushr") == unpaired.count("sdot") > 0


@pytest.mark.parametrize("bits,symmetric,order", [(4, True, "neon"), (4, False, "neon"), (8, True, "neon"),
                                                  (4, True, "neon_pairs"), (4, False, "neon_pairs")])
def test_aarch64_rows_pair_their_shorter_last_steps(monkeypatch, bits, symmetric, order):
    """K = 576 (4 steps and 2 blocks): two rows' last 2 blocks share one vector, so the rows stepping together
    convert their shorter last steps once per pair. Control: the same kernel with a last step per row. Their
    numerics: the emulated device's test below (layouts at K = 576 and 192)."""
    shape = GemvShape(N, 576, bits, 32, symmetric, "float16", 8, "dotprod", code_order=order)
    assert shape.paired_tails

    def converts():
        module = tvm.IRModule({"gemv": gemv.__wrapped__(shape, (1, 1, N)).with_attr("global_symbol", "gemv")})
        asm = assembly(tvm.tirx.build(module, target=ARM_FAMILY_TARGETS["dotprod"]))
        return re.findall(r"^\s+([a-z][a-z0-9.]*)\s+v\d+\.", asm, flags=re.MULTILINE).count("scvtf")

    paired = converts()
    monkeypatch.setattr(GemvShape, "paired_tails", property(lambda self: False))
    assert paired == converts() - shape.rows_together // 2


# ARM_LAYOUTS whose batched kernels (a row per sequence) run on the emulated device too: 4-bit codes in row pairs and
# 8-bit ones, symmetric and not
ARM_BATCHED_LAYOUTS = (0, 7, 8)


@pytest.fixture(scope="module")
def arm_libraries(emulated_arm_device, tmp_path_factory):
    """Every aarch64 kernel of ARM_LAYOUTS x activation widths, one library per family, on the emulated device."""
    remote = emulated_arm_device.request(session_timeout=600)
    folder = tmp_path_factory.mktemp("aarch64-gemv")
    libs = {}
    for dot_family, target in ARM_FAMILY_TARGETS.items():
        funcs = {}
        for index, (bits, grp, symmetric, scale_dtype, k, order) in enumerate(ARM_LAYOUTS):
            for act_bits in (16, 8):
                shape = GemvShape(ARM_ROWS[index], k, bits, grp, symmetric, scale_dtype, act_bits, dot_family,
                                  code_order=_layout(bits, grp, symmetric, scale_dtype, order,
                                                     ARM_ROWS[index]).code_order)
                assert shape.supported(), shape
                name = f"{index}_a{act_bits}"
                funcs[f"quantize_{name}"] = quantize_activation(shape, (1, 1, k)).with_attr("global_symbol",
                                                                                          f"quantize_{name}")
                funcs[f"gemv_{name}"] = gemv(shape, (1, 1, shape.n)).with_attr("global_symbol", f"gemv_{name}")
                if index in ARM_BATCHED_LAYOUTS:
                    funcs.update(_batched_module(shape, f"{name}_"))
        path = folder / f"gemv_{dot_family}.so"
        tvm.tirx.build(tvm.IRModule(funcs), target=target).export_library(
            str(path), fcompile=cc.cross_compiler("aarch64-linux-gnu-g++"))
        remote.upload(str(path))
        libs[dot_family] = remote.load_module(path.name)
    return remote, libs


@pytest.mark.slow
@pytest.mark.parametrize("dot_family", ARM_FAMILIES)
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("layout", range(len(ARM_LAYOUTS)))
def test_aarch64_kernels_match_numpy_on_the_emulated_device(arm_libraries, dot_family, act_bits, layout):
    """int16: the float result to ~1/32639 of a block's largest activation; int8: exactly what int8-rounded
    activations give. Then negative controls on the device: activations out of order, one changed code byte."""
    remote, libs = arm_libraries
    bits, grp, symmetric, scale_dtype, k, order = ARM_LAYOUTS[layout]
    shape, arrays, x, ref = _case(bits, grp, symmetric, scale_dtype, k, act_bits=act_bits, dot_family=dot_family,
                                  n=ARM_ROWS[layout], code_order=order)
    # 48 rows: 4 together, asymmetric 4-bit rows 2 (in pairs with int8 activations: 4; arm.rows_together)
    asymmetric_4_bit = bits == 4 and not symmetric and not (shape.row_pairs and act_bits == 8)
    assert shape.rows_together == {48: 2 if asymmetric_4_bit else 4, 6: 2, 5: 1}[shape.n]
    names = (f"quantize_{layout}_a{act_bits}", f"gemv_{layout}_a{act_bits}")
    got = _run(libs[dot_family], shape, x, arrays, dev=remote.cpu(), names=names)
    tol = 2e-4 * np.abs(ref).max()
    if act_bits == 16:
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=tol)
    else:
        _assert_int8_rounding(got, ref, x, arrays, _layout(bits, grp, symmetric, scale_dtype, order, shape.n), k)
    rolled = _run(libs[dot_family], shape, x, arrays, permute_activations=lambda q: np.roll(q, 16),
                  dev=remote.cpu(), names=names)
    assert np.abs(rolled - ref).max() > 100 * tol
    # code 5 (x = 40) of a row near the end, by 8 (4-bit) or 128, wherever the layout's order stores it
    layout_used = _layout(bits, grp, symmetric, scale_dtype, order, shape.n)
    plain = group.plain_codes(arrays["q_weight"], layout_used)
    row = shape.n - 2
    plain[row, 5] ^= 0x08 if bits == 4 else 0x80
    changed = dict(arrays, q_weight=group.order_codes(plain, layout_used))
    diff = np.abs(_run(libs[dot_family], shape, x, changed, dev=remote.cpu(), names=names) - ref)
    assert diff[row] > 10 * tol and np.delete(diff, row).max() < (tol if act_bits == 16 else 2e-2 * np.abs(ref).max())


@pytest.mark.slow
@pytest.mark.parametrize("dot_family", ARM_FAMILIES)
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("layout", ARM_BATCHED_LAYOUTS)
def test_aarch64_batched_rows_equal_one_row_each_on_the_emulated_device(arm_libraries, dot_family, act_bits, layout):
    remote, libs = arm_libraries
    bits, grp, symmetric, scale_dtype, k, order = ARM_LAYOUTS[layout]
    shape, arrays, _, _ = _case(bits, grp, symmetric, scale_dtype, k, act_bits=act_bits, dot_family=dot_family,
                                n=ARM_ROWS[layout], code_order=order)
    _assert_batched_rows_are_the_one_row_results(libs[dot_family], shape, arrays, k, remote.cpu(),
                                                 f"{layout}_a{act_bits}_")
