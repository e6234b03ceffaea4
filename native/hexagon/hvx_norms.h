/* RMSNorm (with the residual add fused) and SwiGLU for the DSP, float32, with our own rsqrt and sigmoid (no libm, no
 * float division: both are compiler-rt calls on Hexagon). Written on 32-lane float vectors (clang's vector
 * extension): built with HVX IEEE float (LLVM's +hvx-ieee-fp, v68 and later: a phone's DSP) each operation is one
 * HVX sf instruction; built for the emulated DSP (no HVX float: qemu-hexagon 10 aborts on every HVX float
 * instruction) LLVM runs the same operations lane by lane in scalar float, so emulation checks the same numerics. */
#ifndef MOBILEC_HVX_NORMS_H
#define MOBILEC_HVX_NORMS_H

#include <stdint.h>

/* sum[r] = x[r] + residual[r]; out[r] = sum[r] * rsqrt(mean(sum[r]^2) + eps) * weight, for rows r of n values;
 * sum may be null (the sum is not written). */
void hvx_add_rms_norm(const float *x, const float *residual, const float *weight, float *sum, float *out,
                      int32_t rows, int32_t n, float eps);
/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight. */
void hvx_rms_norm(const float *x, const float *weight, float *out, int32_t rows, int32_t n, float eps);
/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]: each row of gate_up is the gate's n values, then the up's. */
void hvx_swiglu(const float *gate_up, float *out, int32_t rows, int32_t n);

#endif
