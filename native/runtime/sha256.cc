// sha256.cc: see sha256.h. Three compressions of whole 64-byte blocks share the padding and buffering: the portable
// FIPS 180-4 loop, SHA-NI on x86-64 and the ARMv8 SHA2 instructions on aarch64. The accelerated ones live in
// functions with a target attribute, so the file builds with plain -O2 for the baseline architecture, and they are
// only called after the CPU has reported the instructions.
#include "sha256.h"

#if defined(__x86_64__)
#define MOBILEC_SHA256_X86 1
#include <cpuid.h>
#include <immintrin.h>
#elif defined(__aarch64__) && !defined(__AARCH64EB__)
#define MOBILEC_SHA256_ARM 1
// Clang before 16 declares the SHA intrinsics only when the whole file is built with +sha2; declare them anyway,
// they are only used inside the function that has the target attribute.
#if defined(__clang__) && !defined(__ARM_FEATURE_SHA2)
#define __ARM_FEATURE_SHA2 1
#define MOBILEC_SHA256_DEFINED_FEATURE 1
#endif
#include <arm_neon.h>
#if defined(MOBILEC_SHA256_DEFINED_FEATURE)
#undef __ARM_FEATURE_SHA2
#undef MOBILEC_SHA256_DEFINED_FEATURE
#endif
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_SHA2
#define HWCAP_SHA2 (1 << 6)  // the Linux arm64 ABI value; bionic's <sys/auxv.h> does not define it
#endif
#endif
#endif

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

namespace mobilec {
namespace {

alignas(16) constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void CompressPortable(uint32_t state[8], const uint8_t* blocks, size_t count) {
  for (; count > 0; --count, blocks += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      const uint8_t* word = blocks + 4 * i;
      w[i] = (uint32_t{word[0]} << 24) | (uint32_t{word[1]} << 16) | (uint32_t{word[2]} << 8) | uint32_t{word[3]};
    }
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = h + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
      uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
  }
}

#if defined(MOBILEC_SHA256_X86)

// cpuid leaf 1 ECX: SSSE3 (bit 9), SSE4.1 (bit 19); leaf 7 subleaf 0 EBX: SHA (bit 29). XMM registers need no
// OS support check on x86-64.
bool DetectAccelerated() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  bool ssse3 = (ecx >> 9) & 1, sse41 = (ecx >> 19) & 1;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return ssse3 && sse41 && ((ebx >> 29) & 1);
}

constexpr const char* kAcceleratedName = "sha-ni";
constexpr const char* kAcceleratedNeeds = "SHA-NI, SSE4.1 and SSSE3";

// sha256rnds2 does two rounds on the state held as ABEF and CDGH (A in the highest lane) with W+K of the two
// rounds in the low lanes of its third operand, and returns the new ABEF: the old ABEF is then the new CDGH.
__attribute__((target("sha,sse4.1,ssse3"))) void CompressAccelerated(uint32_t state[8], const uint8_t* blocks,
                                                                     size_t count) {
  // Each 32-bit word of the message is big-endian.
  const __m128i byte_swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  // Lanes listed from the lowest: state A B C D and E F G H become F E B A (ABEF) and H G D C (CDGH).
  __m128i badc = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state)), 0xB1);
  __m128i hgfe = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(state + 4)), 0x1B);
  __m128i abef = _mm_alignr_epi8(badc, hgfe, 8);
  __m128i cdgh = _mm_blend_epi16(hgfe, badc, 0xF0);

  for (; count > 0; --count, blocks += 64) {
    const __m128i abef_start = abef, cdgh_start = cdgh;
    // w[i & 3] holds W[4i..4i+3]; the schedule overwrites the group that is 16 words old.
    __m128i w[4];
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + 16 * i)), byte_swap);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i >= 4) {
        // W[t] = sigma1(W[t-2]) + W[t-7] + sigma0(W[t-15]) + W[t-16]: msg1 gives W[t-16] + sigma0(W[t-15]), alignr
        // the four W[t-7], msg2 adds sigma1 (of the words it has just made, for the upper two).
        __m128i partial = _mm_add_epi32(_mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]),
                                        _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
        w[i & 3] = _mm_sha256msg2_epu32(partial, w[(i + 3) & 3]);
      }
      __m128i wk = _mm_add_epi32(w[i & 3], _mm_load_si128(reinterpret_cast<const __m128i*>(kRound + 4 * i)));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
      abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
    }
    abef = _mm_add_epi32(abef, abef_start);
    cdgh = _mm_add_epi32(cdgh, cdgh_start);
  }

  // Back to A B C D and E F G H.
  __m128i abef_low_first = _mm_shuffle_epi32(abef, 0x1B);  // A B E F
  __m128i ghcd = _mm_shuffle_epi32(cdgh, 0xB1);            // G H C D
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state), _mm_blend_epi16(abef_low_first, ghcd, 0xF0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), _mm_alignr_epi8(ghcd, abef_low_first, 8));
}

#elif defined(MOBILEC_SHA256_ARM)

bool DetectAccelerated() {
#if defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_SHA2) != 0;
#elif defined(__APPLE__)
  return true;  // every arm64 Apple CPU has the ARMv8 crypto extension
#else
  return false;  // no detection here: stay portable
#endif
}

