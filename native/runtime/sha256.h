// sha256.h: SHA-256 (FIPS 180-4) for the sha256 of every file an artifact's config lists. The runtime hashes the
// whole artifact (hundreds of MB) each time it opens one, so the compression runs on the CPU's SHA instructions
// when it has them (x86-64 SHA-NI, ARMv8 SHA2), chosen at run time; the portable C++ is the fallback everywhere
// else. The file needs no -m or -march flag: the accelerated code is compiled through target attributes and never
// runs unless the CPU reports the instructions.
#ifndef MOBILEC_NATIVE_RUNTIME_SHA256_H_
#define MOBILEC_NATIVE_RUNTIME_SHA256_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace mobilec {

// kAuto: the accelerated compression when this CPU has it, else the portable one. kAccelerated on a CPU without
// the instructions is refused (std::runtime_error), never executed.
enum class Sha256Engine { kAuto, kPortable, kAccelerated };

class Sha256 {
 public:
  explicit Sha256(Sha256Engine engine = Sha256Engine::kAuto);

  // Whole 64-byte blocks are compressed straight from `data`; only a partial block is buffered.
  void Update(const uint8_t* data, size_t size);

  // The digest as 64 lower-case hex characters. Call once, after the last Update.
  std::string HexDigest();

  // Compresses `count` consecutive 64-byte blocks into the eight state words.
  using CompressFn = void (*)(uint32_t state[8], const uint8_t* blocks, size_t count);

 private:
  CompressFn compress_;
  uint32_t state_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  uint8_t block_[64];
  size_t block_used_ = 0;
  uint64_t total_bytes_ = 0;
};

// Whether this CPU has the SHA-256 instructions the accelerated engine uses: x86-64 SHA-NI (with SSE4.1 and
// SSSE3), aarch64 SHA2 (HWCAP_SHA2). False on other architectures.
bool Sha256Accelerated();

// What kAuto uses on this CPU: "sha-ni", "armv8-sha2" or "portable".
const char* Sha256EngineName();

// The hex digest of a file's content, read in 4 MB chunks. On failure returns "" and sets *error to
// "cannot read PATH: strerror". kAccelerated on a CPU without the instructions throws as the constructor does.
std::string Sha256OfFile(const std::string& path, std::string* error, Sha256Engine engine = Sha256Engine::kAuto);

}  // namespace mobilec

#endif  // MOBILEC_NATIVE_RUNTIME_SHA256_H_
