/* Decode GEMV y = W x and prefill GEMM Y = X W^T on HVX integer instructions (no HVX float: qemu-hexagon cannot run it, and integer
 * fixed point keeps the loop short). Layout: compiler/quantization/hvx_blocks.py, which says what each byte is. */
#ifndef MOBILEC_HVX_GEMV_H
#define MOBILEC_HVX_GEMV_H

#include <stddef.h>
#include <stdint.h>

enum { HVX_GEMV_ROWS = 32, HVX_GEMM_ROWS = 2 };

/* Bytes of a pair of blocks' activation record: 80, or 96 for weights with a scale per 16 values ("halves": their
 * mins' terms and code sums per half block; compiler/kernels/hvx_gemv.py says what each byte is). */
static inline int hvx_gemv_act_record(int halves) { return halves ? 96 : 80; }

/* 128-byte vectors of a tile's record of a pair of blocks: scales (two in halves), mins likewise, the codes. */
static inline int hvx_gemv_record_vectors(int bits, int mins, int halves) {
    return (1 + mins) * (1 + halves) + 2 * bits;
}

/* weights: the tiles of 32 rows, each n_pairs records of two 32-value blocks; row_factors: per row the dot
 * term's and the mins' power of two; activations: n_pairs records; y: n_tiles * 32 floats (padding rows
 * included). acc_dot, acc_min: the integer row sums before scaling, for tests; may be null. */
typedef void hvx_gemv_fn(const uint8_t *weights, const float *row_factors, const uint8_t *activations,
                         int32_t n_tiles, int32_t n_pairs, int32_t zero, float dot_factor, float min_factor,
                         float *y, int32_t *acc_dot, int32_t *acc_min);

/* The dot products' left shift before scaling (hvx_gemv.c; compiler/kernels/hvx_gemv.py mirrors it), at most what
 * keeps |dot| 2^s under 2^21: |dot| < 2^16 for 4-bit codes (whose nibble planes give 2^4 for free), 2^19 for
 * symmetric 8-bit ones, 2^20 with mins. */
static inline int hvx_gemv_dot_shift(int bits, int mins) { return bits == 4 ? 4 : mins ? 1 : 2; }

/* The GEMM: activations n_rows rows of n_pairs records each, act_factors per row [dot_factor, min_factor]; y [n_rows,
 * n_tiles * 32] (and acc_dot, acc_min likewise). HVX_GEMM_ROWS: activation rows per read of a tile's record. */
typedef void hvx_gemm_fn(const uint8_t *weights, const float *row_factors, const uint8_t *activations,
                         const float *act_factors, int32_t n_tiles, int32_t n_pairs, int32_t n_rows, int32_t zero,
                         float *y, int32_t *acc_dot, int32_t *acc_min);

/* _g16: 8-bit codes with a scale (and min) per 16 values (GGUF Q6_K), the "halves" records of both kinds. */
hvx_gemv_fn hvx_gemv_4bit, hvx_gemv_4bit_mins, hvx_gemv_8bit, hvx_gemv_8bit_mins, hvx_gemv_8bit_g16,
    hvx_gemv_8bit_mins_g16;
hvx_gemm_fn hvx_gemm_4bit, hvx_gemm_4bit_mins, hvx_gemm_8bit, hvx_gemm_8bit_mins, hvx_gemm_8bit_g16,
    hvx_gemm_8bit_mins_g16;

#endif