constexpr const char* kAcceleratedName = "armv8-sha2";
constexpr const char* kAcceleratedNeeds = "the ARMv8 SHA2 instructions";

// GCC spells the extension "+crypto" (its "+sha2" is refused by GCC 12's arm_neon.h), Clang "sha2".
#if defined(__clang__)
#define MOBILEC_SHA256_TARGET __attribute__((target("sha2")))
#else
#define MOBILEC_SHA256_TARGET __attribute__((target("+crypto")))
#endif

// sha256h and sha256h2 do four rounds on the state held as ABCD and EFGH, each returning one half; both take the
// halves from before the rounds.
MOBILEC_SHA256_TARGET void CompressAccelerated(uint32_t state[8], const uint8_t* blocks, size_t count) {
  uint32x4_t abcd = vld1q_u32(state), efgh = vld1q_u32(state + 4);
  for (; count > 0; --count, blocks += 64) {
    const uint32x4_t abcd_start = abcd, efgh_start = efgh;
    // w[i & 3] holds W[4i..4i+3]; the schedule overwrites the group that is 16 words old. Words are big-endian.
    uint32x4_t w[4];
    for (int i = 0; i < 4; ++i) w[i] = vreinterpretq_u32_u8(vrev32q_u8(vld1q_u8(blocks + 16 * i)));
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i >= 4) {
        w[i & 3] = vsha256su1q_u32(vsha256su0q_u32(w[i & 3], w[(i + 1) & 3]), w[(i + 2) & 3], w[(i + 3) & 3]);
      }
      uint32x4_t wk = vaddq_u32(w[i & 3], vld1q_u32(kRound + 4 * i));
      uint32x4_t abcd_before = abcd;
      abcd = vsha256hq_u32(abcd, efgh, wk);
      efgh = vsha256h2q_u32(efgh, abcd_before, wk);
    }
    abcd = vaddq_u32(abcd, abcd_start);
    efgh = vaddq_u32(efgh, efgh_start);
  }
  vst1q_u32(state, abcd);
  vst1q_u32(state + 4, efgh);
}

#else

bool DetectAccelerated() { return false; }

constexpr const char* kAcceleratedName = "portable";
constexpr const char* kAcceleratedNeeds = "x86-64 SHA-NI or ARMv8 SHA2";
constexpr Sha256::CompressFn CompressAccelerated = nullptr;

#endif

}  // namespace

bool Sha256Accelerated() {
  static const bool accelerated = DetectAccelerated();
  return accelerated;
}

const char* Sha256EngineName() { return Sha256Accelerated() ? kAcceleratedName : "portable"; }

Sha256::Sha256(Sha256Engine engine) {
  if (engine == Sha256Engine::kAccelerated && !Sha256Accelerated()) {
    throw std::runtime_error(std::string("the accelerated SHA-256 engine needs ") + kAcceleratedNeeds +
                             ", which this CPU does not have");
  }
  bool accelerated = engine == Sha256Engine::kAccelerated || (engine == Sha256Engine::kAuto && Sha256Accelerated());
  compress_ = accelerated ? CompressAccelerated : CompressPortable;
}

void Sha256::Update(const uint8_t* data, size_t size) {
  if (size == 0) return;
  total_bytes_ += size;
  if (block_used_ > 0) {
    size_t take = std::min(size, sizeof(block_) - block_used_);
    std::memcpy(block_ + block_used_, data, take);
    block_used_ += take;
    data += take;
    size -= take;
    if (block_used_ < sizeof(block_)) return;
    compress_(state_, block_, 1);
    block_used_ = 0;
  }
  size_t whole = size / 64;
  if (whole > 0) {
    compress_(state_, data, whole);
    data += whole * 64;
    size -= whole * 64;
  }
  if (size > 0) {
    std::memcpy(block_, data, size);
    block_used_ = size;
  }
}

std::string Sha256::HexDigest() {
  // Padding: 0x80, zeros up to 56 bytes into a block, then the length in bits, big-endian.
  uint64_t bits = total_bytes_ * 8;
  block_[block_used_++] = 0x80;
  if (block_used_ > 56) {
    std::memset(block_ + block_used_, 0, sizeof(block_) - block_used_);
    compress_(state_, block_, 1);
    block_used_ = 0;
  }
  std::memset(block_ + block_used_, 0, 56 - block_used_);
  for (int i = 0; i < 8; ++i) block_[56 + i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  compress_(state_, block_, 1);
  block_used_ = 0;

  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(64, '0');
  for (int i = 0; i < 64; ++i) hex[i] = kHex[(state_[i / 8] >> (28 - 4 * (i % 8))) & 0xf];
  return hex;
}

std::string Sha256OfFile(const std::string& path, std::string* error, Sha256Engine engine) {
  Sha256 digest(engine);
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    *error = "cannot read " + path + ": " + std::strerror(errno);
    return "";
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(file, std::fclose);
  std::vector<uint8_t> buffer(size_t{4} << 20);
  size_t got;
  while ((got = std::fread(buffer.data(), 1, buffer.size(), file)) > 0) digest.Update(buffer.data(), got);
  if (std::ferror(file)) {
    *error = "cannot read " + path + ": " + std::strerror(errno);
    return "";
  }
  return digest.HexDigest();
}

}  // namespace mobilec
