// sha256_main.cc: a test driver for mobilec::Sha256 (native/runtime/sha256.h).
//
//     sha256_main --engine                                  -> Sha256EngineName()
//     sha256_main [--chunks[=SEED]] [--time] ENGINE FILE...  -> one line per file: its hex digest
//
// ENGINE is auto, portable or accelerated. Plainly each file goes through Sha256OfFile (4 MB reads). --chunks reads
// the file whole and feeds Update pseudo-random chunks, half of them 1..200 bytes and half 1..100000 bytes, so
// that partial blocks are buffered and completed at every offset. --time reads the file whole and appends to the
// digest the best of 5 hashing times in seconds (reading excluded). Exit status: 3 when the engine is refused
// (its message on stderr), 1 when a file cannot be read, 2 on bad usage.
//
// Built for aarch64 Linux with -DSHA256_MAIN_HIDE_SHA2 -Wl,--wrap=getauxval, it hides HWCAP_SHA2 from sha256.cc:
// no CPU model of qemu-aarch64 lacks SHA2, and the test needs one that does.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "sha256.h"

#if defined(SHA256_MAIN_HIDE_SHA2)
#include <sys/auxv.h>

extern "C" unsigned long __real_getauxval(unsigned long type);  // NOLINT: the linker's --wrap names

extern "C" unsigned long __wrap_getauxval(unsigned long type) {  // NOLINT
  unsigned long value = __real_getauxval(type);
  return type == AT_HWCAP ? value & ~(1UL << 6) : value;  // HWCAP_SHA2
}
#endif

namespace {

int Usage() {
  std::fprintf(stderr, "usage: sha256_main --engine | sha256_main [--chunks[=SEED]] [--time] "
                       "auto|portable|accelerated FILE...\n");
  return 2;
}

bool ReadWhole(const std::string& path, std::vector<uint8_t>* content) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  content->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

// splitmix64: a fixed, seedable sequence, so a failing chunking can be replayed.
uint64_t Next(uint64_t* seed) {
  uint64_t z = (*seed += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

std::string Hash(mobilec::Sha256Engine engine, const std::vector<uint8_t>& content, bool chunks, uint64_t seed) {
  mobilec::Sha256 digest(engine);
  if (!chunks) {
    digest.Update(content.data(), content.size());
    return digest.HexDigest();
  }
  size_t offset = 0;
  while (offset < content.size()) {
    uint64_t draw = Next(&seed);
    size_t limit = (draw & 1) ? 200 : 100000;
    size_t size = std::min<size_t>(1 + (draw >> 1) % limit, content.size() - offset);
    digest.Update(content.data() + offset, size);
    offset += size;
  }
  return digest.HexDigest();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--engine") == 0) {
    std::printf("%s\n", mobilec::Sha256EngineName());
    return 0;
  }
  bool chunks = false, time = false;
  uint64_t seed = 1;
  int arg = 1;
  for (; arg < argc && std::strncmp(argv[arg], "--", 2) == 0; ++arg) {
    if (std::strcmp(argv[arg], "--chunks") == 0) {
      chunks = true;
    } else if (std::strncmp(argv[arg], "--chunks=", 9) == 0) {
      chunks = true;
      seed = std::strtoull(argv[arg] + 9, nullptr, 10);
    } else if (std::strcmp(argv[arg], "--time") == 0) {
      time = true;
    } else {
      return Usage();
    }
  }
  if (arg + 1 >= argc) return Usage();
  std::string name = argv[arg++];
  mobilec::Sha256Engine engine;
  if (name == "auto") {
    engine = mobilec::Sha256Engine::kAuto;
  } else if (name == "portable") {
    engine = mobilec::Sha256Engine::kPortable;
  } else if (name == "accelerated") {
    engine = mobilec::Sha256Engine::kAccelerated;
  } else {
    return Usage();
  }
  try {
    mobilec::Sha256 probe(engine);  // refuse the engine before reading anything
  } catch (const std::runtime_error& refused) {
    std::fprintf(stderr, "%s\n", refused.what());
    return 3;
  }

  for (; arg < argc; ++arg) {
    std::string path = argv[arg];
    if (!chunks && !time) {
      std::string error;
      std::string hex = mobilec::Sha256OfFile(path, &error, engine);
      if (hex.empty()) {
        std::fprintf(stderr, "%s\n", error.c_str());
        return 1;
      }
      std::printf("%s\n", hex.c_str());
      continue;
    }
    std::vector<uint8_t> content;
    if (!ReadWhole(path, &content)) {
      std::fprintf(stderr, "cannot read %s\n", path.c_str());
      return 1;
    }
    std::string hex = Hash(engine, content, chunks, seed);
    if (!time) {
      std::printf("%s\n", hex.c_str());
      continue;
    }
    double best = 1e30;
    for (int run = 0; run < 5; ++run) {
      auto start = std::chrono::steady_clock::now();
      std::string again = Hash(engine, content, chunks, seed);
      std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      if (again != hex) {
        std::fprintf(stderr, "%s: run %d gave %s, not %s\n", path.c_str(), run, again.c_str(), hex.c_str());
        return 1;
      }
      best = std::min(best, took.count());
    }
    std::printf("%s %.6f\n", hex.c_str(), best);
  }
  return 0;
}
