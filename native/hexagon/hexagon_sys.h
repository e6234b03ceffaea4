/* A freestanding Hexagon Linux program's needs, without a libc: `_start`, raw system calls (trap0(#1), the
 * number in r6) and the memory functions clang may call. Programs built with it run under qemu-hexagon
 * (compiler/testing/emulated_hexagon.py); they define `int main(void)` and talk over stdin/stdout. */
#ifndef MOBILEC_HEXAGON_SYS_H
#define MOBILEC_HEXAGON_SYS_H

#include <stddef.h>
#include <stdint.h>

enum { SYS_READ = 63, SYS_WRITE = 64, SYS_EXIT = 93, SYS_MMAP = 222 };

static inline long hx_syscall(long number, long a0, long a1, long a2, long a3, long a4, long a5) {
    register long r0 __asm__("r0") = a0;
    register long r1 __asm__("r1") = a1;
    register long r2 __asm__("r2") = a2;
    register long r3 __asm__("r3") = a3;
    register long r4 __asm__("r4") = a4;
    register long r5 __asm__("r5") = a5;
    register long r6 __asm__("r6") = number;
    __asm__ volatile("trap0(#1)" : "+r"(r0) : "r"(r1), "r"(r2), "r"(r3), "r"(r4), "r"(r5), "r"(r6) : "memory");
    return r0;
}

static inline __attribute__((noreturn)) void hx_exit(int code) {
    hx_syscall(SYS_EXIT, code, 0, 0, 0, 0, 0);
    __builtin_unreachable();
}

/* Reads or writes exactly n bytes; exits with 3 on a short read (the host closed the pipe) or a failed write. */
static void hx_read_all(void *buffer, size_t n) {
    for (size_t done = 0; done < n;) {
        long got = hx_syscall(SYS_READ, 0, (long)((char *)buffer + done), (long)(n - done), 0, 0, 0);
        if (got <= 0) hx_exit(3);
        done += (size_t)got;
    }
}

static void hx_write_all(const void *buffer, size_t n) {
    for (size_t done = 0; done < n;) {
        long put = hx_syscall(SYS_WRITE, 1, (long)((const char *)buffer + done), (long)(n - done), 0, 0, 0);
        if (put <= 0) hx_exit(3);
        done += (size_t)put;
    }
}

void *memcpy(void *dst, const void *src, size_t n) {
    for (size_t i = 0; i < n; i++) ((char *)dst)[i] = ((const char *)src)[i];
    return dst;
}

void *memset(void *dst, int value, size_t n) {
    for (size_t i = 0; i < n; i++) ((char *)dst)[i] = (char)value;
    return dst;
}

int main(void);

void _start(void) { hx_exit(main()); }

#endif
