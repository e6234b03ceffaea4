"""Integer prefill GEMM on aarch64 (smmla with i8mm, sdot with dotprod): its instructions (compiled here, never run),
the shapes it refuses, and on the emulated arm64 device (qemu runs dotprod and i8mm) its numerics against numpy for
the GGUF blocks and our schemes at row counts that are not multiples of the tile, with negative controls."""

import re

import numpy as np
import pytest
import tvm
from tvm.support import cc

from compiler.kernels.integer_dot_gemm import TILE_M, GemmShape, family, gemm, quantize_rows
from compiler.quantization import group
from compiler.target.isa import cpu_isa
from tests.helpers.cpu import assembly

ARM = {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}
FAMILY_TARGETS = {
    "dotprod": tvm.target.Target({**ARM, "mcpu": "cortex-a76", "mattr": ["+neon", "+dotprod"]}),
    "i8mm": tvm.target.Target({**ARM, "mcpu": "cortex-x3", "mattr": ["+neon", "+dotprod", "+i8mm", "+fullfp16"]}),
}
FAMILIES = list(FAMILY_TARGETS)
# (bits, group, symmetric, scale dtype, K, N, code order): as ARM targets store them (the "neon" order: sets of 4
# blocks interleaved by 4 bytes, 4-bit rows in pairs: neon_pairs; re-laid per task), 4-bit rows unpaired, and plain
# 8-bit codes (read as they are)
LAYOUTS = [
    (4, 32, True, "float16", 576, 40, "neon_pairs"),  # GGUF Q4_0 / q4f16_g32 at SmolLM2's hidden size; a task of 40
    (4, 32, False, "float16", 576, 96, "neon_pairs"),  # GGUF Q4_1 / q4f16_g32_asym: 4 sets and 2 blocks in place
    (8, 32, True, "float16", 192, 64, "neon"),  # GGUF Q8_0: signed codes, a set and 2 blocks in place
    (4, 128, True, "float16", 576, 24, "neon_pairs"),  # q4f16_g128: a short last group
    (8, 128, True, "float16", 256, 36, "neon"),  # q8f16_g128
    (4, 32, True, "float32", 128, 8, "neon_pairs"),  # q4f32_g32: one set of 4 blocks, none in place
    (8, 32, True, "float16", 192, 64, "plain"),  # unsigned 8-bit codes in K order, centred in registers
    (4, 32, True, "float16", 608, 40, "neon_pairs"),  # 4 sets and 3 blocks in place: a shorter last set re-laid
    (4, 32, True, "float16", 608, 40, "neon"),  # the same, rows unpaired (an odd number of rows is stored so)
    (4, 32, False, "float16", 576, 96, "neon"),
]
ROWS = [1, 3, 17, 128]


def _module(shapes: dict[str, GemmShape]) -> tvm.IRModule:
    funcs = {}
    for name, shape in shapes.items():
        funcs[f"quantize_{name}"] = quantize_rows(shape).with_attr("global_symbol", f"quantize_{name}")
        funcs[f"gemm_{name}"] = gemm(shape).with_attr("global_symbol", f"gemm_{name}")
    return tvm.IRModule(funcs)


def _shape(layout: int, dot_family: str) -> GemmShape:
    bits, grp, symmetric, scale_dtype, k, n, order = LAYOUTS[layout]
    return GemmShape(n, k, bits, grp, symmetric, scale_dtype, dot_family, code_order=order)


