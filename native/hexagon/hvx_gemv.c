/* Decode GEMV on HVX: one vector lane per weight row, 32 rows per tile, two 32-value blocks per step.
 *
 * For block b of row r (codes c, zero z, scale d = D 2^E_r, min m = M 2^F_r) and int8 activations q with scale
 * xs = X 2^G and sum S (T = xs S = Tq 2^H):
 *   dot   = sum_j c_j q_j - z S           Vx.w += vrmpy(Vu.ub, Rt.b): 4 codes of each row by 4 activations
 *   P     = round(D X / 2^15)             one Vdd.w = vmpy(Vu.h, Rt.h) and one vasr:rnd:sat for two blocks
 *   acc  += round(dot 2^s P / 2^15)       vmpyo(Vu.w, Vv.h):<<1:rnd:sat
 *   accm += (M Tq) >> 8                   asymmetric codes only: the mins' term, once per row and block
 * and at the end y_r = acc 2^(E_r + G + 30 - s) + accm 2^(F_r + H + 8) in scalar float (row_factors, dot_factor,
 * min_factor). The shift s (dot_shift) gives the rounding of each block's term 2^-s of a unit of the dot
 * product while |dot 2^s| stays under 2^21, so that 1024 blocks (K = 32768) cannot overflow acc. The weights' scales become 16-bit fixed point per row at compile time (exact when a block's scale
 * is within 2^4 of the row's largest), the activations' per vector when they are quantized. */
#include "hvx_gemv.h"

#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>

typedef struct {
    HVX_Vector dot, mins;
} row_sums;

/* One record (two blocks of 32 rows) of codes `w` times the activations `a` into `sums`. */
static inline __attribute__((always_inline)) void step(int bits, int mins, int32_t zero, const HVX_Vector *w,
                                                       const int32_t *a, row_sums *sums) {
    const HVX_Vector low_nibbles = Q6_Vb_vsplat_R(0x0F), high_nibbles = Q6_Vb_vsplat_R(0xF0);
    /* a: 16 words of activations (block 0, block 1), X pair, Tq pair, S0, S1 */
    HVX_Vector sum0 = Q6_V_vsplat_R(-zero * a[18]), sum1 = Q6_V_vsplat_R(-zero * a[19]);
    const HVX_Vector *codes = w + 1 + mins;
    const int64_t *words = (const int64_t *)a; /* 64-bit loads: two activation words each */
    if (bits == 4) {
        /* the high nibbles stay in place (16 c: vand, not a shift; the shift resource is the scarce one) and are
         * summed apart: sum = 16 sum_low + sum_high is the dot product times 2^4 */
        HVX_Vector high0 = Q6_V_vzero(), high1 = Q6_V_vzero();
#pragma unroll
        for (int v = 0; v < 4; v++) {
            int64_t first = words[v], second = words[4 + v];
            sum0 = Q6_Vw_vrmpyacc_VwVubRb(sum0, Q6_V_vand_VV(codes[v], low_nibbles), (int32_t)first);
            high0 = Q6_Vw_vrmpyacc_VwVubRb(high0, Q6_V_vand_VV(codes[v], high_nibbles), (int32_t)(first >> 32));
            sum1 = Q6_Vw_vrmpyacc_VwVubRb(sum1, Q6_V_vand_VV(codes[4 + v], low_nibbles), (int32_t)second);
            high1 = Q6_Vw_vrmpyacc_VwVubRb(high1, Q6_V_vand_VV(codes[4 + v], high_nibbles), (int32_t)(second >> 32));
        }
        sum0 = Q6_Vw_vaslacc_VwVwR(high0, sum0, 4);
        sum1 = Q6_Vw_vaslacc_VwVwR(high1, sum1, 4);
    } else {
#pragma unroll
        for (int g = 0; g < 8; g += 2) {
            int64_t first = words[g / 2], second = words[4 + g / 2];
            sum0 = Q6_Vw_vrmpyacc_VwVubRb(sum0, codes[g], (int32_t)first);
            sum0 = Q6_Vw_vrmpyacc_VwVubRb(sum0, codes[g + 1], (int32_t)(first >> 32));
            sum1 = Q6_Vw_vrmpyacc_VwVubRb(sum1, codes[8 + g], (int32_t)second);
            sum1 = Q6_Vw_vrmpyacc_VwVubRb(sum1, codes[9 + g], (int32_t)(second >> 32));
        }
        sum0 = Q6_Vw_vasl_VwR(sum0, hvx_gemv_dot_shift(bits, mins));
        sum1 = Q6_Vw_vasl_VwR(sum1, hvx_gemv_dot_shift(bits, mins));
    }
    HVX_VectorPair scaled = Q6_Ww_vmpy_VhRh(w[0], a[16]);
    /* block 0's factor in the odd halfwords (vmpyo reads those), block 1's in the even ones */
    HVX_Vector factors = Q6_Vh_vasr_VwVwR_rnd_sat(Q6_V_lo_W(scaled), Q6_V_hi_W(scaled), 15);
    sums->dot = Q6_Vw_vadd_VwVw(sums->dot, Q6_Vw_vmpyo_VwVh_s1_rnd_sat(sum0, factors));
    sums->dot = Q6_Vw_vadd_VwVw(sums->dot, Q6_Vw_vmpyo_VwVh_s1_rnd_sat(sum1, Q6_Vw_vasl_VwR(factors, 16)));
    if (mins) {
        HVX_VectorPair min_terms = Q6_Ww_vmpy_VhRh(w[1], a[17]);
        sums->mins = Q6_Vw_vasracc_VwVwR(sums->mins, Q6_V_lo_W(min_terms), 8);
        sums->mins = Q6_Vw_vasracc_VwVwR(sums->mins, Q6_V_hi_W(min_terms), 8);
    }
}

