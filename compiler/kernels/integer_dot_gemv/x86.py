"""x86 variants of the integer decode GEMV's dot step: 32 codes times 32 activations into int32 lanes, per
integer dot-product family of compiler/isa.py. The algorithm around it (compiler/kernels/integer_dot_gemv) is
the same for every family; only these instructions differ.

- int16 activations: `vpmaddwd` (pairs of int16 products summed into int32): one zmm instruction per 32 products
  with AVX-512BW, two ymm ones with AVX2.
- int8 activations: `vpdpbusd` (4 uint8 x int8 products summed into each int32 lane) with AVX-512 VNNI (EVEX) or
  AVX-VNNI (VEX); else `vpmaddubsw` + `vpmaddwd` by ones (AVX2).
"""

from __future__ import annotations

from tvm.script import tirx as T

# int_dot family -> whether its int8 steps have vpdpbusd
FAMILIES = {"avx512vnni": True, "avx512bw": False, "avxvnni": True, "avx2": False}
_ZMM_MADD = ("avx512vnni", "avx512bw")


def _pmaddwd(family: str, codes, act):
    """int16x32 codes . int16x32 activations -> int32x16 pair sums (lane i: products 2i and 2i + 1)."""
    if family in _ZMM_MADD:
        return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.pmaddw.d.512", codes, act)
    halves = [T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd",
                                      T.Shuffle([codes], list(range(h, h + 16))), T.Shuffle([act], list(range(h, h + 16))))
              for h in (0, 16)]
    return T.Shuffle(halves, list(range(16)))


def dot(family: str, act_bits: int, centered: bool, acc, codes, act):
    """acc (int32 lanes) + the sums of products of 32 codes (uint8; zero-extended to int16 for int16 activations)
    and 32 activations: 16 lanes of 2 products (int16) or 8 lanes of 4 (int8)."""
    if act_bits == 16:
        return acc + _pmaddwd(family, codes, act)
    if FAMILIES[family]:
        return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", acc, codes, act)
    if centered:
        # vpmaddubsw sums pairs into int16: 255 * 127 * 2 overflows, so 8-bit codes go in as c - 128, with |c - 128|
        # as the unsigned operand (-128 reads as 128) and q carrying its sign (|q| <= 127, no overflow); the
        # algorithm then leaves out the -128 * sum q term (GemvShape.centered).
        flipped = T.bitwise_xor(codes, T.broadcast(T.uint8(128), 32))
        codes = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", flipped, flipped)
        act = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", act, flipped)
    pairs = T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", codes, act)
    return acc + T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, T.broadcast(T.int16(1), 16))