def _case(layout: int, rows: int, seed: int = 0):
    bits, grp, symmetric, scale_dtype, k, n, order = LAYOUTS[layout]
    glayout = group.GroupLayout(bits, grp, symmetric, scale_dtype, code_order=order)
    rng = np.random.default_rng(seed)
    arrays = group.quantize(rng.standard_normal((n, k)).astype("float32"), glayout)
    # activations with an outlier per row, as LLM hidden states have: per-32 scales must absorb it
    x = rng.standard_normal((rows, k)).astype("float32")
    x[:, 5] = 40.0
    x[rows // 2, 64:96] = 0  # an all-zero block: scale 0
    w = group.dequantize(arrays, glayout, k)
    blocks = x.reshape(rows, -1, 32)
    scale = np.abs(blocks).max(axis=2, keepdims=True) / 127
    x8 = (np.round(np.divide(blocks, scale, out=np.zeros_like(blocks), where=scale > 0)) * scale).reshape(rows, k)
    return arrays, x, x8 @ w.T, x @ w.T


def _run(lib, shape: GemmShape, name: str, x: np.ndarray, arrays: dict, dev, permute_codes=None) -> np.ndarray:
    rows = x.shape[0]
    panels = -(-rows // TILE_M)
    xq = tvm.runtime.empty((panels, TILE_M * shape.k), "int8", dev)
    xs = tvm.runtime.empty((panels, shape.terms_per_panel), "float32", dev)
    sums = [tvm.runtime.empty((panels, shape.terms_per_panel), "float32", dev)] if shape.activation_sums else []
    lib[f"quantize_{name}"](tvm.runtime.tensor(x.reshape(1, rows, -1), dev), xq, xs, *sums)
    if permute_codes is not None:
        xq = tvm.runtime.tensor(permute_codes(xq.numpy()), dev)
    stored = [tvm.runtime.tensor(arrays[s], dev) for s in ("q_weight", "q_scale", "q_min") if s in arrays]
    y = tvm.runtime.empty((1, rows, shape.n), "float32", dev)
    lib[f"gemm_{name}"](xq, xs, *sums, *stored, y)
    return y.numpy().reshape(rows, shape.n)


def test_family_follows_the_target():
    assert {name: family(cpu_isa(target)) for name, target in FAMILY_TARGETS.items()} == {f: f for f in FAMILIES}
    # NEON without the dot product, x86, GPUs: no variant (the float prefill GEMM stays)
    assert family(cpu_isa(tvm.target.Target({**ARM, "mcpu": "cortex-a72"}))) is None
    assert family(cpu_isa(tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu",
                                             "mcpu": "x86-64-v4"}))) is None
    assert family(cpu_isa(tvm.target.Target({"kind": "opencl"}))) is None


@pytest.mark.parametrize("bits,grp,k,n,symmetric,dot_family", [
    (4, 32, 100, 8, True, "i8mm"), (4, 16, 128, 8, True, "i8mm"), (3, 32, 128, 8, True, "i8mm"),
    (4, 32, 128, 6, True, "i8mm"), (8, 32, 128, 8, False, "dotprod"), (4, 32, 128, 8, True, "avx2")])
def test_refuses_shapes_it_cannot_tile(bits, grp, k, n, symmetric, dot_family):
    """Whole 32-value blocks and groups, 4 or 8 bits, N in tiles of 4, no asymmetric 8-bit codes, ARM families."""
    assert not GemmShape(n, k, bits, grp, symmetric, "float16", dot_family).supported()


def test_neon_order_is_re_laid_whatever_the_block_count():
    """Codes in the neon order are re-laid per task, whatever their block count (a shorter last set in place); plain
    8-bit codes are read as they are, plain 4-bit ones (which ARM targets do not store) left to the dequantize
    path."""
    for bits in (4, 8):
        for k in (96, 128, 576):
            for order in ("neon", "neon_pairs") if bits == 4 else ("neon",):
                shape = GemmShape(8, k, bits, 32, True, "float16", "i8mm", code_order=order)
                assert shape.supported() and shape.relays
    plain = GemmShape(8, 96, 8, 32, True, "float16", "i8mm")
    assert plain.supported() and not plain.relays
    assert not GemmShape(8, 128, 4, 32, True, "float16", "i8mm").supported()


# family, bits -> instructions its GEMM must contain, and must not (codes in the neon order: re-laid per task with
# st4, symmetric 4-bit ones flipped with eor; 8-bit ones are stored signed)
INSTRUCTIONS = {
    ("i8mm", 4): (["smmla", "eor", "st4"], ["usmmla", "sdot"]),
    ("i8mm", 8): (["smmla", "st4"], ["eor", "usmmla", "sdot"]),
    ("dotprod", 4): (["sdot", "eor", "st4"], ["smmla", "usmmla"]),
    ("dotprod", 8): (["sdot", "st4"], ["eor", "smmla", "usmmla"]),
}


@pytest.mark.parametrize("dot_family", FAMILIES)
@pytest.mark.parametrize("bits", [4, 8])
def test_each_family_emits_its_instructions(dot_family, bits):
    """Compiled for aarch64 (never run here): a block of an 8 x 4 tile is 32 smmla or 64 sdot by element, the float
    work one convert per 4 int32 lanes per block; with i8mm no vector register is spilled (dotprod's tile spills
    one or two per block)."""
    order = group.GroupLayout(bits, 32, True, "float16").with_code_order("neon_pairs", 64).code_order
    shape = GemmShape(64, 576, bits, 32, True, "float16", dot_family, code_order=order)  # as ARM targets store W
    lib = tvm.tirx.build(tvm.IRModule({"gemm": gemm(shape).with_attr("global_symbol", "gemm")}),
                         target=FAMILY_TARGETS[dot_family])
    asm = assembly(lib)
    words = re.findall(r"^\s+([a-z][a-z0-9.]*)\s+\{?\s*v\d+\.", asm, flags=re.MULTILINE)
    must, must_not = INSTRUCTIONS[dot_family, bits]
    for instruction in must + must_not:
        assert (instruction in words) == (instruction in must), f"{dot_family} int{bits}: {instruction}"
    if dot_family == "i8mm":
        assert words.count("smmla") == 32
        assert not re.search(r"\b(ldr|ldp)\s+q\d+, (q\d+, )?\[sp", asm), "vector registers reloaded from the stack"
    else:  # by element: the W row's 4 values repeated from a lane, no horizontal sums
        assert len(re.findall(r"sdot\s+v\d+\.4s, v\d+\.16b, v\d+\.4b\[\d\]", asm)) == 64
        assert "addp" not in words
    # 4-bit codes centred as 16 (c - 8): the convert divides by 16 (fixed point, 4 fraction bits)
    converts = re.findall(r"scvtf\s+v\d+\.4s, v\d+\.4s(, #4)?", asm)
    assert converts == ["" if bits == 8 else ", #4"] * 8


