/* The emulated DSP's kernel server: runs under qemu-hexagon, serves kernel launches from the host
 * (compiler/testing/emulated_hexagon.py, Device).
 *
 * Buffers live in one file that host and DSP both map shared (qemu-user maps a guest MAP_SHARED mapping of a file
 * onto the host's file), so launches move no data. Two kinds of kernels: our C kernels (KERNELS below) and the
 * TVM-compiled kernels of an artifact (lib/hexagon/kernels.o, linked in; TVM_KERNELS, a table written at build
 * time), called with TVM FFI's packed convention. stdin/stdout carry the protocol, little-endian int32 words:
 *   start:   path length, path bytes, region bytes    -> reply: number of kernels, then per kernel its kind (0 C,
 *                                                        1 TVM), its name's length and bytes
 *   launch:  kernel index, argument count (<= 12), then per argument a kind and its words:
 *              0 int32, 1 float32 bits, 2 offset in the region (C kernels);
 *              3 int64 (2 words), 4 float64 (2 words), 5 tensor: offset, ndim (<= 8), DLDataType word, shape
 *              (ndim words) (TVM kernels)
 *            -> reply: 0, or 1, the error message's length and bytes
 *   stop:    -1                                       -> the server exits 0
 * Hexagon's calling convention passes ints, floats and pointers alike in r0-r5 and then 4-byte stack slots, so
 * one call through a 12-word prototype serves every C kernel whose arguments are 32-bit. */
#include "hexagon_sys.h"
#include "hvx_gemv.h"
#include "hvx_norms.h"
#include "tvm_kernels.h"

enum { SYS_OPENAT = 56, SYS_MUNMAP = 215, AT_FDCWD = -100, O_RDWR = 2, PROT_READ_WRITE = 3, MAP_SHARED = 1,
       MAP_PRIVATE_ANONYMOUS = 0x22, MAX_ARGS = 12, MAX_DIMS = 8, DL_HEXAGON = 16 };

typedef void kernel_fn(uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t,
                       uint32_t, uint32_t, uint32_t);

static const struct {
    const char *name;
    void (*fn)(void);
} KERNELS[] = {
    {"hvx_gemv_4bit", (void (*)(void))hvx_gemv_4bit},
    {"hvx_gemv_4bit_mins", (void (*)(void))hvx_gemv_4bit_mins},
    {"hvx_gemv_8bit", (void (*)(void))hvx_gemv_8bit},
    {"hvx_gemv_8bit_mins", (void (*)(void))hvx_gemv_8bit_mins},
    {"hvx_gemv_8bit_g16", (void (*)(void))hvx_gemv_8bit_g16},
    {"hvx_gemv_8bit_mins_g16", (void (*)(void))hvx_gemv_8bit_mins_g16},
    {"hvx_gemm_4bit", (void (*)(void))hvx_gemm_4bit},
    {"hvx_gemm_4bit_mins", (void (*)(void))hvx_gemm_4bit_mins},
    {"hvx_gemm_8bit", (void (*)(void))hvx_gemm_8bit},
    {"hvx_gemm_8bit_mins", (void (*)(void))hvx_gemm_8bit_mins},
    {"hvx_gemm_8bit_g16", (void (*)(void))hvx_gemm_8bit_g16},
    {"hvx_gemm_8bit_mins_g16", (void (*)(void))hvx_gemm_8bit_mins_g16},
    {"hvx_add_rms_norm", (void (*)(void))hvx_add_rms_norm},
    {"hvx_rms_norm", (void (*)(void))hvx_rms_norm},
    {"hvx_swiglu", (void (*)(void))hvx_swiglu},
};
enum { N_KERNELS = sizeof KERNELS / sizeof KERNELS[0] };


/* The TVM runtime's functions a compiled kernel reaches through these pointers (TVM's loader fills them in); weak,
 * so that a server without TVM kernels links too. */
extern void *__TVMBackendAllocWorkspace __attribute__((weak));
extern void *__TVMBackendFreeWorkspace __attribute__((weak));
extern void *__TVMFFIFunctionCall __attribute__((weak));
extern void *__TVMFFIEnvModLookupFromImports __attribute__((weak));
extern void *__TVMFFIHandleInitOnce __attribute__((weak));
extern void *__TVMBackendParallelLaunch __attribute__((weak));

static char error_message[1024];
static int32_t error_length;

static void append_error(const char *text) {
    while (*text && error_length < (int32_t)sizeof error_message) error_message[error_length++] = *text++;
}

