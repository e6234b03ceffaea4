"""Decode GEMV on the CPU's integer multiply-add instructions: y = W x with W in 4/8-bit group codes.

The activation x is quantized per 32 values (one float scale each) to int16 (errors ~1/65534 of a block's largest
value, results equal to the float GEMV's to ~2e-5; the default of targets whose file names none) or, with
`--decode-activations int8` (the ARM targets' default, targets/*.toml device.decode_activations), to int8 as
llama.cpp does for its Q4/Q8 dot products (~100x the error, ~1.4x faster). The inner loop then multiplies
codes by activations in integer arithmetic instead of widening every code to float: the instructions are the
CPU's integer dot-product family (compiler/target/isa.py), one variant file per architecture (x86.py: `vpmaddwd` for
int16 on AVX-512BW or AVX2, `vpdpbusd` for int8 with VNNI, else `vpmaddubsw` + `vpmaddwd`; arm.py: NEON `sdot`, `usdot`
with i8mm, int16 as two int8 planes). Per 32-code block the int32 sum is scaled once:

    sum_k w_k x_k = sum_blocks d * xs * sum_j c_j q_j  +  m * xs * sum_j q_j,     w = d c + m,  x = xs q

(symmetric codes: m = -offset * d). A step reads 32 bytes of codes: two 4-bit blocks or one 8-bit block. The
variant turns them into int32 lanes, each a sum of products of one block, and says in which order the activation
kernel stores the activations so that every instruction reads them contiguously; the activation kernel also writes
its per-block terms already repeated per lane, so the only shuffle left widens the two weight scales of a 4-bit
step to [d0 ..., d1 ...]. A variant may also step through 4 blocks with a lane each and a shorter last step,
several rows at a time, the mins' term per step, a shorter last step of 2 blocks taken by pairs of rows in one
vector, and rows in pairs whose codes share each byte (the neon_pairs order: both rows' sums from the same loads,
arm.py). 8-bit codes may also have a scale (and min) per 16 values (GGUF Q6_K) where the variant sums each half of
a block in its own half of the lanes (x86.py, arm.py). Every variant file defines the same names: FAMILIES,
CODE_ORDER, tail_steps, MINS_PER_STEP, HALF_BLOCK_GROUPS, FMA_CHAINS, reduce_rows, paired_tail_dot, pair_step_dot,
second_of_pair_float, rows_together, chains, blocks_per_step, qmax, centered, split_int16, int32_lanes,
activation_index and step_dot.

SmolLM2 decode GEMVs, one Zen 3 core (AVX2), weights in cache, int16 activations: 4-bit gate_up 0.128 ms with
vpmovzxbw widening, 0.093 ms widened in-lane (x86.py); int8 activations 0.062 ms. AVX2 code on one Zen 4 core,
widened by words and with two accumulators per row (x86.py): gate_up 63.5 -> 60.1 us in cache, the 8-bit
lm_head 1.81 -> 1.40-1.57 ms (llvm-mca-15, 4-bit loop per 64 codes: 5.50 -> 5.10 cycles on znver3, 6.85 -> 6.42
on skylake).
"""

from __future__ import annotations

import dataclasses
import math

from tvm import tirx
from tvm.script import tirx as T

from ...choices import DECODE_ACTIVATIONS
from ...quantization.group import FALLBACK, ORDER_MARKS, signed_codes, takes_code_order
from ...target.isa import CpuIsa
from ..lane_sums import lane_sum, pairwise_sum
from .. import parse_cache
from . import arm, x86

BLOCK = 32  # activation values per scale, and codes per int32 block sum
ROWS_PER_TASK = 16
# Software prefetch this far ahead in the codes, 4-bit rows only. Streamed from DRAM, interleaved runs: SmolLM2's
# down_proj 0.044 -> 0.036 ms, qkv 0.034 -> 0.030, gate_up 0.071 -> 0.068; the 8-bit lm_head, already at ~23 GB/s
# with the hardware prefetcher alone, went 1.29 -> 1.44 ms with it.
PREFETCH_BYTES = 2048
# A batched GEMV's activation rows go through each weight row in chunks of about this many bytes (an L2's share).
CHUNK_BYTES = 128 * 1024
ACTIVATION_BITS = tuple(int(name.removeprefix("int")) for name in DECODE_ACTIVATIONS)  # (16, 8)
# architecture -> the variant file with its families (compiler/target/isa.py INT_DOT_FAMILIES) and dot step
VARIANTS = {"x86_64": x86, "aarch64": arm}


# In a kernel's x / y shape: the activation rows of a batched decode step (the `batch_decode` function's symbolic
# batch size), one per sequence.
BATCH = "batch_size"


# The kernels' names start with this (passes/integer_dot_gemv.py names them; the serving engine reads them in an
# artifact's call sites).
KERNEL_PREFIX = "integer_dot_gemv_"


def family(isa: CpuIsa | None) -> str | None:
    """The integer dot-product family the kernel uses on a CPU of instruction set `isa` (None: not a CPU target), or
    None where it has no variant for it."""
    if isa is None or isa.arch not in VARIANTS or isa.int_dot not in VARIANTS[isa.arch].FAMILIES:
        return None
    return isa.int_dot