def test_asymmetric_codes_are_centred_only_when_symmetric():
    """Asymmetric 4-bit codes (Q4_1) go in as they are, 0..15, with the mins' term; asymmetric 8-bit codes are
    refused (0..255 are not int8)."""
    shape = GemmShape(64, 576, 4, 32, False, "float16", "i8mm", code_order="neon")  # paired rows: the re-lay's eor
    words = re.findall(r"^\s+([a-z][a-z0-9.]*)\s+v\d+\.", assembly(tvm.tirx.build(
        tvm.IRModule({"gemm": gemm(shape).with_attr("global_symbol", "gemm")}), target=FAMILY_TARGETS["i8mm"])),
        flags=re.MULTILINE)
    assert "eor" not in words and words.count("smmla") == 32 and shape.activation_sums
    assert not GemmShape(64, 576, 8, 32, False, "float16", "i8mm").supported()


@pytest.fixture(scope="module")
def arm_libraries(emulated_arm_device, tmp_path_factory):
    """Every layout's kernels, one library per family, loaded on the emulated device."""
    remote = emulated_arm_device.request(session_timeout=600)
    folder = tmp_path_factory.mktemp("aarch64-gemm")
    libs = {}
    for dot_family, target in FAMILY_TARGETS.items():
        shapes = {str(index): _shape(index, dot_family) for index in range(len(LAYOUTS))}
        assert all(shape.supported() for shape in shapes.values())
        path = folder / f"gemm_{dot_family}.so"
        tvm.tirx.build(_module(shapes), target=target).export_library(
            str(path), fcompile=cc.cross_compiler("aarch64-linux-gnu-g++"))
        remote.upload(str(path))
        libs[dot_family] = remote.load_module(path.name)
    return remote, libs


@pytest.mark.slow
@pytest.mark.parametrize("dot_family", FAMILIES)
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_matches_numpy_on_the_emulated_device(arm_libraries, dot_family, layout):
    """For every row count: exactly what the int8-rounded X gives (integer sums; float tolerance on the scaling),
    within int8 rounding of the float product. Negative controls on the device: a changed weight scale moves its
    column only; X codes of two rows swapped in the panel move those rows."""
    remote, libs = arm_libraries
    shape = _shape(layout, dot_family)
    for rows in ROWS:
        arrays, x, exact, ref = _case(layout, rows, seed=rows)
        got = _run(libs[dot_family], shape, str(layout), x, arrays, remote.cpu())
        tol = 1e-4 * np.abs(exact).max()
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=tol, err_msg=f"{rows} rows")
        assert np.abs(got - ref).max() < 5e-2 * np.abs(ref).max()  # int8 rounding (K = 128: 2%)
    # the last run: 128 rows
    column = shape.n - 3
    wrong = dict(arrays, q_scale=arrays["q_scale"].copy())
    wrong["q_scale"][column, 0] *= 2
    diff = np.abs(_run(libs[dot_family], shape, str(layout), x, wrong, remote.cpu()) - exact)
    assert diff[:, column].max() > 100 * tol and np.delete(diff, column, axis=1).max() < tol

    def swap_rows(codes):  # rows 0 and 1 of the first panel: the first two rows of its first vector at each step
        width = 16 // shape.rows_per_vector
        pieces = codes.reshape(codes.shape[0], -1, shape.vectors_per_panel, shape.rows_per_vector, width).copy()
        pieces[0, :, 0, [0, 1]] = pieces[0, :, 0, [1, 0]]
        return pieces.reshape(codes.shape)

    diff = np.abs(_run(libs[dot_family], shape, str(layout), x, arrays, remote.cpu(), permute_codes=swap_rows) - exact)
    assert diff[:2].max() > 100 * tol and diff[2:].max() < tol