void TVMFFIErrorSetRaisedFromCStrParts(const char *kind, const char **parts, int32_t n_parts) {
    error_length = 0;
    append_error(kind);
    append_error(": ");
    for (int32_t i = 0; i < n_parts; i++) append_error(parts[i]);
}

/* LLVM's Hexagon backend calls this for copies it knows to be aligned and long. */
void *__hexagon_memcpy_likely_aligned_min32bytes_mult8bytes(void *dst, const void *src, size_t n) {
    return memcpy(dst, src, n);
}

/* compiler-rt's signed 64-bit division (a real DSP's SDK links its own): LLVM calls it where a kernel divides int64
   values by a variable, as the loops over a dynamic sequence length of a norm do. Shift-and-subtract, one quotient
   bit per step; Hexagon has no divide instruction. */
long long __hexagon_divdi3(long long a, long long b) {
    unsigned long long n = a < 0 ? -(unsigned long long)a : (unsigned long long)a;
    unsigned long long d = b < 0 ? -(unsigned long long)b : (unsigned long long)b;
    unsigned long long quotient = 0, remainder = 0;
    for (int bit = 63; bit >= 0; bit--) {
        remainder = remainder << 1 | (n >> bit & 1);
        if (remainder >= d) {
            remainder -= d;
            quotient |= 1ULL << bit;
        }
    }
    return (a < 0) != (b < 0) ? -(long long)quotient : (long long)quotient;
}

/* Workspace: fresh pages, their size kept in the first 128 bytes (a vector, so the kernel's part stays aligned). */
static void *alloc_workspace(int device_type, int device_id, uint64_t nbytes, int code_hint, int bits_hint) {
    uint32_t total = (uint32_t)nbytes + 128;
    long address = hx_syscall(SYS_MMAP, 0, (long)total, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS, -1, 0);
    if (address < 0 && address > -4096) return 0;
    *(uint32_t *)address = total;
    return (char *)address + 128;
}

static int free_workspace(int device_type, int device_id, void *pointer) {
    char *start = (char *)pointer - 128;
    return (int)hx_syscall(SYS_MUNMAP, (long)start, (long)*(uint32_t *)start, 0, 0, 0, 0);
}

/* The one runtime function TVM's kernels call here: `__tvm_set_device`, which the packed entry of a kernel for a
 * device other than the CPU calls first (a no-op on the DSP). Any other lookup fails with a message. */
static const char SET_DEVICE[] = "__tvm_set_device";

