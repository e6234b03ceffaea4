/* Decode GEMV and prefill GEMM on HVX: one vector lane per weight row, 32 rows per tile, two 32-value blocks per
 * step; the GEMM reads each step's codes once for HVX_GEMM_ROWS activation rows (one set of sums per row).
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
 * is within 2^4 of the row's largest), the activations' per vector when they are quantized. With a scale per 16
 * values ("halves": 8-bit codes, GGUF Q6_K) each half block has its own dot, z S, P (its D, the block's X) and mins'
 * term (its Tq): twice the factor and vmpyo work of a pair, the same vrmpy. */
#include "hvx_gemv.h"

#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>

typedef struct {
    HVX_Vector dot, mins;
} row_sums;

/* One record (two blocks of 32 weight rows) of codes `w` times `rows` activation rows (a[r]: row r's record) into
 * sums[r]. The codes are read, and 4-bit ones split into their nibble planes, once for all the rows. halves (8-bit
 * codes only): a scale per 16 values, the dot products of each half block scaled by their own. */
static inline __attribute__((always_inline)) void step(int bits, int mins, int halves, int rows, int32_t zero,
                                                       const HVX_Vector *w, const int32_t *const *a,
                                                       row_sums *sums) {
    const HVX_Vector low_nibbles = Q6_Vb_vsplat_R(0x0F), high_nibbles = Q6_Vb_vsplat_R(0xF0);
    const HVX_Vector *codes = w + (1 + mins) * (1 + halves);
    /* 4-bit: vector v's low plane at 2 v, its high plane at 2 v + 1 (the high nibbles stay in place: 16 c, a vand
     * rather than a shift, the shift resource being the scarce one); 8-bit: the 16 code vectors */
    HVX_Vector planes[16];
#pragma unroll
    for (int v = 0; v < 8; v++) {
        planes[2 * v] = bits == 4 ? Q6_V_vand_VV(codes[v], low_nibbles) : codes[2 * v];
        planes[2 * v + 1] = bits == 4 ? Q6_V_vand_VV(codes[v], high_nibbles) : codes[2 * v + 1];
    }
#pragma unroll
    for (int r = 0; r < rows; r++) {
        const int64_t *words = (const int64_t *)a[r]; /* 64-bit loads: two activation words each */
        if (halves) {
            /* a[r]: 16 words of activations, X pair, then per block b the Tq pair of its halves (word 17 + b) and
             * the sums S of its halves (words 19 + 2 b, 20 + 2 b) */
#pragma unroll
            for (int b = 0; b < 2; b++) {
                HVX_Vector half[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    half[h] = Q6_V_vsplat_R(-zero * a[r][19 + 2 * b + h]);
#pragma unroll
                    for (int v = 2 * h; v < 2 * h + 2; v++) {
                        int64_t pair = words[4 * b + v];
                        half[h] = Q6_Vw_vrmpyacc_VwVubRb(half[h], planes[8 * b + 2 * v], (int32_t)pair);
                        half[h] = Q6_Vw_vrmpyacc_VwVubRb(half[h], planes[8 * b + 2 * v + 1], (int32_t)(pair >> 32));
                    }
                    half[h] = Q6_Vw_vasl_VwR(half[h], hvx_gemv_dot_shift(bits, mins));
                }
                /* the block's X in both halfwords: half 0's factor in the odd halfwords, half 1's in the even */
                uint32_t x = (uint32_t)a[r][16] >> (16 * b) & 0xFFFF;
                HVX_VectorPair scaled = Q6_Ww_vmpy_VhRh(w[b], (int32_t)(x | x << 16));
                HVX_Vector factors = Q6_Vh_vasr_VwVwR_rnd_sat(Q6_V_lo_W(scaled), Q6_V_hi_W(scaled), 15);
                sums[r].dot = Q6_Vw_vadd_VwVw(sums[r].dot, Q6_Vw_vmpyo_VwVh_s1_rnd_sat(half[0], factors));
                sums[r].dot = Q6_Vw_vadd_VwVw(sums[r].dot,
                                              Q6_Vw_vmpyo_VwVh_s1_rnd_sat(half[1], Q6_Vw_vasl_VwR(factors, 16)));
                if (mins) {
                    HVX_VectorPair min_terms = Q6_Ww_vmpy_VhRh(w[2 + b], a[r][17 + b]);
                    sums[r].mins = Q6_Vw_vasracc_VwVwR(sums[r].mins, Q6_V_lo_W(min_terms), 8);
                    sums[r].mins = Q6_Vw_vasracc_VwVwR(sums[r].mins, Q6_V_hi_W(min_terms), 8);
                }
            }
            continue;
        }
        /* a[r]: 16 words of activations (block 0, block 1), X pair, Tq pair, S0, S1 */
        HVX_Vector sum0 = Q6_V_vsplat_R(-zero * a[r][18]), sum1 = Q6_V_vsplat_R(-zero * a[r][19]);
        if (bits == 4) {
            /* sum = 16 sum_low + sum_high is the dot product times 2^4 */
            HVX_Vector high0 = Q6_V_vzero(), high1 = Q6_V_vzero();
#pragma unroll
            for (int v = 0; v < 4; v++) {
                int64_t first = words[v], second = words[4 + v];
                sum0 = Q6_Vw_vrmpyacc_VwVubRb(sum0, planes[2 * v], (int32_t)first);
                high0 = Q6_Vw_vrmpyacc_VwVubRb(high0, planes[2 * v + 1], (int32_t)(first >> 32));
                sum1 = Q6_Vw_vrmpyacc_VwVubRb(sum1, planes[8 + 2 * v], (int32_t)second);
                high1 = Q6_Vw_vrmpyacc_VwVubRb(high1, planes[9 + 2 * v], (int32_t)(second >> 32));
            }
            sum0 = Q6_Vw_vaslacc_VwVwR(high0, sum0, 4);
            sum1 = Q6_Vw_vaslacc_VwVwR(high1, sum1, 4);
        } else {
#pragma unroll
            for (int g = 0; g < 8; g += 2) {
                int64_t first = words[g / 2], second = words[4 + g / 2];
                sum0 = Q6_Vw_vrmpyacc_VwVubRb(sum0, planes[g], (int32_t)first);
                sum0 = Q6_Vw_vrmpyacc_VwVubRb(sum0, planes[g + 1], (int32_t)(first >> 32));
                sum1 = Q6_Vw_vrmpyacc_VwVubRb(sum1, planes[8 + g], (int32_t)second);
                sum1 = Q6_Vw_vrmpyacc_VwVubRb(sum1, planes[9 + g], (int32_t)(second >> 32));
            }
            sum0 = Q6_Vw_vasl_VwR(sum0, hvx_gemv_dot_shift(bits, mins));
            sum1 = Q6_Vw_vasl_VwR(sum1, hvx_gemv_dot_shift(bits, mins));
        }
        HVX_VectorPair scaled = Q6_Ww_vmpy_VhRh(w[0], a[r][16]);
        /* block 0's factor in the odd halfwords (vmpyo reads those), block 1's in the even ones */
        HVX_Vector factors = Q6_Vh_vasr_VwVwR_rnd_sat(Q6_V_lo_W(scaled), Q6_V_hi_W(scaled), 15);
        sums[r].dot = Q6_Vw_vadd_VwVw(sums[r].dot, Q6_Vw_vmpyo_VwVh_s1_rnd_sat(sum0, factors));
        sums[r].dot = Q6_Vw_vadd_VwVw(sums[r].dot, Q6_Vw_vmpyo_VwVh_s1_rnd_sat(sum1, Q6_Vw_vasl_VwR(factors, 16)));
        if (mins) {
            HVX_VectorPair min_terms = Q6_Ww_vmpy_VhRh(w[1], a[r][17]);
            sums[r].mins = Q6_Vw_vasracc_VwVwR(sums[r].mins, Q6_V_lo_W(min_terms), 8);
            sums[r].mins = Q6_Vw_vasracc_VwVwR(sums[r].mins, Q6_V_hi_W(min_terms), 8);
        }
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
static inline __attribute__((always_inline)) void gemv(int bits, int mins, int halves, const uint8_t *weights,
                                                       const float *row_factors, const uint8_t *activations,
                                                       int32_t n_tiles, int32_t n_pairs, int32_t zero,
                                                       float dot_factor, float min_factor, float *y,
                                                       int32_t *acc_dot, int32_t *acc_min) {
    const int record = hvx_gemv_record_vectors(bits, mins, halves);
    const HVX_Vector *w = (const HVX_Vector *)weights;
    for (int32_t tile = 0; tile < n_tiles; tile++) {
        row_sums sums = {Q6_V_vzero(), Q6_V_vzero()};
        const int32_t *a = (const int32_t *)activations;
        for (int32_t pair = 0; pair < n_pairs; pair++, w += record, a += hvx_gemv_act_record(halves) / 4)
            step(bits, mins, halves, 1, zero, w, &a, &sums);
        finish(bits, mins, tile, sums, row_factors, dot_factor, min_factor, y, acc_dot, acc_min);
    }
}

/* `rows` activation rows (from `first`) against tile `tile`: each record of the tile read once for all of them. */
static inline __attribute__((always_inline)) void gemm_rows(int bits, int mins, int halves, int rows,
                                                            const HVX_Vector *tile_w,
                                                            const float *row_factors, const uint8_t *activations,
                                                            const float *act_factors, int32_t tile, int32_t n_tiles,
                                                            int32_t n_pairs, int32_t first, int32_t zero, float *y,
                                                            int32_t *acc_dot, int32_t *acc_min) {
    const int record = hvx_gemv_record_vectors(bits, mins, halves);
    const int32_t n_out = n_tiles * HVX_GEMV_ROWS, row_words = n_pairs * hvx_gemv_act_record(halves) / 4;
    row_sums sums[HVX_GEMM_ROWS];
    const int32_t *a[HVX_GEMM_ROWS];
    for (int r = 0; r < rows; r++) {
        sums[r].dot = sums[r].mins = Q6_V_vzero();
        a[r] = (const int32_t *)activations + (first + r) * row_words;
    }
    const HVX_Vector *w = tile_w;
    for (int32_t pair = 0; pair < n_pairs; pair++, w += record) {
        step(bits, mins, halves, rows, zero, w, a, sums);
        for (int r = 0; r < rows; r++) a[r] += hvx_gemv_act_record(halves) / 4;
    }
    for (int r = 0; r < rows; r++) {
        const int32_t row = first + r;
        finish(bits, mins, tile, sums[r], row_factors, act_factors[2 * row], act_factors[2 * row + 1],
               y + row * n_out, acc_dot ? acc_dot + row * n_out : 0, acc_min ? acc_min + row * n_out : 0);
    }
}

/* Tile by tile (its records stay in cache across the groups of activation rows), HVX_GEMM_ROWS rows at a time. */
static inline __attribute__((always_inline)) void gemm(int bits, int mins, int halves, const uint8_t *weights,
                                                       const float *row_factors, const uint8_t *activations,
                                                       const float *act_factors, int32_t n_tiles, int32_t n_pairs,
                                                       int32_t n_rows, int32_t zero, float *y, int32_t *acc_dot,
                                                       int32_t *acc_min) {
    const int record = hvx_gemv_record_vectors(bits, mins, halves);
    for (int32_t tile = 0; tile < n_tiles; tile++) {
        const HVX_Vector *tile_w = (const HVX_Vector *)weights + tile * n_pairs * record;
        int32_t first = 0;
        for (; first + HVX_GEMM_ROWS <= n_rows; first += HVX_GEMM_ROWS)
            gemm_rows(bits, mins, halves, HVX_GEMM_ROWS, tile_w, row_factors, activations, act_factors, tile, n_tiles,
                      n_pairs, first, zero, y, acc_dot, acc_min);
#pragma unroll
        for (int rest = 1; rest < HVX_GEMM_ROWS; rest++)
            if (n_rows - first == rest)
                gemm_rows(bits, mins, halves, rest, tile_w, row_factors, activations, act_factors, tile, n_tiles,
                          n_pairs, first, zero, y, acc_dot, acc_min);
    }
}

#define VARIANT(suffix, bits, mins, halves)                                                                      \
    void hvx_gemv_##suffix(const uint8_t *weights, const float *row_factors, const uint8_t *activations,         \
                           int32_t n_tiles, int32_t n_pairs, int32_t zero, float dot_factor, float min_factor,   \
                           float *y, int32_t *acc_dot, int32_t *acc_min) {                                       \
        gemv(bits, mins, halves, weights, row_factors, activations, n_tiles, n_pairs, zero, dot_factor,          \
             min_factor, y, acc_dot, acc_min);                                                                    \
    }                                                                                                             \
    void hvx_gemm_##suffix(const uint8_t *weights, const float *row_factors, const uint8_t *activations,         \
                           const float *act_factors, int32_t n_tiles, int32_t n_pairs, int32_t n_rows,           \
                           int32_t zero, float *y, int32_t *acc_dot, int32_t *acc_min) {                         \
        gemm(bits, mins, halves, weights, row_factors, activations, act_factors, n_tiles, n_pairs, n_rows, zero, \
             y, acc_dot, acc_min);                                                                                \
    }
VARIANT(4bit, 4, 0, 0)
VARIANT(4bit_mins, 4, 1, 0)
VARIANT(8bit, 8, 0, 0)
VARIANT(8bit_mins, 8, 1, 0)
VARIANT(8bit_g16, 8, 0, 1)
VARIANT(8bit_mins_g16, 8, 1, 1)
