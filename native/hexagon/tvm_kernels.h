/* The TVM-compiled kernels the kernel server links (device_server.c): a table that
 * compiler/testing/emulated_hexagon.py writes at build time from the objects' __tvm_ffi_* symbols. */
#ifndef MOBILEC_TVM_KERNELS_H
#define MOBILEC_TVM_KERNELS_H

#include <tvm/ffi/c_api.h>

struct tvm_kernel {
    const char *name;
    TVMFFISafeCallType fn;
};
extern const struct tvm_kernel TVM_KERNELS[];
extern const int32_t N_TVM_KERNELS;

#endif