static int same_string(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

static int runtime_error(const char *what, const char *name) {
    const char *parts[] = {what, name, " on the emulated DSP, which provides only __tvm_set_device"};
    TVMFFIErrorSetRaisedFromCStrParts("RuntimeError", parts, 3);
    return -1;
}

static int lookup_from_imports(void *library_ctx, const char *name, void **out) {
    if (!same_string(name, SET_DEVICE)) return runtime_error("a kernel looked up ", name);
    *out = (void *)SET_DEVICE;
    return 0;
}

static int handle_init_once(void **handle, int (*init)(void **result)) { return *handle ? 0 : init(handle); }

static int function_call(void *function, TVMFFIAny *args, int32_t num_args, TVMFFIAny *result) {
    return function == (void *)SET_DEVICE ? 0 : runtime_error("a kernel called a packed function", "");
}

/* A parallel loop (a norm over a dynamic sequence length is scheduled as one) runs as a single task: the emulated
 * DSP has one thread; a real DSP's TVM runtime spreads the tasks over its hardware threads. */
typedef struct { void *sync_handle; int32_t num_task; } parallel_env;
typedef int (*parallel_lambda)(int task_id, parallel_env *env, void *closure);

static int parallel_launch(parallel_lambda lambda, void *closure, int num_task) {
    parallel_env env = {0, 1};
    return lambda(0, &env, closure);
}

static void install_runtime(void) {
    if (&__TVMBackendAllocWorkspace) __TVMBackendAllocWorkspace = (void *)alloc_workspace;
    if (&__TVMBackendFreeWorkspace) __TVMBackendFreeWorkspace = (void *)free_workspace;
    if (&__TVMFFIFunctionCall) __TVMFFIFunctionCall = (void *)function_call;
    if (&__TVMFFIEnvModLookupFromImports) __TVMFFIEnvModLookupFromImports = (void *)lookup_from_imports;
    if (&__TVMFFIHandleInitOnce) __TVMFFIHandleInitOnce = (void *)handle_init_once;
    if (&__TVMBackendParallelLaunch) __TVMBackendParallelLaunch = (void *)parallel_launch;
}

static int32_t read_word(void) {
    int32_t word;
    hx_read_all(&word, sizeof word);
    return word;
}

static void write_word(int32_t word) { hx_write_all(&word, sizeof word); }

static void write_name(int32_t kind, const char *name) {
    int32_t length = 0;
    while (name[length]) length++;
    write_word(kind);
    write_word(length);
    hx_write_all(name, (size_t)length);
}

/* One launch: reads its arguments, calls the kernel; 0, or the error (the message in error_message). */
static int32_t launch(int32_t kernel, uint32_t base) {
    static TVMFFIAny anys[MAX_ARGS];
    static DLTensor tensors[MAX_ARGS];
    static int64_t shapes[MAX_ARGS][MAX_DIMS];
    uint32_t words[MAX_ARGS] = {0};
    int32_t count = read_word();
    if (kernel < 0 || kernel >= N_KERNELS + N_TVM_KERNELS || count < 0 || count > MAX_ARGS) hx_exit(8);
    for (int32_t i = 0; i < count; i++) {
        int32_t kind = read_word();
        anys[i].zero_padding = 0;
        if (kind == 0 || kind == 1) {
            words[i] = (uint32_t)read_word();
        } else if (kind == 2) {
            words[i] = base + (uint32_t)read_word();
        } else if (kind == 3 || kind == 4) {
            anys[i].type_index = kind == 3 ? kTVMFFIInt : kTVMFFIFloat;
            hx_read_all(&anys[i].v_int64, sizeof anys[i].v_int64);
        } else if (kind == 5) {
            DLTensor *t = &tensors[i];
            t->data = (void *)(base + (uint32_t)read_word());
            t->device.device_type = DL_HEXAGON;
            t->device.device_id = 0;
            t->ndim = read_word();
            if (t->ndim < 0 || t->ndim > MAX_DIMS) hx_exit(8);
            uint32_t dtype = (uint32_t)read_word();
            t->dtype.code = (uint8_t)dtype;
            t->dtype.bits = (uint8_t)(dtype >> 8);
            t->dtype.lanes = (uint16_t)(dtype >> 16);
            for (int32_t d = 0; d < t->ndim; d++) shapes[i][d] = read_word();
            t->shape = shapes[i];
            t->strides = 0;
            t->byte_offset = 0;
            anys[i].type_index = kTVMFFIDLTensorPtr;
            anys[i].v_int64 = 0;
            anys[i].v_ptr = t;
        } else {
            hx_exit(8);
        }
    }
    if (kernel < N_KERNELS) {
        ((kernel_fn *)KERNELS[kernel].fn)(words[0], words[1], words[2], words[3], words[4], words[5], words[6],
                                          words[7], words[8], words[9], words[10], words[11]);
        return 0;
    }
    TVMFFIAny result;
    result.type_index = kTVMFFINone;
    result.zero_padding = 0;
    result.v_int64 = 0;
    error_length = 0;
    return TVM_KERNELS[kernel - N_KERNELS].fn(0, anys, count, &result) == 0 ? 0 : 1;
}

int main(void) {
    static char path[4096];
    int32_t path_length = read_word();
    if (path_length <= 0 || path_length >= (int32_t)sizeof path) return 5;
    hx_read_all(path, (size_t)path_length);
    path[path_length] = 0;
    uint32_t region_bytes = (uint32_t)read_word();
    long fd = hx_syscall(SYS_OPENAT, AT_FDCWD, (long)path, O_RDWR, 0, 0, 0);
    if (fd < 0) return 6;
    long base = hx_syscall(SYS_MMAP, 0, (long)region_bytes, PROT_READ_WRITE, MAP_SHARED, fd, 0);
    if (base < 0 && base > -4096) return 7;
    install_runtime();
    write_word(N_KERNELS + N_TVM_KERNELS);
    for (int k = 0; k < N_KERNELS; k++) write_name(0, KERNELS[k].name);
    for (int k = 0; k < N_TVM_KERNELS; k++) write_name(1, TVM_KERNELS[k].name);
    for (;;) {
        int32_t kernel = read_word();
        if (kernel == -1) return 0;
        int32_t status = launch(kernel, (uint32_t)base);
        write_word(status);
        if (status != 0) {
            write_word(error_length);
            hx_write_all(error_message, (size_t)error_length);
        }
    }
}
