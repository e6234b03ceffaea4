"""expand_float_math: a kernel's float math intrinsics and float divisions by constants, as arithmetic that LLVM's
Hexagon backend lowers inline.

This TVM's Hexagon codegen has no lowering for `exp`, `sqrt`, `rsqrt` or `sigmoid` ("Cannot find intrinsic
declaration"), and a float division is a call of compiler-rt's `__hexagon_divsf3`, which the emulated DSP's kernel
server does not have (a real DSP's SDK does). So, on float32 values (float16 ones through float32):

- rsqrt(x): an estimate from the float's bits (0x5f375a86 - bits/2, within 3.4e-2) and Newton steps, the last in
  residual form so that its rounding stays near one ulp; denormal x are scaled by 2^24 first; +-0, inf, x < 0 and NaN
  give +-inf, 0, NaN, NaN.
- sqrt(x): x * rsqrt(x), corrected once by the residual x - s^2 (Heron); 0 and inf stay, x < 0 gives NaN.
- exp(x): x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, Cody-Waite, so n ln2 is exact), e^r by Cephes' expf
  polynomial, and 2^n applied as two factors built in the exponent bits, so results overflow to inf and
  underflow through denormals to 0 as IEEE exp does; x is clamped to [-104, 89] first (exp is 0 or inf beyond),
  NaN passes through.
- sigmoid(x): with t = exp(-|x|) in (0, 1] and q = 1 / (1 + t) (a reciprocal on [1, 2]: a linear estimate and
  Newton steps, no division), q for x >= 0 and t q below, so neither side overflows or loses its relative
  precision.
- a / c for a float constant c: a * (1 / c) (exact for powers of two, else within an ulp of the division).

Other intrinsics (tanh, erf, log, pow, sin, cos, ...), other dtypes and divisions by non-constants are left as they
are; codegen/hexagon.partition keeps such kernels on the CPU.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

F32 = "float32"
I32 = "int32"
RSQRT_NEWTON_STEPS = 3  # 3.4e-2 -> 1.8e-3 -> 4.7e-6 -> 3e-11, then rounding
RECIPROCAL_NEWTON_STEPS = 3  # 1/17 -> 3.5e-3 -> 1.2e-5 -> 1.5e-10
# Cephes' expf: e^r = 1 + r + r^2 p(r) on |r| <= ln2/2, coefficients of p from r^0 up
EXP_POLYNOMIAL = (5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3, 1.3981999507e-3,
                  1.9875691500e-4)
LN2_HIGH, LN2_LOW = 0.693359375, -2.12194440e-4  # ln2 = high + low; high has 9 bits, so n * high is exact
LOG2E = 1.44269504088896341
EXP_RANGE = (-104.0, 89.0)  # e^-104 is below half the smallest denormal, e^89 above the largest float
SMALLEST_NORMAL = 2.0 ** -126
_EXPANDED = {"tirx.rsqrt", "tirx.sqrt", "tirx.exp", "tirx.sigmoid"}


def expand_float_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its rsqrt, sqrt, exp and sigmoid calls and float divisions by constants as plain arithmetic."""
    return tvm_ffi.structural_map(func, [(tvm.ir.expr.Call, _expanded_call), (tirx.Div, _expanded_division)])


def _expanded_call(call: tvm.ir.expr.Call):
    if not isinstance(call.op, tvm.ir.Op) or call.op.name not in _EXPANDED or str(call.ty) not in (F32, "float16"):
        return call
    expand = {"tirx.rsqrt": rsqrt, "tirx.sqrt": sqrt, "tirx.exp": exp, "tirx.sigmoid": sigmoid}[call.op.name]
    return _in_float32(call.args[0], expand)


def _expanded_division(div: tirx.Div):
    if str(div.ty) not in (F32, "float16") or not isinstance(div.b, tirx.FloatImm) or div.b.value == 0:
        return div
    return div.a * tirx.const(1.0 / div.b.value, str(div.ty))


def _in_float32(x: tirx.PrimExpr, expand) -> tirx.PrimExpr:
    if str(x.ty) == F32:
        return expand(x)
    return tirx.Cast(str(x.ty), expand(tirx.Cast(F32, x)))


def _let(name: str, value: tirx.PrimExpr, body) -> tirx.PrimExpr:
    """body(v) with v bound to `value` once (the expansions read their operands several times)."""
    var = tirx.Var(name, value.ty)
    return tirx.Let(var, value, body(var))


def _f32(value: float) -> tirx.PrimExpr:
    return tirx.const(value, F32)