/* Scales tile `tile`'s row sums into y (scalar float, once per row). */
static inline __attribute__((always_inline)) void finish(int bits, int mins, int32_t tile, row_sums sums,
                                                         const float *row_factors, float dot_factor,
                                                         float min_factor, float *y, int32_t *acc_dot,
                                                         int32_t *acc_min) {
    union { HVX_Vector v; int32_t w[HVX_GEMV_ROWS]; } dots = {sums.dot}, min_sums = {sums.mins};
    const float *factors = row_factors + tile * 2 * HVX_GEMV_ROWS;
    const float unshift = 1.0f / (float)(1 << hvx_gemv_dot_shift(bits, mins));
    for (int row = 0; row < HVX_GEMV_ROWS; row++) {
        float value = (float)dots.w[row] * (factors[row] * dot_factor * unshift);
        if (mins) value += (float)min_sums.w[row] * (factors[HVX_GEMV_ROWS + row] * min_factor);
        y[tile * HVX_GEMV_ROWS + row] = value;
        if (acc_dot) acc_dot[tile * HVX_GEMV_ROWS + row] = dots.w[row];
        if (acc_min) acc_min[tile * HVX_GEMV_ROWS + row] = min_sums.w[row];
    }
}

/* One tile at a time: two (sharing each activation word between two vrmpy) measured no fewer packets per weight
 * (bench/hexagon_gemv_packets.py: 4-bit 0.297 -> 0.289, 8-bit 0.297 -> 0.344), the loop being bound by its
 * instruction count, four per packet, more than by its loads. */
static inline __attribute__((always_inline)) void gemv(int bits, int mins, const uint8_t *weights,
                                                       const float *row_factors, const uint8_t *activations,
                                                       int32_t n_tiles, int32_t n_pairs, int32_t zero,
                                                       float dot_factor, float min_factor, float *y,
                                                       int32_t *acc_dot, int32_t *acc_min) {
    const int record = 1 + mins + 2 * (bits == 4 ? 4 : 8);
    const HVX_Vector *w = (const HVX_Vector *)weights;
    for (int32_t tile = 0; tile < n_tiles; tile++) {
        row_sums sums = {Q6_V_vzero(), Q6_V_vzero()};
        const int32_t *a = (const int32_t *)activations;
        for (int32_t pair = 0; pair < n_pairs; pair++, w += record, a += HVX_GEMV_ACT_RECORD / 4)
            step(bits, mins, zero, w, a, &sums);
        finish(bits, mins, tile, sums, row_factors, dot_factor, min_factor, y, acc_dot, acc_min);
    }
}

#define VARIANT(name, bits, mins)                                                                                \
    void name(const uint8_t *weights, const float *row_factors, const uint8_t *activations, int32_t n_tiles,      \
              int32_t n_pairs, int32_t zero, float dot_factor, float min_factor, float *y, int32_t *acc_dot,      \
              int32_t *acc_min) {                                                                                 \
        gemv(bits, mins, weights, row_factors, activations, n_tiles, n_pairs, zero, dot_factor, min_factor, y,   \
             acc_dot, acc_min);                                                                                   \
    }
VARIANT(hvx_gemv_4bit, 4, 0)
VARIANT(hvx_gemv_4bit_mins, 4, 1)
VARIANT(hvx_gemv_8bit, 8, 0)
VARIANT(hvx_gemv_8bit_mins, 8, 1)
