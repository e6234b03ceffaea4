/* RMSNorm and SwiGLU on 32-lane float vectors (hvx_norms.h says how they become HVX). The algorithms are those of
 * compiler/passes/expand_npu_math.py, so the DSP's numbers do not depend on which of the two computes them:
 *   rsqrt(x):   0x5f375a86 - bits(x)/2, then 3 Newton steps y (1.5 - x/2 y^2)
 *   exp(t), t <= 0: n = round(t log2 e) (by adding 1.5 2^23), r = t - n ln2 (ln2 in two parts), Cephes' expf
 *               polynomial on r, times 2^n built in the exponent bits; t below -87.3 gives 0
 *   sigmoid(x): t = exp(-|x|), q = 1 / (1 + t) on [1, 2] by a linear estimate and 3 Newton steps; q for x >= 0,
 *               t q below. */
#include "hvx_norms.h"

/* HVX_FLOAT_LANES: 32, an HVX vector of floats; the emulated DSP's build defines 1 (compiler/testing/emulated_hexagon.py),
 * as LLVM takes ~25 s to scalarize the 32-lane code, which then runs the same operations lane by lane. */
#ifndef HVX_FLOAT_LANES
#define HVX_FLOAT_LANES 32
#endif
enum { LANES = HVX_FLOAT_LANES };
/* aligned(4): the rows need not start on a 128-byte vector (unaligned HVX loads and stores, vmemu) */
typedef float vfloat __attribute__((vector_size(4 * LANES), aligned(4)));
typedef int32_t vint __attribute__((vector_size(4 * LANES), aligned(4)));

static inline vfloat splat(float value) { return (vfloat){0} + value; }

static inline vfloat select(vint mask, vfloat a, vfloat b) { return (vfloat)((mask & (vint)a) | (~mask & (vint)b)); }

static float rsqrt(float x) {
    union { float f; int32_t i; } seed = {x};
    seed.i = 0x5f375a86 - (seed.i >> 1);
    float y = seed.f, half = 0.5f * x;
    for (int step = 0; step < 3; step++) y = y * (1.5f - half * y * y);
    return y;
}

/* exp(t) for t <= 0 */
static inline vfloat exp_negative(vfloat t) {
    const float magic = 12582912.0f; /* 1.5 2^23: adding it rounds to an integer, kept in the low mantissa bits */
    const vint underflows = t < -87.3f;
    t = select(underflows, splat(0.0f), t);
    vfloat shifted = t * 1.44269504f + magic;
    vfloat n = shifted - magic;
    vint n_bits = (vint)shifted - (vint)splat(magic);
    vfloat r = t - n * 0.693359375f - n * -2.12194440e-4f;
    vfloat p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vfloat scale = (vfloat)((n_bits + 127) << 23); /* n >= -126: a normal float */
    return select(underflows, splat(0.0f), p * scale);
}

static inline vfloat sigmoid(vfloat x) {
    /* -|x| as a select: LLVM scalarizes the sign-bit forms (fabs, fneg) lane by lane on HVX */
    vfloat t = exp_negative(select(x < 0.0f, x, 0.0f - x));
    vfloat d = 1.0f + t;                          /* in [1, 2] */
    vfloat q = 24.0f / 17.0f - 8.0f / 17.0f * d;  /* within 1/17 of 1/d */
    for (int step = 0; step < 3; step++) q = q * (2.0f - d * q);
    return select(x < 0.0f, t * q, q);
}

/* A row's last n - start (< LANES) values, padded with zeros; and their store. */
static inline vfloat load_tail(const float *row, int32_t start, int32_t n) {
    vfloat v = {0};
    for (int32_t i = start; i < n; i++) v[i - start] = row[i];
    return v;
}

static inline void store_tail(float *row, int32_t start, int32_t n, vfloat v) {
    for (int32_t i = start; i < n; i++) row[i] = v[i - start];
}

static inline float lane_sum(vfloat v) {
    float total = 0.0f;
    for (int lane = 0; lane < LANES; lane++) total += v[lane];
    return total;
}

/* out = row * rsqrt(mean(row^2) + eps) * weight with row = x + residual (residual given) or x. `sum`, if given,
 * gets x + residual; else the second pass adds them again. Whole vectors, then the row's tail. */
static inline void norm_row(const float *x, const float *residual, const float *weight, float *sum, float *out,
                            int32_t n, float eps) {
    vfloat squares = {0};
    int32_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vfloat v = *(const vfloat *)(x + i);
        if (residual) {
            v += *(const vfloat *)(residual + i);
            if (sum) *(vfloat *)(sum + i) = v;
        }
        squares += v * v;
    }
    if (i < n) {
        vfloat v = load_tail(x, i, n);
        if (residual) {
            v += load_tail(residual, i, n);
            if (sum) store_tail(sum, i, n, v);
        }
        squares += v * v;
    }
    const float scale = rsqrt(lane_sum(squares) * (1.0f / (float)n) + eps);
    const float *row = sum ? sum : x, *added = sum ? 0 : residual;
    for (i = 0; i + LANES <= n; i += LANES) {
        vfloat v = *(const vfloat *)(row + i);
        if (added) v += *(const vfloat *)(added + i);
        *(vfloat *)(out + i) = v * scale * *(const vfloat *)(weight + i);
    }
    if (i < n) {
        vfloat v = load_tail(row, i, n);
        if (added) v += load_tail(added, i, n);
        store_tail(out, i, n, v * scale * load_tail(weight, i, n));
    }
}

void hvx_add_rms_norm(const float *x, const float *residual, const float *weight, float *sum, float *out,
                      int32_t rows, int32_t n, float eps) {
    for (int32_t r = 0; r < rows; r++)
        norm_row(x + r * n, residual + r * n, weight, sum + r * n, out + r * n, n, eps);
}

void hvx_rms_norm(const float *x, const float *weight, float *out, int32_t rows, int32_t n, float eps) {
    for (int32_t r = 0; r < rows; r++) norm_row(x + r * n, 0, weight, 0, out + r * n, n, eps);
}

static inline vfloat swiglu(vfloat gate, vfloat up) { return gate * sigmoid(gate) * up; }

void hvx_swiglu(const float *gate_up, float *out, int32_t rows, int32_t n) {
    for (int32_t r = 0; r < rows; r++) {
        const float *gate = gate_up + 2 * r * n, *up = gate + n;
        float *row_out = out + r * n;
        int32_t i = 0;
        for (; i + LANES <= n; i += LANES)
            *(vfloat *)(row_out + i) = swiglu(*(const vfloat *)(gate + i), *(const vfloat *)(up + i));
        if (i < n) store_tail(row_out, i, n, swiglu(load_tail(gate, i, n), load_tail(up, i, n)));
    }
}