def _bits_as_float(bits: int | tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.reinterpret(F32, tirx.const(bits, I32) if isinstance(bits, int) else bits)


def _is_nan(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """From the bits: TVM's simplifier folds x != x to false."""
    return tirx.bitwise_and(tirx.reinterpret(I32, x), tirx.const(0x7FFFFFFF, I32)) > tirx.const(0x7F800000, I32)


def _power_of_two(n: tirx.PrimExpr) -> tirx.PrimExpr:
    """2^n for int32 n in [-126, 127], built in the exponent bits."""
    return _bits_as_float(tirx.shift_left(n + tirx.const(127, I32), tirx.const(23, I32)))


def rsqrt(x: tirx.PrimExpr, newton_steps: int = RSQRT_NEWTON_STEPS) -> tirx.PrimExpr:
    """1 / sqrt(x) for float32 x."""
    return _let("rsqrt_x", x, lambda v: tirx.Select(
        v > _f32(0.0),
        tirx.Select(v < _bits_as_float(0x7F800000), _rsqrt_positive(v, newton_steps), _f32(0.0)),
        tirx.Select(v == _f32(0.0), _signed_infinity(v), _bits_as_float(0x7FC00000))))


def _signed_infinity(zero: tirx.PrimExpr) -> tirx.PrimExpr:
    """inf with the sign of `zero` (rsqrt(-0) is -inf), from its sign bit."""
    return tirx.Select(tirx.reinterpret(I32, zero) < tirx.const(0, I32), _bits_as_float(-0x800000),
                       _bits_as_float(0x7F800000))


def _rsqrt_positive(x: tirx.PrimExpr, newton_steps: int) -> tirx.PrimExpr:
    """1 / sqrt(x) for finite x > 0: denormals scaled by 2^24 (the bit estimate needs a normal float)."""
    denormal = x < _f32(SMALLEST_NORMAL)
    scaled = tirx.Select(denormal, x * _f32(2.0 ** 24), x)
    unscale = tirx.Select(denormal, _f32(2.0 ** 12), _f32(1.0))
    return _let("rsqrt_scaled", scaled, lambda xs: unscale * _newton_rsqrt(
        xs, _bits_as_float(tirx.const(0x5F375A86, I32) - tirx.shift_right(tirx.reinterpret(I32, xs),
                                                                             tirx.const(1, I32))), newton_steps))


def _newton_rsqrt(x: tirx.PrimExpr, y: tirx.PrimExpr, steps: int) -> tirx.PrimExpr:
    """y refined `steps` times: y + y/2 (1 - x y^2), whose small correction adds little rounding."""
    if steps == 0:
        return y
    return _let("rsqrt_y", y, lambda v: _newton_rsqrt(
        x, v + _f32(0.5) * v * (_f32(1.0) - x * v * v), steps - 1))


def sqrt(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """sqrt(x) for float32 x."""
    def finite_positive(v):
        return _let("sqrt_y", _rsqrt_positive(v, RSQRT_NEWTON_STEPS), lambda y: _let(
            "sqrt_s", v * y, lambda s: s + _f32(0.5) * y * (v - s * s)))

    return _let("sqrt_x", x, lambda v: tirx.Select(
        tirx.all(v > _f32(0.0), v < _bits_as_float(0x7F800000)), finite_positive(v),
        tirx.Select(v >= _f32(0.0), v, _bits_as_float(0x7FC00000))))


def exp(x: tirx.PrimExpr, polynomial_terms: int = len(EXP_POLYNOMIAL)) -> tirx.PrimExpr:
    """e^x for float32 x, with the first `polynomial_terms` coefficients of EXP_POLYNOMIAL."""
    low, high = EXP_RANGE

    def reduced(v, clamped):
        rounding = tirx.Select(clamped >= _f32(0.0), _f32(0.5), _f32(-0.5))
        return _let("exp_n", tirx.Cast(I32, clamped * _f32(LOG2E) + rounding), lambda n: _let(
            "exp_r", clamped - tirx.Cast(F32, n) * _f32(LN2_HIGH) - tirx.Cast(F32, n) * _f32(LN2_LOW),
            lambda r: tirx.Select(_is_nan(v), v, _scaled(_exp_reduced(r, polynomial_terms), n))))

    return _let("exp_x", x, lambda v: _let(
        "exp_clamped", tirx.Min(tirx.Max(v, _f32(low)), _f32(high)), lambda c: reduced(v, c)))


def _exp_reduced(r: tirx.PrimExpr, terms: int) -> tirx.PrimExpr:
    """e^r for |r| <= ln2/2: 1 + r + r^2 p(r), p by Horner."""
    p = _f32(EXP_POLYNOMIAL[terms - 1])
    for coefficient in reversed(EXP_POLYNOMIAL[:terms - 1]):
        p = p * r + _f32(coefficient)
    return p * r * r + r + _f32(1.0)


def _scaled(value: tirx.PrimExpr, n: tirx.PrimExpr) -> tirx.PrimExpr:
    """value * 2^n for n in [-150, 129], as two factors in [-126, 127]: the product rounds into denormals, 0 or inf
    as one multiplication by 2^n would."""
    half = tirx.shift_right(n, tirx.const(1, I32))
    return value * _power_of_two(half) * _power_of_two(n - half)


def float_sigmoid(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """sigmoid(x) for float32 or float16 x (the latter through float32)."""
    return _in_float32(x, sigmoid)


def sigmoid(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """1 / (1 + e^-x) for float32 x."""
    return _let("sigmoid_x", x, lambda v: _let(
        "sigmoid_t", exp(tirx.Select(v >= _f32(0.0), -v, v)), lambda t: _let(
            "sigmoid_q", reciprocal_1_to_2(_f32(1.0) + t), lambda q: tirx.Select(v >= _f32(0.0), q, t * q))))


def reciprocal_1_to_2(b: tirx.PrimExpr, newton_steps: int = RECIPROCAL_NEWTON_STEPS) -> tirx.PrimExpr:
    """1 / b for b in [1, 2] (NaN stays NaN): the best linear estimate 24/17 - 8/17 b (within 1/17), then Newton
    steps r + r (1 - b r)."""
    def refine(v, r, steps):
        if steps == 0:
            return r
        return _let("reciprocal_r", r, lambda w: refine(v, w + w * (_f32(1.0) - v * w), steps - 1))

    return _let("reciprocal_b", b, lambda v: refine(v, _f32(24 / 17) - _f32(8 / 17) * v, newton_steps))