def stored_code_order(family_name: str | None) -> str:
    """The code order (quantization/group.CODE_ORDERS) the weights are stored in for the kernel of `family_name`
    (family(); None: the float GEMV's): its variant's."""
    return "plain" if family_name is None else _variant(family_name).CODE_ORDER


def _orders(order: str) -> tuple[str, ...]:
    """`order` and the orders codes that cannot take it are stored in (quantization/group.FALLBACK), to plain."""
    return (order, *_orders(FALLBACK[order])) if order in FALLBACK else (order,)


def _variant(name: str):
    return next(module for module in VARIANTS.values() if name in module.FAMILIES)


@dataclasses.dataclass(frozen=True)
class GemvShape:
    """y[n] = sum_k W[n, k] x[k], W stored as `bits`-bit codes with one scale (and min) per `group` values;
    activations quantized to `act_bits` (16 or 8), multiplied with the instructions of `family`
    (compiler/target/isa.py)."""

    n: int
    k: int
    bits: int
    group: int
    symmetric: bool
    scale_dtype: str
    act_bits: int = 16
    family: str = "avx512bw"
    zero_code: int | None = None  # symmetric codes' zero (GroupLayout.zero_code); None: 2^(bits-1)
    code_order: str = "plain"  # GroupLayout.code_order

    @property
    def offset(self) -> int:
        return 1 << (self.bits - 1) if self.zero_code is None else self.zero_code

    @property
    def signed_codes(self) -> bool:
        """8-bit codes about 128 stored as c - 128 (GroupLayout.signed_codes)."""
        return signed_codes(self.code_order, self.bits, self.symmetric, self.offset)

    @property
    def act_dtype(self) -> str:
        return f"int{self.act_bits}"

    @property
    def qmax(self) -> int:
        return _variant(self.family).qmax(self)

    @property
    def lanes(self) -> int:
        """int32 lanes of a step's dot products (the family's choice: see its variant file)."""
        return _variant(self.family).int32_lanes(self)

    @property
    def rows_together(self) -> int:
        """Rows of a task that step together, sharing each step's activation loads (arm.py; x86: one)."""
        return math.gcd(math.gcd(self.n, ROWS_PER_TASK), _variant(self.family).rows_together(self))

    @property
    def chains(self) -> int:
        """Float accumulators per row that consecutive steps add into in turn (x86.py; arm.py: one, its
        rows_together rows already make independent ones)."""
        return _variant(self.family).chains(self)

    @property
    def blocks_per_step(self) -> int:
        return _variant(self.family).blocks_per_step(self)

    @property
    def step_bytes(self) -> int:
        return self.blocks_per_step * BLOCK * self.bits // 8

    @property
    def lanes_per_block(self) -> int:
        return self.lanes // self.blocks_per_step

    @property
    def steps(self) -> int:
        """Whole steps; where the variant's tail_steps takes it, a K they leave over ends in one shorter step."""
        return self.k // (BLOCK * self.blocks_per_step)

    @property
    def tail_blocks(self) -> int:
        return self.k // BLOCK % self.blocks_per_step

    @property
    def lane_terms(self) -> int:
        """Length of the per-lane activation terms (scale, sum): lanes_per_block per 32 values, zero-padded to
        whole steps (a shorter last step reads a whole step's terms)."""
        return (self.steps + (self.tail_blocks > 0)) * self.lanes

    @property
    def row_pairs(self) -> bool:
        """Codes in the neon_pairs order (quantization/group.py): rows step by pairs, both rows' sums from the same
        16-byte loads (the variant's pair_step_dot)."""
        return self.code_order == "neon_pairs"

    @property
    def paired_tails(self) -> bool:
        """The shorter last step's 2 blocks of two rows stepping together fill one vector (the variant's
        paired_tail_dot): one float step per pair of rows instead of one per row with half its lanes zero, added to
        the pair's partial sums in reduce_rows."""
        variant = _variant(self.family)
        return (variant.paired_tail_dot is not None and self.tail_blocks == 2 and self.lanes == 4
                and self.blocks_per_step == 4 and self.group == BLOCK and self.rows_together % 2 == 0
                and (self.symmetric or self.mins_per_step))

    @property
    def centered(self) -> bool:
        """8-bit codes go in as c - 128 where the family has no unsigned x signed int8 product for them."""
        return _variant(self.family).centered(self)

    @property
    def split_int16(self) -> bool:
        """int16 activations stored as two int8 planes (low and high bytes: arm.py), not as int16 values."""
        return _variant(self.family).split_int16(self)

    @property
    def mins_per_step(self) -> bool:
        """Asymmetric codes: the mins' term joins each step's float work (arm.py: a lane per block, or per half of a
        block's lanes, so the step's mins are one 4-lane vector) instead of one dot with the row's mins after the
        steps (x86)."""
        return not self.symmetric and _variant(self.family).MINS_PER_STEP

    @property
    def sum_terms(self) -> int:
        """Length of the activation sum terms: per lane (symmetric: folded into each step's FMA; asymmetric with
        mins_per_step) or per group of 32 or 16 values (asymmetric: one dot with the row's mins after the steps)."""
        return self.lane_terms if self.symmetric or self.mins_per_step else self.k // self.group

    @property
    def half_block_groups(self) -> bool:
        """A scale (and min) per 16 values: 8-bit codes (one block per step), on a variant whose lanes sum each half
        of a block apart (HALF_BLOCK_GROUPS)."""
        return self.group == BLOCK // 2 and self.bits == 8 and _variant(self.family).HALF_BLOCK_GROUPS

    def supported(self) -> bool:
        # Both 32-code blocks of a 4-bit step must fall in one group, or each have their own (group 32); mins
        # are read per group of at most 32 values; centred symmetric codes keep 128 - offset of the offset term (none
        # about 128), and asymmetric ones take the centring into each step's mins (mins_per_step).
        return (self.bits in (4, 8) and self.act_bits in ACTIVATION_BITS and any(
                    self.family in module.FAMILIES for module in VARIANTS.values())
                and self.code_order in _orders(_variant(self.family).CODE_ORDER)
                and takes_code_order(self.code_order, self.bits, self.group, self.n)
                and (not self.row_pairs or (self.rows_together % 2 == 0 and not self.half_block_groups
                                            and (not self.symmetric or self.offset == 8)))
                and self.k % BLOCK == 0 and (self.group % BLOCK == 0 or self.half_block_groups)
                and (self.tail_blocks == 0 or _variant(self.family).tail_steps(self))
                and (self.group <= BLOCK or self.group % (BLOCK * self.blocks_per_step) == 0)
                and (self.symmetric or (self.group <= BLOCK and (not self.centered or self.mins_per_step))))

    def activation_name(self) -> str:
        """What the activation kernel depends on: K, the code order (bits, and the family's lanes), the sum terms
        (per 16 values for 16-value groups) and the int width."""
        kind = "asym" if not self.symmetric else "sym" if self.offset == 1 << (self.bits - 1) else f"sym{self.offset}"
        halves = "_g16" if self.half_block_groups else ""
        order = "" if self.code_order == "plain" else "_neon"  # rows in pairs read the same activations
        return f"int{self.bits}_{kind}{halves}_k{self.k}_a{self.act_bits}_l{self.lanes}{order}"

    def name(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        order = ORDER_MARKS[self.code_order]
        return (f"int{self.bits}_g{self.group}_{kind}_{self.scale_dtype}_a{self.act_bits}_{self.family}{order}"
                f"_n{self.n}_k{self.k}")


# Parsed once (parse_cache), as cpu_attention's kernels: TVMScript parsing is the cost.
@parse_cache.cached
def quantize_activation(shape: GemvShape, x_shape: tuple[int | str, ...], parallel: bool = False) -> tirx.PrimFunc:
    """x [..., K] float32 (one row; BATCH rows where x_shape holds BATCH, each quantized alone, every output with a
    leading dimension of them, in parallel tasks with `parallel`) -> xq [K] (int16 or int8) in the GEMV's code
    order, xs float32 [lane_terms] (per lane, its block's scale) and xo float32 [sum_terms] (symmetric codes: per
    lane, -offset * xs * the sum of q over the lane's group / its lanes, the offset less 128 for centred codes;
    asymmetric: per lane with mins per step, xs * the sum over its group / its lanes, else per group of 32 or 16
    values, xs * its sum of q)."""
    k, lanes, qmax, act = shape.k, shape.lanes_per_block, float(shape.qmax), shape.act_dtype
    halves = 2 if shape.half_block_groups else 1  # groups per block: each half of the lanes sums its own
    # centred codes (c - 128) leave 128 - offset of each code's offset to the sums
    sum_factor = -(shape.offset - (128 if shape.centered else 0)) / (lanes // halves)
    symmetric = shape.symmetric
    lane_sums = symmetric or shape.mins_per_step  # xo per lane, else per group
    order = _variant(shape.family).activation_index
    split = shape.split_int16
    blocks = k // BLOCK
    padding = shape.lane_terms - blocks * lanes  # the missing blocks of a shorter last step: zero terms
    batch, x_shape = _batch_dim(x_shape)
    rows = () if batch is None else (batch,)

    @T.macro
    def quantize_row(x, xq_rows, xs_rows, xo_rows, amax, qsum, row):
        xf = T.decl_buffer((k,), "float32", data=x.data, elem_offset=row * k)
        xq = T.decl_buffer((k,), act, data=xq_rows.data, elem_offset=row * k)
        xb = T.decl_buffer((k * shape.act_bits // 8,), "int8", data=xq_rows.data,  # the planes of split int16
                           elem_offset=row * (k * shape.act_bits // 8))
        xs = T.decl_buffer((shape.lane_terms,), "float32", data=xs_rows.data, elem_offset=row * shape.lane_terms)
        xo = T.decl_buffer((shape.sum_terms,), "float32", data=xo_rows.data, elem_offset=row * shape.sum_terms)
        for b in range(k // BLOCK):
            amax[0] = T.float32(0)
            for j in range(BLOCK):
                amax[0] = T.max(amax[0], T.fabs(xf[b * BLOCK + j]))
            inv = T.if_then_else(amax[0] > T.float32(0), T.float32(qmax) / amax[0], T.float32(0))
            for h in range(halves):
                qsum[h] = 0
            for j in range(BLOCK):
                q = T.Cast("int32", T.round(xf[b * BLOCK + j] * inv))
                qsum[j // (BLOCK // halves)] = qsum[j // (BLOCK // halves)] + q
                if split:
                    high = T.shift_right(q + 128, 8)  # q = 256 high + low, both in -128..127
                    xb[order(shape, b, j, 0)] = T.Cast("int8", q - high * 256)
                    xb[order(shape, b, j, 1)] = T.Cast("int8", high)
                else:
                    xq[order(shape, b, j)] = T.Cast(act, q)
            for lane in range(lanes):
                xs[b * lanes + lane] = amax[0] / T.float32(qmax)
                if symmetric:
                    xo[b * lanes + lane] = (amax[0] / T.float32(qmax) * T.Cast("float32", qsum[lane * halves // lanes])
                                            * T.float32(sum_factor))
                elif lane_sums:
                    xo[b * lanes + lane] = (amax[0] / T.float32(qmax) * T.Cast("float32", qsum[lane * halves // lanes])
                                            / T.float32(lanes // halves))
            if not lane_sums:
                for h in range(halves):
                    xo[b * halves + h] = amax[0] / T.float32(qmax) * T.Cast("float32", qsum[h])
        if padding > 0:
            for lane in range(padding):
                xs[blocks * lanes + lane] = T.float32(0)
                if lane_sums:
                    xo[blocks * lanes + lane] = T.float32(0)

    @T.prim_func(private=True, s_tir=True)
    def quantize(x: T.Buffer(x_shape, "float32"), xq: T.Buffer((*rows, k), act),
                 xs: T.Buffer((*rows, shape.lane_terms), "float32"), xo: T.Buffer((*rows, shape.sum_terms), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        with T.sblock("root"):  # Relax's analyses expect a root block
            amax = T.alloc_buffer((1,), "float32", scope="local")
            qsum = T.alloc_buffer((halves,), "int32", scope="local")
            if batch is None:
                quantize_row(x, xq, xs, xo, amax, qsum, 0)
            elif parallel:
                for row in T.parallel(batch):
                    quantize_row(x, xq, xs, xo, amax, qsum, row)
            else:
                for row in range(batch):
                    quantize_row(x, xq, xs, xo, amax, qsum, row)

    return quantize


def is_batch(dim) -> bool:
    """Whether a Relax tensor dimension is batch_decode's symbolic row count (the model exports it named BATCH)."""
    return isinstance(dim, tirx.Var) and dim.name == BATCH


def _batch_dim(shape: tuple[int | str, ...]) -> tuple[tirx.Var | None, tuple]:
    """(the symbolic activation-row count, `shape` with it in place of BATCH), or (None, `shape`) for one row."""
    if BATCH not in shape:
        return None, shape
    batch = tirx.Var(BATCH, "int64")
    return batch, tuple(batch if d == BATCH else d for d in shape)


def _lane_scale(shape: GemvShape, buf, n, step, blocks: int | None = None):
    """The weight scale (or min) of each int32 lane of `step` (of its first `blocks` blocks: a shorter last step,
    whose other lanes are zero), as float32 x lanes."""
    bps, per_block, lanes = shape.blocks_per_step, shape.lanes_per_block, shape.lanes
    count = bps if blocks is None else blocks
    if shape.half_block_groups:  # one block per step: the first half of the lanes sums its first 16 codes
        halves = T.Cast("float32x2", buf[n, T.ramp(step * 2, 1, 2)])
        return T.Shuffle([halves] * (lanes // 2), [i * 2 // lanes for i in range(lanes)])  # inputs >= outputs
    if bps > 1 and shape.group == BLOCK:
        scales = T.Cast(f"float32x{count}", buf[n, T.ramp(step * bps, 1, count)])
        if count == lanes:
            return scales  # a lane per block, in order
        if per_block == 1 and count > 1:  # the missing blocks' lanes repeat the others (their dot is zero)
            loaded = buf[n, T.ramp(step * bps, 1, count)]
            repeated = T.Shuffle([loaded] * -(-lanes // count), [i % count for i in range(lanes)])
            return T.Cast(f"float32x{lanes}", repeated)
        return T.Shuffle([scales] * -(-lanes // count), [min(i // per_block, count - 1) for i in range(lanes)])
    return T.broadcast(T.Cast("float32", buf[n, step * bps * BLOCK // shape.group]), lanes)


def _fma(shape: GemvShape, a, b, c):
    """a * b + c: one llvm.fma where the variant asks for it (FMA_CHAINS), so that LLVM keeps each row's sum one chain
    of FMAs instead of reassociating it."""
    if _variant(shape.family).FMA_CHAINS:
        return T.call_llvm_pure_intrin(f"float32x{shape.lanes}", "llvm.fma", a, b, c)
    return c + a * b


def _float_step(shape: GemvShape, acc, ints, xs_terms, xo_terms, scale, mins, second_of_pair: bool = False):
    """`acc` plus the float value of a step's int32 lanes `ints`, given each lane's activation terms (xs, xo) and
    weight scale (and min), each product added to the running sum so that it is one FMA. `second_of_pair`: the
    lanes are 16 times the sums of (c - 8) q (row_pairs), which the variant converts (second_of_pair_float)."""
    if second_of_pair:
        dot = _variant(shape.family).second_of_pair_float(ints)
        if shape.symmetric:  # offset 8 (supported): the sums are the codes' own
            return _fma(shape, dot * xs_terms, scale, acc)
        # c d + m = (c - 8) d + (m + 8 d): the 8 joins the min
        return _fma(shape, dot * xs_terms, scale, _fma(shape, xo_terms, _fma(shape, scale, _splat(shape, 8), mins),
                                                       acc))
    dot = T.Cast(f"float32x{shape.lanes}", ints)
    if shape.centered and shape.symmetric and shape.offset == 128:  # the dot already holds sum (c - 128) q
        return _fma(shape, dot * xs_terms, scale, acc)
    if shape.symmetric:
        # xo holds -offset * xs * sum q: one FMA gives the block's sum of (c - offset) x
        return _fma(shape, _fma(shape, dot, xs_terms, xo_terms), scale, acc)
    if shape.mins_per_step:  # xo holds xs * sum q per lane
        if shape.centered:  # the dot holds sum (c - 128) q: the 128 codes join the min, c * d + m = (c - 128) d + m'
            mins = mins + scale * T.broadcast(T.float32(128), shape.lanes)
        return _fma(shape, dot * xs_terms, scale, _fma(shape, xo_terms, mins, acc))
    return _fma(shape, dot * xs_terms, scale, acc)  # the mins' term comes once per row (gemv)


def _splat(shape: GemvShape, value: float):
    return T.broadcast(T.float32(value), shape.lanes)


def _step_sum(shape: GemvShape, acc, xq, xs, xo, w, d, m, n, step, blocks: int | None = None):
    """`acc` plus one step's contribution to the row's float32 partial sums (`blocks`: a shorter last step). Built as
    one expression: a vector bound to a name inside the kernel would become a Let that the Relax build spills to a
    stack buffer (8x slower)."""
    terms = T.ramp(step * shape.lanes, 1, shape.lanes)
    step_dot = _variant(shape.family).step_dot
    ints = step_dot(shape, w, xq, n, step) if blocks is None else step_dot(shape, w, xq, n, step, blocks)
    mins = _lane_scale(shape, m, n, step, blocks) if shape.mins_per_step else None
    return _float_step(shape, acc, ints, xs[terms], xo[terms], _lane_scale(shape, d, n, step, blocks), mins)


def _pair_step_sums(shape: GemvShape, accs, xq, xs, xo, w, d, m, n, step, blocks: int | None = None):
    """Rows n and n + 1 in the neon_pairs order (w: the pairs' view): float32x8, `accs` (each row's float32x4) plus
    one step's contribution to each."""
    terms = T.ramp(step * shape.lanes, 1, shape.lanes)
    pair_step_dot = _variant(shape.family).pair_step_dot
    dots = (pair_step_dot(shape, w, xq, n // 2, step) if blocks is None
            else pair_step_dot(shape, w, xq, n // 2, step, blocks))
    sums = [_float_step(shape, accs[r], dots[r], xs[terms], xo[terms], _lane_scale(shape, d, n + r, step, blocks),
                        _lane_scale(shape, m, n + r, step, blocks) if shape.mins_per_step else None, r == 1)
            for r in (0, 1)]
    return T.Shuffle(sums, list(range(2 * shape.lanes)))


def _paired_tail(shape: GemvShape, xq, xs, xo, w, d, m, n):
    """acc -> acc plus the shorter last step of rows n and n + 1 (paired_tails), lane 2 i + b being block b of row
    n + i, for `acc` holding the two rows' partial sums in the same lanes (reduce_rows' pairwise adds)."""
    first = shape.steps * shape.blocks_per_step

    def per_lane(buf):  # each row's 2 scales (or mins), row n's then row n + 1's
        return T.Cast("float32x4", T.Shuffle([buf[n, T.ramp(first, 1, 2)], buf[n + 1, T.ramp(first, 1, 2)]],
                                             [0, 1, 2, 3]))

    def twice(terms):  # the 2 blocks' activation terms, for each row
        pair = terms[T.ramp(shape.steps * shape.lanes, 1, 2)]
        return T.Shuffle([pair, pair], [0, 1, 0, 1])

    ints = _variant(shape.family).paired_tail_dot(shape, w, xq, n, shape.steps)
    mins = per_lane(m) if shape.mins_per_step else None
    xo_terms = twice(xo)
    if shape.row_pairs:  # lanes 2-3: row n + 1's sums of c - 8 (paired_tail_dot)
        if shape.symmetric:  # offset 8: no activation-sum term
            pair = xo[T.ramp(shape.steps * shape.lanes, 1, 2)]
            xo_terms = T.Shuffle([pair, T.broadcast(T.float32(0), 2)], [0, 1, 2, 3])
        else:  # the 8 joins the min, as in _float_step
            mins = _fma(shape, per_lane(d), T.Shuffle([_splat(shape, 0), _splat(shape, 8)], [0, 1, 4, 5]), mins)
    return lambda acc: _float_step(shape, acc, ints, twice(xs), xo_terms, per_lane(d), mins)


def _mins_tail(m, xo, n, start: int, stop: int, lanes: int):
    """float32 x lanes whose sum is sum_b m[n, b] * xo[b] over the groups start..stop (fewer than `lanes`) that the
    row's whole vectors of mins leave over. After a whole vector: the last `lanes` groups, the lanes already counted
    times zero (a full-width load and convert; shorter vectors of float16 became scalar code). Else one shorter
    vector, zero-padded."""
    count = stop - start
    zeros = T.broadcast(T.float32(0), lanes)
    if start >= lanes - count:
        last = T.Cast(f"float32x{lanes}", m[n, T.ramp(stop - lanes, 1, lanes)]) * xo[T.ramp(stop - lanes, 1, lanes)]
        return last * T.Shuffle([zeros, T.broadcast(T.float32(1), lanes)], [0] * (lanes - count) + [lanes] * count)
    if count == 1:
        return T.Shuffle([T.broadcast(T.Cast("float32", m[n, start]) * xo[start], lanes), zeros],
                         [0] + [lanes] * (lanes - 1))
    part = T.Cast(f"float32x{count}", m[n, T.ramp(start, 1, count)]) * xo[T.ramp(start, 1, count)]
    # a shuffle takes as many lanes in as it gives out
    return T.Shuffle([part, T.broadcast(T.float32(0), lanes - count)], [min(i, count) for i in range(lanes)])


def _rows_sums(shape: GemvShape, accs: list, row0, xq, xs, xo, w, d, m):
    """[sum of row i's lanes for each of the rows' accumulators `accs`]: the variant's reduce_rows, with each pair of
    rows' shorter last step where the rows take it by pairs (paired_tails)."""
    tails = ([_paired_tail(shape, xq, xs, xo, w, d, m, row0 + i) for i in range(0, len(accs), 2)]
             if shape.paired_tails else [])
    return _variant(shape.family).reduce_rows(shape, accs, tails)


def _with_mins(row_lanes, m, xo, n, groups: int, lanes: int):
    """A row's float32 x lanes plus its mins' term sum_b m[n, b] * xo[b] spread over the same lanes, so that one sum
    across them ends the row: `lanes` groups per vector, the leftover groups zero-padded, added as a balanced tree
    (one expression: a buffer added to in a loop made LLVM keep the row's accumulators in memory)."""
    terms = [T.Cast(f"float32x{lanes}", m[n, T.ramp(c * lanes, 1, lanes)]) * xo[T.ramp(c * lanes, 1, lanes)]
             for c in range(groups // lanes)]
    if groups % lanes > 0:
        terms.append(_mins_tail(m, xo, n, groups // lanes * lanes, groups, lanes))
    terms.append(row_lanes)
    return pairwise_sum(terms)


@parse_cache.cached
def gemv(shape: GemvShape, y_shape: tuple[int | str, ...]) -> tirx.PrimFunc:
    """(xq, xs, xo, codes, scales[, mins]) -> y [..., N] float32; rows in parallel tasks of 16. Where y_shape holds
    BATCH, the activations have a leading dimension of that many rows (quantize_activation's), each row's sums
    computed as one row's are (the same float order), in tiles of up to the variant's ACTIVATION_ROW_TILE rows that
    share each weight step's loads."""
    n_rows, k, groups = shape.n, shape.k, -(-shape.k // shape.group)
    rows = math.gcd(n_rows, ROWS_PER_TASK)
    code_bytes = k * shape.bits // 8
    act_bytes = k * shape.act_bits // 8
    sdt, act, lanes = shape.scale_dtype, shape.act_dtype, shape.lanes
    prefetch = PREFETCH_BYTES if shape.bits == 4 else 0
    split = shape.split_int16
    together = shape.rows_together
    chains = shape.chains
    row_pairs = shape.row_pairs
    reduce_rows = _variant(shape.family).reduce_rows is not None and together > 1 and (
        shape.symmetric or shape.mins_per_step)
    assert shape.supported(), shape
    batch, y_shape = _batch_dim(y_shape)
    act_rows = () if batch is None else (batch,)
    per_row = chains * together * lanes  # accumulator lanes of one activation row
    # A batched step's activation rows go through the weights in tiles of the variant's ACTIVATION_ROW_TILE (1, 2 or 4:
    # the rest in one tile of 1 to 3, so that 3 rows load and widen the codes once, not twice as 2 + 1), each row with
    # its own accumulators: every weight step loaded and widened once per tile.
    row_tile = _variant(shape.family).ACTIVATION_ROW_TILE
    assert row_tile in (1, 2, 4), row_tile
    row_values, row_dtype = (act_bytes, "int8") if split else (k, act)  # one row of xq as the steps read it
    chunk_tiles = max(1, CHUNK_BYTES // (row_tile * act_bytes))

    def slot(t, chain, i, width=lanes):
        """The accumulator lanes of activation row t (of its tile), chain `chain`, weight row i (of `together`)."""
        return T.ramp(t * per_row + (chain * together + i) * lanes, 1, width)

    @T.macro
    def add_step(acc, t, xq, xs, xo, w, d, m, row0, step, chain):
        # `together` rows in one step share its activation loads (xq: the planes of split int16 as int8)
        if row_pairs:  # w: the pairs' view, a pair's step of 128 bytes is two cache lines
            for i in T.unroll(together // 2):
                if t == 0:  # the tile's first row prefetches for all
                    for line in T.unroll(2):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                            w[row0 // 2 + i, step * 2 * shape.step_bytes + 2 * prefetch + line * 64]), T.int32(0),
                            T.int32(3), T.int32(1)))
                acc[slot(t, chain, 2 * i, 2 * lanes)] = _pair_step_sums(
                    shape, [acc[slot(t, chain, 2 * i + half)] for half in (0, 1)], xq, xs, xo, w, d, m, row0 + 2 * i,
                    step)
        else:
            for i in T.unroll(together):
                if prefetch > 0 and t == 0:  # the tile's first row prefetches for all
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                        w[row0 + i, step * shape.step_bytes + prefetch]), T.int32(0), T.int32(3), T.int32(1)))
                acc[slot(t, chain, i)] = _step_sum(shape, acc[slot(t, chain, i)], xq, xs, xo, w, d, m, row0 + i, step)

    @T.macro
    def finish_row(acc, t, xq_t, xs_t, xo_t, y_t, w, d, m, row0):
        # activation row t's chains merged, the shorter last step added, each weight row's sum written
        for c in T.unroll(1, chains):
            for i in T.unroll(together):
                acc[slot(t, 0, i)] = acc[slot(t, 0, i)] + acc[slot(t, c, i)]
        if shape.tail_blocks > 0 and not shape.paired_tails and row_pairs:
            for i in T.unroll(together // 2):
                acc[slot(t, 0, 2 * i, 2 * lanes)] = _pair_step_sums(
                    shape, [acc[slot(t, 0, 2 * i + half)] for half in (0, 1)], xq_t, xs_t, xo_t, w, d, m,
                    row0 + 2 * i, shape.steps, shape.tail_blocks)
        elif shape.tail_blocks > 0 and not shape.paired_tails:
            for i in T.unroll(together):
                acc[slot(t, 0, i)] = _step_sum(shape, acc[slot(t, 0, i)], xq_t, xs_t, xo_t, w, d, m, row0 + i,
                                               shape.steps, shape.tail_blocks)
        if reduce_rows:
            # the rows' sums in one vector (arm.py: pairwise adds across the rows' accumulators)
            y_t[T.ramp(row0, 1, together)] = _rows_sums(shape, [acc[slot(t, 0, i)] for i in range(together)],
                                                        row0, xq_t, xs_t, xo_t, w, d, m)
        else:
            for i in T.unroll(together):
                if shape.symmetric or shape.mins_per_step:
                    y_t[row0 + i] = lane_sum(acc[slot(t, 0, i)], lanes)
                else:
                    # sum_b m_b * xs_b * sum q_b once per row, added into the row's lanes before their one
                    # sum (lane-widening the mins at every step cost 4 instructions per 64 codes: GGUF Q4_1
                    # decode step 8.2 ms). With a sum of its own, 16 groups a vector and scalar leftovers,
                    # ns per block of 1536 rows in cache on a Zen 4 core, int16: K = 576 1.07 -> 0.98
                    # (zmm), K = 960 1.16 -> 0.96 (zmm), 1.24 -> 0.96 (ymm)
                    y_t[row0 + i] = lane_sum(_with_mins(acc[slot(t, 0, i)], m, xo_t, row0 + i, groups, lanes),
                                          lanes)

    @T.macro
    def each_row(acc, count, first, xq, xs, xo, w, d, m, yf, row0, step, chain, finish):
        # the tile's activation rows one after another (a weight step's loads shared by all), each through its views
        for t in T.unroll(count):
            xq_t = T.decl_buffer((row_values,), row_dtype, data=xq.data, elem_offset=(first + t) * row_values)
            xs_t = T.decl_buffer((shape.lane_terms,), "float32", data=xs.data,
                                 elem_offset=(first + t) * shape.lane_terms)
            xo_t = T.decl_buffer((shape.sum_terms,), "float32", data=xo.data,
                                 elem_offset=(first + t) * shape.sum_terms)
            if finish:
                y_t = T.decl_buffer((n_rows,), "float32", data=yf.data, elem_offset=(first + t) * n_rows)
                finish_row(acc, t, xq_t, xs_t, xo_t, y_t, w, d, m, row0)
            else:
                add_step(acc, t, xq_t, xs_t, xo_t, w, d, m, row0, step, chain)

    @T.macro
    def tile(xq, xs, xo, w, d, m, yf, row0, first, count):
        # `count` activation rows from `first` through the `together` weight rows from row0. Default scope: a stack
        # array LLVM keeps in registers ("local" became a workspace call per task). Chain c of row i at
        # (c * together + i) * lanes of its activation row's lanes: consecutive steps add into different chains, so
        # the float adds of a row do not wait on each other; merged into chain 0 after the whole steps
        acc = T.alloc_buffer((count * per_row,), "float32")
        for i in T.unroll(count * chains * together):
            acc[T.ramp(i * lanes, 1, lanes)] = T.broadcast(T.float32(0), lanes)
        if count == 4:
            # 4 activation rows already make independent FMA chains: a pass per chain (its steps in the same order,
            # so the same sums) keeps one accumulator per row live instead of `chains`. AVX2 int16, SmolLM2's Q4_1
            # rows: 3 ymm spilled per 2 steps before; llvm-mca znver3 16.6 -> 14.0-15.1 cycles a step of the 4 rows,
            # in cache 2-7% faster (4-bit and the 8-bit lm_head). Tiles of 2 and 3 do not spill (2 rows: 5% slower
            # by chains)
            for c in T.unroll(chains):
                for outer in range((shape.steps - c + chains - 1) // chains):
                    each_row(acc, count, first, xq, xs, xo, w, d, m, yf, row0, outer * chains + c, c, False)
        else:
            for outer in range(shape.steps // chains):
                for c in T.unroll(chains):
                    each_row(acc, count, first, xq, xs, xo, w, d, m, yf, row0, outer * chains + c, c, False)
            if shape.steps % chains > 0:
                for c in T.unroll(shape.steps % chains):
                    each_row(acc, count, first, xq, xs, xo, w, d, m, yf, row0, shape.steps // chains * chains + c,
                             c, False)
        each_row(acc, count, first, xq, xs, xo, w, d, m, yf, row0, 0, 0, True)

    @T.macro
    def rows_loop(xq, xs, xo, w, d, m, y):
        yf = T.decl_buffer((n_rows,), "float32", data=y.data)
        xb = T.decl_buffer((act_bytes,), "int8", data=xq.data)  # the planes of split int16
        wp = T.decl_buffer((n_rows // 2, 2 * code_bytes), "uint8", data=w.data)  # rows in pairs (row_pairs)
        for task in T.parallel(n_rows // rows):
            if batch is None:
                for r in range(rows // together):
                    tile(xb if split else xq, xs, xo, wp if row_pairs else w, d, m, yf, task * rows + r * together,
                         0, 1)
            else:
                # whole tiles in chunks of activation rows that stay in L2 while each weight row of the task goes
                # through them (prefill's rows are many; a weight row stays in L1 across a chunk), then the rest of
                # each weight row in one tile
                for chunk in range((batch // row_tile + chunk_tiles - 1) // chunk_tiles):
                    for r in range(rows // together):
                        for first in range(chunk * chunk_tiles,
                                           T.min(batch // row_tile, chunk * chunk_tiles + chunk_tiles)):
                            tile(xb if split else xq, xs, xo, wp if row_pairs else w, d, m, yf,
                                 task * rows + r * together, first * row_tile, row_tile)
                for r in range(rows // together):
                    if row_tile == 4 and batch % 4 == 3:
                        tile(xb if split else xq, xs, xo, wp if row_pairs else w, d, m, yf,
                             task * rows + r * together, batch - 3, 3)
                    if row_tile == 4 and batch % 4 == 2:
                        tile(xb if split else xq, xs, xo, wp if row_pairs else w, d, m, yf,
                             task * rows + r * together, batch - 2, 2)
                    if row_tile >= 2 and batch % row_tile == 1:
                        tile(xb if split else xq, xs, xo, wp if row_pairs else w, d, m, yf,
                             task * rows + r * together, batch - 1, 1)

    if shape.symmetric:
        @T.prim_func(private=True, s_tir=True)
        def func(xq: T.Buffer((*act_rows, k), act), xs: T.Buffer((*act_rows, shape.lane_terms), "float32"),
                 xo: T.Buffer((*act_rows, shape.sum_terms), "float32"), w: T.Buffer((n_rows, code_bytes), "uint8"),
                 d: T.Buffer((n_rows, groups), sdt), y: T.Buffer(y_shape, "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            with T.sblock("root"):
                rows_loop(xq, xs, xo, w, d, None, y)
    else:
        @T.prim_func(private=True, s_tir=True)
        def func(xq: T.Buffer((*act_rows, k), act), xs: T.Buffer((*act_rows, shape.lane_terms), "float32"),
                 xo: T.Buffer((*act_rows, shape.sum_terms), "float32"), w: T.Buffer((n_rows, code_bytes), "uint8"),
                 d: T.Buffer((n_rows, groups), sdt), m: T.Buffer((n_rows, groups), sdt),
                 y: T.Buffer(y_shape, "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            with T.sblock("root"):
                rows_loop(xq, xs, xo, w, d, m, y)

    return func
