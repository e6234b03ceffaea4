// mobilec_api.cc: the C API of mobilec.h over TVM's C++ runtime. What compiler/artifacts/artifact.py load_artifact,
// compiler/target/cpu_check.py, compiler/runtime/session.py Session and compiler/runtime/generate.py do in Python, with
// the same checks and messages, for CPU (llvm) artifacts in this process.
#include "mobilec.h"

#include <dlpack/dlpack.h>
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#endif

#include "bpe_tokenizer.h"
#include "chat_prompt.h"
#include "sha256.h"

// What this runtime checks an artifact's "versions" against (compiler/artifacts/native_runtime.py passes the versions
// of the packages whose TVM libraries it links; an empty one is not checked).
#ifndef MOBILEC_VERSION
#error "build with -DMOBILEC_VERSION=... (compiler/artifacts/native_runtime.py does)"
#endif
#ifndef MOBILEC_TVM_VERSION
#error "build with -DMOBILEC_TVM_VERSION=... (compiler/artifacts/native_runtime.py does)"
#endif
#ifndef MOBILEC_TVM_FFI_VERSION
#error "build with -DMOBILEC_TVM_FFI_VERSION=... (compiler/artifacts/native_runtime.py does)"
#endif

namespace {

namespace fs = std::filesystem;
namespace ffi = tvm::ffi;
namespace json = tvm::ffi::json;

// compiler/artifacts/artifact.py's layout.
constexpr int64_t kFormatVersion = 3;
constexpr const char* kConfigFile = "mobilec-config.json";
constexpr const char* kParamsDir = "params";
constexpr const char* kParamsIndex = "params/index.json";
constexpr const char* kTokenizerDir = "tokenizer";
constexpr int kPooledAllocator = 2;  // tvm.runtime.vm.VirtualMachine.POOLED_ALLOCATOR, its default
// compiler/kernels/integer_dot_gemv KERNEL_PREFIX: the names of the integer-dot decode GEMVs in "call_sites".
constexpr const char* kIntegerDotGemvPrefix = "integer_dot_gemv_";

thread_local std::string last_error;

// A failure with the status the C API returns for it; the message is one line.
class Failure : public std::runtime_error {
 public:
  Failure(mobilec_status status, const std::string& message) : std::runtime_error(message), status(status) {}
  mobilec_status status;
};

[[noreturn]] void Fail(mobilec_status status, const std::string& message) { throw Failure(status, message); }

std::string FirstLine(const std::string& text) { return text.substr(0, text.find('\n')); }

// Runs one C API call: every exception (ours, TVM's, the standard library's) becomes a status and last_error.
template <typename Body>
mobilec_status Guarded(Body body) {
  try {
    body();
    return MOBILEC_OK;
  } catch (const Failure& failure) {
    last_error = failure.what();
    return failure.status;
  } catch (const ffi::Error& error) {
    last_error = FirstLine(error.kind() + ": " + error.message());
    return MOBILEC_ERROR_RUNTIME;
  } catch (const std::bad_alloc&) {
    last_error = "out of memory";
    return MOBILEC_ERROR_RUNTIME;
  } catch (const std::exception& error) {
    last_error = FirstLine(error.what());
    return MOBILEC_ERROR_RUNTIME;
  } catch (...) {
    last_error = "unknown error";
    return MOBILEC_ERROR_RUNTIME;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// JSON values, read the way compiler/artifacts/artifact.py reads them (Python's int excludes bool).

std::optional<int64_t> AsInt(const ffi::Any& value) {
  if (value.as<bool>().has_value()) return std::nullopt;
  return value.as<int64_t>();
}

std::optional<std::string> AsString(const ffi::Any& value) {
  if (auto text = value.as<ffi::String>()) return std::string(*text);
  return std::nullopt;
}

ffi::Any Field(const json::Object& object, const char* key) {
  auto value = object.Get(ffi::String(key));
  return value.has_value() ? *value : ffi::Any();
}

std::optional<json::Object> ObjectField(const json::Object& object, const char* key) {
  return Field(object, key).as<json::Object>();
}

std::string StringField(const json::Object& object, const char* key, const std::string& fallback = "") {
  return AsString(Field(object, key)).value_or(fallback);
}

// A JSON value as Python's repr would show it in a message (None, 'text', 12).
std::string Repr(const ffi::Any& value) {
  if (value.type_index() == ffi::TypeIndex::kTVMFFINone) return "None";
  if (auto flag = value.as<bool>()) return *flag ? "True" : "False";
  if (auto text = AsString(value)) return "'" + *text + "'";
  return std::string(json::Stringify(value));
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Fail(MOBILEC_ERROR_ARTIFACT, "cannot read " + path.string() + ": " + std::strerror(errno));
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

// compiler/artifacts/artifact.py _read_json.
json::Object ReadJsonObject(const fs::path& path, const std::string& what) {
  std::error_code ignored;
  if (!fs::exists(path, ignored)) {
    Fail(MOBILEC_ERROR_ARTIFACT, path.parent_path().string() + " is not a mobilec artifact: " + what +
                                     " is missing; run `mobilec compile` first");
  }
  ffi::String parse_error;
  json::Value value = json::Parse(ReadFile(path), &parse_error);
  if (!parse_error.empty()) {
    Fail(MOBILEC_ERROR_ARTIFACT,
         path.string() + " is corrupt (not JSON); recompile the artifact with `mobilec compile`");
  }
  auto object = value.as<json::Object>();
  if (!object) {
    Fail(MOBILEC_ERROR_ARTIFACT,
         path.string() + " is corrupt (not a JSON object); recompile the artifact with `mobilec compile`");
  }
  return *object;
}

// ---------------------------------------------------------------------------------------------------------------
// The sha256 of a file the artifact's config lists (sha256.cc: the CPU's SHA instructions where it has them).
std::string Sha256OfFile(const fs::path& path) {
  std::string error;
  std::string digest = mobilec::Sha256OfFile(path.string(), &error);
  if (digest.empty()) Fail(MOBILEC_ERROR_ARTIFACT, error);
  return digest;
}

// ---------------------------------------------------------------------------------------------------------------
// The artifact, checked as compiler/artifacts/artifact.py load_artifact checks it (same messages).

struct Artifact {
  fs::path root;
  json::Object config;
  json::Object index;
  fs::path library;
  int64_t context_window = 0;
  int64_t prefill_chunk = 0;
  int64_t page_size = 0;
};

// A manifest name is a plain relative path that stays inside the artifact.
bool Inside(const ffi::Any& name) {
  auto text = AsString(name);
  if (!text || text->empty() || text->find('\\') != std::string::npos) return false;
  fs::path path(*text);
  if (path.is_absolute()) return false;
  return std::none_of(path.begin(), path.end(), [](const fs::path& part) { return part == ".."; });
}

void CheckVersions(const Artifact& artifact) {
  auto built_with = ObjectField(artifact.config, "versions").value_or(json::Object());
  const std::pair<const char*, const char*> runtime_versions[] = {
      {"mobilec", MOBILEC_VERSION}, {"apache-tvm", MOBILEC_TVM_VERSION}, {"apache-tvm-ffi", MOBILEC_TVM_FFI_VERSION}};
  std::string mismatched;
  for (const auto& [package, have] : runtime_versions) {
    auto recorded = AsString(Field(built_with, package));
    if (!*have || !recorded || *recorded == have) continue;
    mismatched += (mismatched.empty() ? "" : ", ") + std::string(package) + " " + *recorded + " (this runtime has " +
                  have + ")";
  }
  if (!mismatched.empty()) {
    Fail(MOBILEC_ERROR_ARTIFACT, artifact.root.string() + " was built with " + mismatched +
                                     "; recompile it with the mobilec this runtime belongs to");
  }
}

// Every listed file is there with its size (a truncated library would kill the process: SIGBUS) and, unless
// `sizes_only`, its sha256.
void CheckFiles(const Artifact& artifact, bool sizes_only) {
  const fs::path config_path = artifact.root / kConfigFile;
  auto listed = ObjectField(artifact.config, "files");
  bool valid = listed.has_value();
  if (valid) {
    for (const auto& [name, entry] : *listed) valid = valid && Inside(name) && entry.as<json::Object>().has_value();
  }
  if (!valid) {
    Fail(MOBILEC_ERROR_ARTIFACT,
         config_path.string() + " has no valid list of the artifact's files; recompile the artifact");
  }
  const std::string library = StringField(artifact.config, "library");
  for (const std::string& name : {library, std::string(kParamsIndex)}) {
    if (!listed->count(ffi::String(name))) {
      Fail(MOBILEC_ERROR_ARTIFACT, config_path.string() + " does not list '" + name +
                                       "' among the artifact's files; recompile the artifact");
    }
  }
  for (const auto& [name_any, entry_any] : *listed) {
    const std::string name = *AsString(name_any);
    const json::Object entry = *entry_any.as<json::Object>();
    const fs::path path = artifact.root / name;
    const std::string what = name.rfind(std::string(kParamsDir) + "/shard_", 0) == 0 ? "weight shard"
                             : name == library                                       ? "compiled library"
                                                                                     : "file";
    std::error_code error;
    if (!fs::is_regular_file(path, error)) {
      Fail(MOBILEC_ERROR_ARTIFACT, what + " " + path.string() + " is missing; recompile the artifact");
    }
    const auto size = static_cast<int64_t>(fs::file_size(path, error));
    const ffi::Any listed_bytes = Field(entry, "bytes");
    if (error || AsInt(listed_bytes) != size) {
      Fail(MOBILEC_ERROR_ARTIFACT, what + " " + path.string() + " has " + std::to_string(size) +
                                       " bytes, the artifact lists " + Repr(listed_bytes) +
                                       " (truncated or modified); recompile the artifact");
    }
    if (!sizes_only && Sha256OfFile(path) != StringField(entry, "sha256")) {
      Fail(MOBILEC_ERROR_ARTIFACT, what + " " + path.string() +
                                       " fails its sha256 check (corrupted or modified); recompile the artifact");
    }
  }
}

Artifact LoadArtifact(const std::string& directory, bool sizes_only) {
  Artifact artifact;
  artifact.root = fs::path(directory).lexically_normal();
  if (artifact.root.has_filename() == false && artifact.root.has_parent_path()) {
    artifact.root = artifact.root.parent_path();  // "smol/" reads as "smol" in messages, as Python's Path does
  }
  std::error_code error;
  if (!fs::is_directory(artifact.root, error)) {
    Fail(MOBILEC_ERROR_ARTIFACT, "artifact directory " + artifact.root.string() +
                                     " does not exist; run `mobilec compile` to create it");
  }
  const fs::path config_path = artifact.root / kConfigFile;
  artifact.config = ReadJsonObject(config_path, kConfigFile);
  const ffi::Any format = Field(artifact.config, "format_version");
  if (AsInt(format) != kFormatVersion) {
    Fail(MOBILEC_ERROR_ARTIFACT, artifact.root.string() + " has artifact format " + Repr(format) +
                                     ", this mobilec reads " + std::to_string(kFormatVersion) + "; recompile it");
  }
  CheckVersions(artifact);
  if (!Inside(Field(artifact.config, "library"))) {
    Fail(MOBILEC_ERROR_ARTIFACT, config_path.string() + " names no library inside the artifact; recompile the artifact");
  }
  artifact.library = artifact.root / StringField(artifact.config, "library");
  CheckFiles(artifact, sizes_only);
  for (const char* key : {"context_window", "prefill_chunk", "page_size"}) {
    const ffi::Any value = Field(artifact.config, key);
    auto number = AsInt(value);
    if (!number || *number < 1) {
      Fail(MOBILEC_ERROR_ARTIFACT, config_path.string() + ": '" + key + "' must be a positive whole number, got " +
                                       Repr(value) + "; recompile the artifact");
    }
  }
  artifact.context_window = *AsInt(Field(artifact.config, "context_window"));
  artifact.prefill_chunk = *AsInt(Field(artifact.config, "prefill_chunk"));
  artifact.page_size = *AsInt(Field(artifact.config, "page_size"));
  artifact.index = ReadJsonObject(artifact.root / kParamsIndex, kParamsIndex);
  auto files = *ObjectField(artifact.config, "files");
  auto shards = Field(artifact.index, "shards").as<json::Array>().value_or(json::Array());
  for (const ffi::Any& shard : shards) {
    const std::string file = shard.as<json::Object>() ? StringField(*shard.as<json::Object>(), "file", "None") : "None";
    if (!files.count(ffi::String(std::string(kParamsDir) + "/" + file))) {
      Fail(MOBILEC_ERROR_ARTIFACT, "weight shard " + (artifact.root / kParamsDir / file).string() +
                                       " is not among the artifact's files; recompile the artifact");
    }
  }
  return artifact;
}

// ---------------------------------------------------------------------------------------------------------------
// Whether this CPU runs the artifact's code (compiler/target/cpu_check.py check_cpu and runtime/remote.py
// check_runs_on): the config's "cpu" names the architecture and the LLVM features the code uses; a missing one
// would be SIGILL.

#if defined(__x86_64__)
constexpr const char* kThisArch = "x86_64";

struct CpuidBit {
  uint32_t leaf, subleaf;
  int register_index;  // 0 eax, 1 ebx, 2 ecx, 3 edx
  int bit;
};

// compiler/target/isa.py X86_FEATURE_FLAGS's LLVM names, by their cpuid bit (Intel SDM vol. 2A, CPUID).
const std::unordered_map<std::string, CpuidBit>& X86FeatureBits() {
  static const std::unordered_map<std::string, CpuidBit> bits = {
      {"sse3", {1, 0, 2, 0}},           {"pclmul", {1, 0, 2, 1}},         {"ssse3", {1, 0, 2, 9}},
      {"fma", {1, 0, 2, 12}},           {"sse4.1", {1, 0, 2, 19}},        {"sse4.2", {1, 0, 2, 20}},
      {"movbe", {1, 0, 2, 22}},         {"popcnt", {1, 0, 2, 23}},        {"aes", {1, 0, 2, 25}},
      {"avx", {1, 0, 2, 28}},           {"f16c", {1, 0, 2, 29}},          {"bmi", {7, 0, 1, 3}},
      {"avx2", {7, 0, 1, 5}},           {"bmi2", {7, 0, 1, 8}},           {"avx512f", {7, 0, 1, 16}},
      {"avx512dq", {7, 0, 1, 17}},      {"adx", {7, 0, 1, 19}},           {"avx512ifma", {7, 0, 1, 21}},
      {"avx512cd", {7, 0, 1, 28}},      {"sha", {7, 0, 1, 29}},           {"avx512bw", {7, 0, 1, 30}},
      {"avx512vl", {7, 0, 1, 31}},      {"avx512vbmi", {7, 0, 2, 1}},     {"avx512vbmi2", {7, 0, 2, 6}},
      {"gfni", {7, 0, 2, 8}},           {"vaes", {7, 0, 2, 9}},           {"vpclmulqdq", {7, 0, 2, 10}},
      {"avx512vnni", {7, 0, 2, 11}},    {"avx512bitalg", {7, 0, 2, 12}},  {"avx512vpopcntdq", {7, 0, 2, 14}},
      {"avx512fp16", {7, 0, 3, 23}},    {"avxvnni", {7, 1, 0, 4}},        {"avx512bf16", {7, 1, 0, 5}},
      {"lzcnt", {0x80000001, 0, 2, 5}},
  };
  return bits;
}

bool CpuHasFeature(const std::string& feature) {
  auto found = X86FeatureBits().find(feature);
  if (found == X86FeatureBits().end()) return false;
  const CpuidBit& want = found->second;
  uint32_t registers[4];
  if (!__get_cpuid_count(want.leaf, want.subleaf, &registers[0], &registers[1], &registers[2], &registers[3])) {
    return false;
  }
  if (!((registers[want.register_index] >> want.bit) & 1)) return false;
  // The OS must save the wide registers too (XCR0), as Linux's /proc/cpuinfo flags reflect.
  const bool vector_256 = feature.rfind("avx", 0) == 0 || feature == "fma" || feature == "f16c" ||
                          feature == "vaes" || feature == "vpclmulqdq";
  if (!vector_256) return true;
  uint32_t eax, ebx, ecx, edx;
  __get_cpuid(1, &eax, &ebx, &ecx, &edx);
  if (!((ecx >> 27) & 1)) return false;  // OSXSAVE
  uint32_t xcr0_low, xcr0_high;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  const uint32_t needed = feature.rfind("avx512", 0) == 0 ? 0xE6 : 0x6;  // SSE+AVX state, + opmask/ZMM state
  return (xcr0_low & needed) == needed;
}

#elif defined(__aarch64__)
constexpr const char* kThisArch = "aarch64";

// compiler/target/isa.py AARCH64_FEATURE_FLAGS's LLVM names, by their Linux hwcap bit (asm/hwcap.h).
bool CpuHasFeature(const std::string& feature) {
  static const std::unordered_map<std::string, std::pair<unsigned long, int>> bits = {  // NOLINT(runtime/int)
      {"neon", {AT_HWCAP, 1}},       {"aes", {AT_HWCAP, 3}},        {"sha2", {AT_HWCAP, 6}},
      {"crc", {AT_HWCAP, 7}},        {"lse", {AT_HWCAP, 8}},        {"fullfp16", {AT_HWCAP, 10}},
      {"rdm", {AT_HWCAP, 12}},       {"dotprod", {AT_HWCAP, 20}},   {"sve", {AT_HWCAP, 22}},
      {"sve2", {AT_HWCAP2, 1}},      {"i8mm", {AT_HWCAP2, 13}},     {"bf16", {AT_HWCAP2, 14}},
  };
  auto found = bits.find(feature);
  if (found == bits.end()) return false;
  return (getauxval(found->second.first) >> found->second.second) & 1;
}

#else
constexpr const char* kThisArch = "other";
bool CpuHasFeature(const std::string&) { return false; }
#endif

std::string ArchOfTriple(const std::string& triple) {
  if (triple.rfind("x86_64", 0) == 0 || triple.rfind("amd64", 0) == 0) return "x86_64";
  if (triple.rfind("aarch64", 0) == 0 || triple.rfind("arm64", 0) == 0) return "aarch64";
  return "other";
}

void CheckRunsHere(const Artifact& artifact) {
  const json::Object target = ObjectField(artifact.config, "target").value_or(json::Object());
  const json::Object tvm_target = ObjectField(target, "tvm_target").value_or(json::Object());
  const std::string target_name = StringField(target, "name", "?");
  const std::string kind = StringField(tvm_target, "kind", "?");
  if (kind != "llvm") {
    Fail(MOBILEC_ERROR_UNSUPPORTED_CPU, artifact.root.string() + " is built for " + target_name + " (" + kind +
                                            "); the native runtime runs CPU (llvm) artifacts: compile one with "
                                            "--target host or linux-arm64/android-arm64");
  }
  // An artifact written before the config's "cpu" entry records its architecture in the target triple only.
  const auto cpu = ObjectField(artifact.config, "cpu");
  const std::string need_arch = cpu ? StringField(*cpu, "arch") : ArchOfTriple(StringField(tvm_target, "mtriple"));
  const std::string rebuild_hint = "recompile it for this CPU (--target host on it, or a --target file for it)";
  if (!need_arch.empty() && need_arch != kThisArch) {
    Fail(MOBILEC_ERROR_UNSUPPORTED_CPU, artifact.root.string() + " is built for " + need_arch + " (target " +
                                            target_name + ") but this CPU is " + kThisArch + ": " + rebuild_hint);
  }
  if (!cpu) return;
  std::vector<std::string> missing;
  for (const ffi::Any& feature : Field(*cpu, "required_features").as<json::Array>().value_or(json::Array())) {
    auto name = AsString(feature);
    if (name && !CpuHasFeature(*name)) missing.push_back(*name);
  }
  std::sort(missing.begin(), missing.end());
  if (!missing.empty()) {
    std::string names;
    for (const auto& name : missing) names += (names.empty() ? "" : ", ") + name;
    Fail(MOBILEC_ERROR_UNSUPPORTED_CPU, artifact.root.string() + " is built for a CPU with " + names + " (target " +
                                            target_name + "); this CPU lacks " +
                                            (missing.size() == 1 ? "it" : "them") + ": " + rebuild_hint);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Text: UTF-8 completeness (streaming) and transformers' lossy decoding (U+FFFD for each invalid sequence).

// How text[at...] reads as one UTF-8 character (RFC 3629): whole, or only its first valid_bytes are valid
// (cut short by an invalid byte or by the end of the text; 0 when the first byte cannot start a character).
struct Utf8Read {
  size_t valid_bytes;
  bool whole;
};

Utf8Read ReadUtf8Character(const std::string& text, size_t at) {
  const auto lead = static_cast<unsigned char>(text[at]);
  if (lead < 0x80) return {1, true};
  size_t length;
  unsigned char low = 0x80, high = 0xBF;  // the second byte's range
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;  // no overlong forms
    if (lead == 0xED) high = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;  // nothing past U+10FFFF
  } else {
    return {0, false};
  }
  for (size_t i = 1; i < length; ++i) {
    if (at + i >= text.size()) return {i, false};
    const auto next = static_cast<unsigned char>(text[at + i]);
    if (next < (i == 1 ? low : 0x80) || next > (i == 1 ? high : 0xBF)) return {i, false};
  }
  return {length, true};
}

// Whether the text ends inside a multi-byte character that more bytes may complete (streaming waits for them).
bool EndsInsideCharacter(const std::string& text) {
  for (size_t back = 1; back <= std::min<size_t>(4, text.size()); ++back) {
    const size_t at = text.size() - back;
    if ((static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) continue;  // a continuation byte: find its lead
    const Utf8Read read = ReadUtf8Character(text, at);
    return !read.whole && read.valid_bytes == back;
  }
  return false;
}

// Invalid bytes replaced by U+FFFD, one per maximal invalid part, as Rust's from_utf8_lossy (tokenizers' decode).
std::string LossyUtf8(const std::string& bytes) {
  std::string text;
  text.reserve(bytes.size());
  for (size_t at = 0; at < bytes.size();) {
    const Utf8Read read = ReadUtf8Character(bytes, at);
    if (read.whole) {
      text.append(bytes, at, read.valid_bytes);
    } else {
      text += "\xEF\xBF\xBD";
    }
    at += std::max<size_t>(read.valid_bytes, 1);
  }
  return text;
}

// ---------------------------------------------------------------------------------------------------------------
// The tokenizer files: tokenizer.json (BpeTokenizer), the EOS of tokenizer_config.json, the BOS/EOS the
// post-processor adds (transformers' encode with add_special_tokens).

std::string TokenContent(const ffi::Any& token) {  // "eos_token": "<|im_end|>" or {"content": "<|im_end|>", ...}
  if (auto text = AsString(token)) return *text;
  if (auto object = token.as<json::Object>()) return StringField(*object, "content");
  return "";
}

struct TemplatePiece {
  bool is_text;                  // the prompt's own ids ("Sequence A"); else the special ids
  std::vector<int32_t> special;  // the ids a "SpecialToken" entry adds
};

// The "single" template of a TemplateProcessing post-processor (also inside a "Sequence" of processors); an empty
// list when the tokenizer adds nothing. Other post-processors change nothing for one sequence (ByteLevel) or are
// not used by the models mobilec compiles: refused rather than ignored.
std::vector<TemplatePiece> SingleTemplate(const fs::path& tokenizer_json) {
  const json::Object tokenizer = ReadJsonObject(tokenizer_json, "tokenizer/tokenizer.json");
  std::vector<json::Object> processors;
  if (auto processor = ObjectField(tokenizer, "post_processor")) {
    if (StringField(*processor, "type") == "Sequence") {
      for (const ffi::Any& inner : Field(*processor, "processors").as<json::Array>().value_or(json::Array())) {
        if (auto object = inner.as<json::Object>()) processors.push_back(*object);
      }
    } else {
      processors.push_back(*processor);
    }
  }
  std::vector<TemplatePiece> pieces;
  for (const json::Object& processor : processors) {
    const std::string type = StringField(processor, "type");
    if (type == "ByteLevel") continue;
    if (type != "TemplateProcessing") {
      Fail(MOBILEC_ERROR_UNSUPPORTED, tokenizer_json.string() + ": post_processor " + type +
                                          " is not supported by the native runtime");
    }
    const json::Object special_tokens = ObjectField(processor, "special_tokens").value_or(json::Object());
    for (const ffi::Any& entry : Field(processor, "single").as<json::Array>().value_or(json::Array())) {
      auto object = entry.as<json::Object>().value_or(json::Object());
      if (object.count(ffi::String("Sequence"))) {
        pieces.push_back({true, {}});
        continue;
      }
      auto special = ObjectField(object, "SpecialToken").value_or(json::Object());
      auto definition = ObjectField(special_tokens, StringField(special, "id").c_str()).value_or(json::Object());
      TemplatePiece piece{false, {}};
      for (const ffi::Any& id : Field(definition, "ids").as<json::Array>().value_or(json::Array())) {
        piece.special.push_back(static_cast<int32_t>(AsInt(id).value_or(-1)));
      }
      pieces.push_back(piece);
    }
  }
  return pieces;
}

// ---------------------------------------------------------------------------------------------------------------
// Sampling, as compiler/runtime/generate.py sample.

// A double in [0, 1) from 53 random bits: the same on every standard library (their distributions differ).
double UniformUnit(std::mt19937_64& generator) { return static_cast<double>(generator() >> 11) * 0x1.0p-53; }

int32_t Sample(const float* logits, size_t vocab, double temperature, double top_p, std::mt19937_64& generator) {
  if (temperature <= 0) {
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);  // the first largest
  }
  const float largest = *std::max_element(logits, logits + vocab);
  std::vector<double> probs(vocab);
  double total = 0;
  for (size_t i = 0; i < vocab; ++i) total += probs[i] = std::exp((logits[i] - largest) / temperature);
  for (double& p : probs) p /= total;
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
  // keep = order[: searchsorted(cumsum, top_p) + 1]: through the first token whose cumulative mass reaches top_p.
  size_t keep = 0;
  double cumulative = 0;
  while (keep < vocab) {
    cumulative += probs[order[keep++]];
    if (cumulative >= top_p) break;
  }
  double kept_mass = 0;
  for (size_t i = 0; i < keep; ++i) kept_mass += probs[order[i]];
  double draw = UniformUnit(generator) * kept_mass;
  for (size_t i = 0; i < keep; ++i) {
    draw -= probs[order[i]];
    if (draw < 0) return order[i];
  }
  return order[keep - 1];
}

void CheckSampling(double temperature, double top_p) {
  if (!(temperature >= 0 && std::isfinite(temperature))) {
    Fail(MOBILEC_ERROR_INVALID_ARGUMENT,
         "--temperature must be 0 (greedy) or a positive number, got " + std::to_string(temperature));
  }
  if (!(top_p > 0 && top_p <= 1)) {
    Fail(MOBILEC_ERROR_INVALID_ARGUMENT, "--top-p must be above 0 and at most 1, got " + std::to_string(top_p));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// The handle: the Relax VM, its weights and the paged KV cache of one sequence (compiler/runtime/session.py
// LoadedArtifact and Session); engines (below) run several sequences in a cache of their own through the same
// Forward.

struct mobilec_model {
  Artifact artifact;
  std::unique_ptr<mobilec::BpeTokenizer> tokenizer;
  std::vector<TemplatePiece> single_template;
  mobilec::ChatPrompt chat_prompt;
  int32_t eos_token_id = -1;

  std::optional<ffi::Module> vm;  // set by LoadModel
  ffi::Any params;  // Array<Tensor> in the order the compiled functions take them (params/index.json's)
  ffi::Function embed, prefill_function, prefill_logits_function, decode_function, create_kv_cache;
  ffi::Function add_sequence, remove_sequence, fork_sequence, available_pages, begin_forward, end_forward;
  // What decodes several sequences in one call (compiler/serve/engine.py's Engine.batch_function): batch_decode
  // where the artifact exports it (integer-dot GEMVs with a row per sequence), prefill_logits where the decode
  // GEMVs are float ones, none (one decode call each) for integer-dot GEMVs without a batched form.
  std::optional<ffi::Function> batch_function;
  ffi::Any kv_cache;  // the single sequence's (id 0)
  std::optional<ffi::Tensor> one_token;  // a one-token input, rewritten in place
  int64_t length = 0;              // tokens in the sequence
  int32_t vocab_size = 0;
  std::vector<float> logits;
  std::mt19937_64 generator;

  // What the last call handed back (owned here, valid until the next call).
  std::vector<int32_t> ids_out;
  std::string text_out;
  std::vector<int32_t> generated;
  std::string generated_text;

  void LoadModel();
  void Reset();
  void CheckRoom(int64_t count) const;
  ffi::Any CreateKvCache(int64_t max_sequences, int64_t max_total_tokens) const;
  ffi::Any Forward(const ffi::Function& function, const ffi::Any& cache, const std::vector<int64_t>& seq_ids,
                   const int32_t* tokens, const std::vector<int64_t>& lengths);
  void ReadLogits(const ffi::Any& output, int64_t rows, std::vector<float>* out);
  const float* Prefill(const int32_t* ids, size_t count);
  const float* Decode(int32_t token_id);
};

namespace {

const DLDevice kCpu{kDLCPU, 0};

ffi::Function VmFunction(const ffi::Module& vm, const char* name) {
  auto function = vm->GetFunction(name, false);
  if (!function) Fail(MOBILEC_ERROR_ARTIFACT, std::string("the compiled model has no function ") + name);
  return *function;
}

// A tensor in this process's memory from TVM's allocator (aligned as the compiled kernels expect).
ffi::Tensor EmptyTensor(ffi::Shape shape, DLDataType dtype) {
  static const ffi::Function alloc = ffi::Function::GetGlobalRequired("runtime.TVMTensorAllocWithScope");
  return alloc(shape, dtype, kCpu, nullptr).cast<ffi::Tensor>();
}

// The weight shards, each opened once, closed at the end.
class ShardFiles {
 public:
  ~ShardFiles() {
    for (const auto& [path, fd] : descriptors_) close(fd);
  }
  int Open(const fs::path& path) {
    auto found = descriptors_.find(path.string());
    if (found != descriptors_.end()) return found->second;
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) Fail(MOBILEC_ERROR_ARTIFACT, "cannot read weight shard " + path.string() + ": " + std::strerror(errno));
    descriptors_.emplace(path.string(), fd);
    return fd;
  }

 private:
  std::unordered_map<std::string, int> descriptors_;
};

// The weights, in params/index.json's order (the order the compiled functions take them), each read from its
// shard straight into its tensor. What Python's Device.load_params gets from vm.builtin.tensor_cache.load and
// param_array_from_cache_by_name, without the tensor-cache.json those need written somewhere (an app may have no
// writable temporary directory), the whole-shard read buffer they use, or the global cache they fill.
ffi::Array<ffi::Tensor> LoadParams(const Artifact& artifact) {
  const fs::path index_path = artifact.root / kParamsIndex;
  ShardFiles shard_files;
  ffi::Array<ffi::Tensor> params;
  for (const ffi::Any& entry_any : Field(artifact.index, "tensors").as<json::Array>().value_or(json::Array())) {
    const json::Object entry = entry_any.as<json::Object>().value_or(json::Object());
    const std::string name = StringField(entry, "name");
    const std::string shard = StringField(entry, "shard");
    std::vector<int64_t> shape;
    for (const ffi::Any& dim : Field(entry, "shape").as<json::Array>().value_or(json::Array())) {
      shape.push_back(AsInt(dim).value_or(-1));
    }
    const int64_t offset = AsInt(Field(entry, "offset")).value_or(-1);
    const int64_t nbytes = AsInt(Field(entry, "nbytes")).value_or(-1);
    const DLDataType dtype = ffi::StringToDLDataType(StringField(entry, "dtype"));
    const int64_t elements = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
    const bool valid = !name.empty() && Inside(Field(entry, "shard")) && offset >= 0 &&
                       std::all_of(shape.begin(), shape.end(), [](int64_t dim) { return dim >= 0; }) &&
                       static_cast<int64_t>(ffi::GetDataSize(elements, dtype)) == nbytes;
    if (!valid) {
      Fail(MOBILEC_ERROR_ARTIFACT, index_path.string() + " has an invalid entry for tensor '" + name +
                                       "'; recompile the artifact");
    }
    const fs::path shard_path = artifact.root / kParamsDir / shard;
    const int fd = shard_files.Open(shard_path);
    ffi::Tensor tensor = EmptyTensor(ffi::Shape(shape), dtype);
    char* data = static_cast<char*>(tensor.data_ptr()) + tensor.byte_offset();
    for (int64_t done = 0; done < nbytes;) {
      const ssize_t got = pread(fd, data + done, nbytes - done, offset + done);
      if (got <= 0) {
        Fail(MOBILEC_ERROR_ARTIFACT, "weight shard " + shard_path.string() + " ends before tensor '" + name +
                                         "' (params/index.json says bytes " + std::to_string(offset) + " to " +
                                         std::to_string(offset + nbytes) + "); recompile the artifact");
      }
      done += got;
    }
    params.push_back(tensor);
  }
  return params;
}

}  // namespace

void mobilec_model::LoadModel() {
  std::optional<ffi::Module> library;
  try {
    library = ffi::Module::LoadFromFile(artifact.library.string());
  } catch (const ffi::Error& error) {
    Fail(MOBILEC_ERROR_ARTIFACT, "cannot load " + artifact.library.string() + ": " + FirstLine(error.message()) +
                                     "; recompile the artifact");
  }
  // tvm.runtime.vm.VirtualMachine(lib, tvm.cpu()): the executable, then one device with the pooled allocator.
  vm = VmFunction(*library, "vm_load_executable")().cast<ffi::Module>();
  VmFunction(*vm, "vm_initialization")(static_cast<int>(kDLCPU), 0, kPooledAllocator);
  params = LoadParams(artifact);
  embed = VmFunction(*vm, "embed");
  prefill_function = VmFunction(*vm, "prefill");
  decode_function = VmFunction(*vm, "decode");
  prefill_logits_function = VmFunction(*vm, "prefill_logits");
  create_kv_cache = VmFunction(*vm, "create_tir_paged_kv_cache");
  add_sequence = ffi::Function::GetGlobalRequired("vm.builtin.kv_state_add_sequence");
  remove_sequence = ffi::Function::GetGlobalRequired("vm.builtin.kv_state_remove_sequence");
  fork_sequence = ffi::Function::GetGlobalRequired("vm.builtin.kv_state_fork_sequence");
  available_pages = ffi::Function::GetGlobalRequired("vm.builtin.attention_kv_cache_get_num_available_pages");
  begin_forward = ffi::Function::GetGlobalRequired("vm.builtin.kv_state_begin_forward");
  end_forward = ffi::Function::GetGlobalRequired("vm.builtin.kv_state_end_forward");
  one_token = EmptyTensor(ffi::Shape({1}), DLDataType{kDLInt, 32, 1});
  auto model_config = ObjectField(ObjectField(artifact.config, "model").value_or(json::Object()), "config");
  vocab_size = static_cast<int32_t>(AsInt(Field(model_config.value_or(json::Object()), "vocab_size")).value_or(0));
  const json::Object call_sites = ObjectField(artifact.config, "call_sites").value_or(json::Object());
  const json::Object functions = ObjectField(call_sites, "functions").value_or(json::Object());
  const json::Array kernels = Field(call_sites, "kernels").as<json::Array>().value_or(json::Array());
  const bool integer_gemvs = std::any_of(kernels.begin(), kernels.end(), [](const ffi::Any& kernel) {
    return AsString(kernel).value_or("").rfind(kIntegerDotGemvPrefix, 0) == 0;
  });
  if (functions.count(ffi::String("batch_decode"))) {
    batch_function = VmFunction(*vm, "batch_decode");
  } else if (!integer_gemvs) {
    batch_function = prefill_logits_function;
  }
  Reset();
}

void mobilec_model::Reset() {
  kv_cache = CreateKvCache(1, artifact.context_window);
  add_sequence(kv_cache, static_cast<int64_t>(0));
  length = 0;
}

// LoadedArtifact.create_kv_cache: up to `max_sequences` forwarded together, `max_total_tokens` over all of them, the
// prefill chunk, the page size, no sliding window.
ffi::Any mobilec_model::CreateKvCache(int64_t max_sequences, int64_t max_total_tokens) const {
  return create_kv_cache(ffi::Shape({max_sequences}), ffi::Shape({max_total_tokens}),
                         ffi::Shape({artifact.prefill_chunk}), ffi::Shape({artifact.page_size}), ffi::Shape({0}));
}

// Session.check_room: the whole count asked for must fit (a long prompt is fed in chunks; not checked per chunk).
void mobilec_model::CheckRoom(int64_t count) const {
  if (length + count > artifact.context_window) {
    const std::string asked = length ? std::to_string(length) + " tokens in the sequence + " +
                                           std::to_string(count) + " more"
                                     : std::to_string(count) + " tokens";
    Fail(MOBILEC_ERROR_CONTEXT_FULL, asked + " exceed the artifact's context window of " +
                                         std::to_string(artifact.context_window) +
                                         "; shorten the input or recompile with a larger --context-window");
  }
}

// LoadedArtifact.forward: `function` on `tokens` for the sequences `seq_ids` of `cache`, each taking its `lengths`
// tokens in order.
ffi::Any mobilec_model::Forward(const ffi::Function& function, const ffi::Any& cache,
                                const std::vector<int64_t>& seq_ids, const int32_t* tokens,
                                const std::vector<int64_t>& lengths) {
  const int64_t count = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  ffi::Tensor input = count == 1 ? *one_token : EmptyTensor(ffi::Shape({count}), DLDataType{kDLInt, 32, 1});
  std::memcpy(input.data_ptr(), tokens, count * sizeof(int32_t));
  ffi::Any embedded = embed(input, params);
  begin_forward(cache, ffi::Shape(seq_ids), ffi::Shape(lengths));
  ffi::Any output = function(embedded, cache, params);
  end_forward(cache);
  return output;
}

// The logits of the last `rows` tokens (one row each): the first output of a model function, read on the host as
// float32 into *out.
void mobilec_model::ReadLogits(const ffi::Any& output, int64_t rows, std::vector<float>* out) {
  ffi::Tensor tensor = output.cast<ffi::Array<ffi::Any>>()[0].cast<ffi::Tensor>();
  const int64_t row = tensor.size(-1);
  const int64_t wanted = rows * row;
  const int64_t elements = tensor.numel();
  if (wanted > elements) {
    Fail(MOBILEC_ERROR_RUNTIME, "the model returned " + std::to_string(elements / row) + " logits rows, expected " +
                                    std::to_string(rows));
  }
  const char* base = static_cast<const char*>(tensor.data_ptr()) + tensor.byte_offset();
  std::vector<float>& logits = *out;
  logits.resize(wanted);
  vocab_size = static_cast<int32_t>(row);
  const DLDataType dtype = tensor.dtype();
  if (dtype.code == kDLFloat && dtype.bits == 32) {
    std::memcpy(logits.data(), reinterpret_cast<const float*>(base) + (elements - wanted), wanted * sizeof(float));
  } else if (dtype.code == kDLFloat && dtype.bits == 16) {
    const auto* half = reinterpret_cast<const uint16_t*>(base) + (elements - wanted);
    for (int64_t i = 0; i < wanted; ++i) {
      // IEEE half to float: sign, exponent rebias, mantissa; subnormals scaled, inf/NaN kept.
      const uint32_t sign = (half[i] & 0x8000u) << 16, exponent = (half[i] >> 10) & 0x1F, mantissa = half[i] & 0x3FF;
      float value;
      if (exponent == 0) {
        value = std::ldexp(static_cast<float>(mantissa), -24);
      } else if (exponent == 31) {
        value = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      } else {
        value = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
      }
      logits[i] = sign ? -value : value;
    }
  } else {
    Fail(MOBILEC_ERROR_RUNTIME, "the model's logits have dtype code " + std::to_string(dtype.code) + " bits " +
                                    std::to_string(dtype.bits) + "; the native runtime reads float32 and float16");
  }
}

const float* mobilec_model::Prefill(const int32_t* ids, size_t count) {
  CheckRoom(static_cast<int64_t>(count));
  ffi::Any output;
  for (size_t start = 0; start < count; start += artifact.prefill_chunk) {
    const int64_t chunk = std::min<int64_t>(artifact.prefill_chunk, static_cast<int64_t>(count - start));
    output = Forward(prefill_function, kv_cache, {0}, ids + start, {chunk});
    length += chunk;
  }
  ReadLogits(output, 1, &logits);
  return logits.data();
}

const float* mobilec_model::Decode(int32_t token_id) {
  CheckRoom(1);
  ReadLogits(Forward(decode_function, kv_cache, {0}, &token_id, {1}), 1, &logits);
  length += 1;
  return logits.data();
}

// ---------------------------------------------------------------------------------------------------------------
// The C API.

namespace {

void Require(bool condition, const char* message) {
  if (!condition) Fail(MOBILEC_ERROR_INVALID_ARGUMENT, message);
}

void CheckToken(const mobilec_model* model, int32_t token_id) {
  if (token_id < 0 || token_id >= model->vocab_size) {
    Fail(MOBILEC_ERROR_INVALID_ARGUMENT, "token id " + std::to_string(token_id) + " is outside the vocabulary (0 to " +
                                             std::to_string(model->vocab_size - 1) + ")");
  }
}

// generate.py check_fits: the prompt and every token asked for fit the context window together (the last token
// generated is not fed back, hence the - 1).
void CheckFits(int64_t prompt_tokens, int64_t new_tokens, int64_t context_window) {
  if (prompt_tokens == 0) Fail(MOBILEC_ERROR_INVALID_ARGUMENT, "the prompt is empty; pass a non-empty --prompt");
  const std::string window = std::to_string(context_window);
  if (prompt_tokens > context_window) {
    Fail(MOBILEC_ERROR_CONTEXT_FULL, "the prompt has " + std::to_string(prompt_tokens) +
                                         " tokens, more than the artifact's context window of " + window +
                                         "; shorten it or recompile with a larger --context-window");
  }
  if (prompt_tokens + new_tokens - 1 > context_window) {
    Fail(MOBILEC_ERROR_CONTEXT_FULL,
         "the prompt's " + std::to_string(prompt_tokens) + " tokens + --max-new-tokens " +
             std::to_string(new_tokens) + " exceed the artifact's context window of " + window +
             "; pass --max-new-tokens " + std::to_string(context_window - prompt_tokens + 1) +
             " or less, or recompile with a larger --context-window");
  }
}

// A number at the start of a /sys file; 0 where there is none.
long SysNumber(const std::string& path) {
  std::ifstream file(path);
  long value = 0;
  return file >> value ? value : 0;
}

// The CPUs this process may use in the order a pool takes them (as compiler/target/host.py pool_cpus): one per
// physical core first, the highest capacity (then maximum clock) first, then lower numbers; SMT siblings once every
// core has one. `cores`: how many physical cores they are (0 where Linux does not say which CPUs this process may use).
struct UsableCpus {
  std::vector<int> order;
  int cores = 0;
};

UsableCpus ReadUsableCpus() {
  cpu_set_t usable;
  UsableCpus cpus;
  if (sched_getaffinity(0, sizeof(usable), &usable) != 0) return cpus;
  struct Ranked {
    long capacity, clock;
    int cpu;
    std::string core;
  };
  std::vector<Ranked> ranked;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &usable)) continue;
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu);
    std::ifstream siblings(base + "/topology/thread_siblings_list");
    std::string core;
    if (!std::getline(siblings, core)) core = std::to_string(cpu);
    ranked.push_back({SysNumber(base + "/cpu_capacity"), SysNumber(base + "/cpufreq/cpuinfo_max_freq"), cpu, core});
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
    return a.capacity != b.capacity ? a.capacity > b.capacity : a.clock > b.clock;
  });
  std::vector<int> siblings;
  std::unordered_set<std::string> seen;
  for (const Ranked& r : ranked) (seen.insert(r.core).second ? cpus.order : siblings).push_back(r.cpu);
  cpus.cores = static_cast<int>(cpus.order.size());
  cpus.order.insert(cpus.order.end(), siblings.begin(), siblings.end());
  return cpus;
}

constexpr const char* kThreadsVariable = "TVM_NUM_THREADS";

// TVM sizes its pool once, when first asked, to TVM_NUM_THREADS (else OMP_NUM_THREADS, else half of an x86 machine's
// CPUs whether or not they are SMT siblings: 1 on a 2-core VM), and mobilec_set_threads cannot grow it past that
// (`mobilec-run --threads 2` ran on one thread there). Without either variable: one thread per physical core, set
// before the pool exists. The variable also spares TVM reading /sys/devices/system/cpu/online (glibc's CPU count) at
// every parallel kernel launch, ~185 times per SmolLM2 decode step.
void PinThreadCountVariable(const UsableCpus& cpus) {
  if (std::getenv(kThreadsVariable) != nullptr || std::getenv("OMP_NUM_THREADS") != nullptr) return;
  // where Linux does not say which CPUs this process may use: TVM's own count
  const int threads =
      cpus.cores > 0 ? cpus.cores : ffi::Function::GetGlobalRequired("runtime.NumThreads")().cast<int>();
  setenv(kThreadsVariable, std::to_string(threads).c_str(), 0);
}

// TVM's ThreadGroup::AffinityMode kSpecifyThreadShareAllCore: every thread of the pool may run on each given CPU.
constexpr int kShareAllCores = -3;

// As compiler/target/host.py set_threads: TVM pins each worker to a core of its own and lets the calling thread, which
// runs a launch's first share, roam over all of them, so that where Linux leaves it on a worker's core each launch
// runs its shares one after the other; the pool's threads share the pool's first `threads` CPUs instead
// (TVM_BIND_THREADS, where set, keeps TVM's placement). TVM also narrows the calling thread's cores; restored.
void SharePoolCores(int threads, const UsableCpus& usable) {
  const ffi::Function configure = ffi::Function::GetGlobalRequired("runtime.config_threadpool");
  if (std::getenv("TVM_BIND_THREADS") != nullptr || usable.order.empty()) {
    configure(0, threads);
    return;
  }
  ffi::Array<ffi::String> cpus;
  for (size_t i = 0; i < usable.order.size() && static_cast<int>(i) < threads; ++i) {
    cpus.push_back(std::to_string(usable.order[i]));
  }
  cpu_set_t mask;
  const bool saved = sched_getaffinity(0, sizeof(mask), &mask) == 0;
  configure(kShareAllCores, threads, cpus);
  if (saved) sched_setaffinity(0, sizeof(mask), &mask);
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A generation config's values (mobilec_generate's and mobilec_session_feed's checks).
void CheckConfig(const mobilec_generation_config& config) {
  if (config.max_new_tokens < 1) {
    Fail(MOBILEC_ERROR_INVALID_ARGUMENT,
         "--max-new-tokens must be at least 1, got " + std::to_string(config.max_new_tokens));
  }
  CheckSampling(config.temperature, config.top_p);
  if (!config.stop_ids && config.num_stop_ids != 0) Fail(MOBILEC_ERROR_INVALID_ARGUMENT, "stop_ids is NULL");
}

// One generation's tokens, as generate.py's loop makes them: each sampled from the logits after the previous one,
// until max_new_tokens, EOS or a stop id (unless ignore_eos), or the caller asks to stop.
class Generation {
 public:
  Generation(const mobilec_model& model, const mobilec_generation_config& config, std::mt19937_64* generator)
      : model_(&model), config_(config), generator_(generator) {
    if (!config.ignore_eos) {
      if (model.eos_token_id >= 0) stop_ids_.insert(model.eos_token_id);
      stop_ids_.insert(config.stop_ids, config.stop_ids + config.num_stop_ids);
    }
    config_.stop_ids = nullptr;  // the caller's array may not outlive this
    generator_->seed(config.seed);
  }

  // Sample the next token from `logits`; with `piece`, the text it completes: "" while the last character is
  // incomplete (as generate.py's stream waits while the text ends in U+FFFD), the whole character after it.
  int32_t Take(const float* logits, std::string* piece) {
    const int32_t token = Sample(logits, model_->vocab_size, config_.temperature, config_.top_p, *generator_);
    tokens_.push_back(token);
    if (piece != nullptr) {
      piece->clear();
      std::string text = model_->tokenizer->Decode(tokens_, true);
      if (!EndsInsideCharacter(text)) {
        text = LossyUtf8(text);
        if (text.size() > streamed_) *piece = text.substr(streamed_);
        streamed_ = text.size();
      }
    }
    return token;
  }

  void StopAfterThis() { stop_asked_ = true; }
  bool Done() const {
    return stop_asked_ || static_cast<int32_t>(tokens_.size()) >= config_.max_new_tokens ||
           stop_ids_.count(tokens_.back());
  }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  std::string Text() const { return LossyUtf8(model_->tokenizer->Decode(tokens_, true)); }
  int32_t max_new_tokens() const { return config_.max_new_tokens; }

 private:
  const mobilec_model* model_;
  mobilec_generation_config config_;
  std::mt19937_64* generator_;
  std::unordered_set<int32_t> stop_ids_;
  std::vector<int32_t> tokens_;
  size_t streamed_ = 0;  // bytes of the text already handed out
  bool stop_asked_ = false;
};

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// The engine: several sessions' sequences in one paged KV cache, stepped together (compiler/serve/engine.py Engine,
// same decisions: one prompt chunk per step, then one token for every generating sequence; prefix reuse by forking;
// least-recently-used eviction of cached sequences).

namespace {

struct Session {
  mobilec_session_state state = MOBILEC_SESSION_IDLE;
  int64_t seq_id = -1;              // its sequence in the cache while prefilling or generating
  int64_t fed_order = 0;            // which prefills first (the one fed first)
  std::vector<int32_t> prompt;
  std::vector<int32_t> kv_tokens;   // the tokens whose keys and values are in the cache
  std::vector<int32_t> pending;     // prompt tokens still to prefill
  int32_t reused = 0, prefilled = 0;
  std::mt19937_64 generator;
  std::optional<Generation> generation;
  std::chrono::steady_clock::time_point fed_at;
  double ttft_ms = std::nan("");
  std::string text;                 // mobilec_session_get_result's, owned here

  // Tokens in the cache when the generation ends at max_new_tokens (the last token is never fed back).
  int64_t FinalLength() const {
    return static_cast<int64_t>(prompt.size()) + generation->max_new_tokens() - 1;
  }
};

struct CachedSequence {
  int64_t seq_id;
  std::vector<int32_t> tokens;
};

}  // namespace

struct mobilec_engine {
  mobilec_model* model = nullptr;
  int32_t max_sessions = 0;
  ffi::Any kv_cache;
  int64_t next_seq_id = 0;
  int64_t next_fed_order = 0;
  std::vector<std::optional<Session>> sessions;  // by session id; empty: not open
  std::vector<CachedSequence> cached;            // least recently used first
  std::vector<float> logits;                     // a step's logits rows

  Session& Open(int32_t id);
  void Feed(Session& session, const int32_t* ids, size_t count, const mobilec_generation_config& config);
  bool Step(mobilec_session_callback callback, void* user_data);
  void End(Session& session, mobilec_session_state state);

 private:
  int64_t Pages(int64_t tokens) const { return (tokens + model->artifact.page_size - 1) / model->artifact.page_size; }
  int64_t FreePages() const;
  bool MakeRoom(int64_t need, int64_t keep);
  void Take(Session& session, int32_t id, const float* logits, mobilec_session_callback callback, void* user_data);
  template <typename Body>
  void EndOnFailure(const std::vector<int32_t>& ids, Body body);
};

namespace {

std::string SessionName(int32_t id) { return "session " + std::to_string(id); }

}  // namespace

Session& mobilec_engine::Open(int32_t id) {
  if (id < 0 || id >= max_sessions || !sessions[id]) {
    Fail(MOBILEC_ERROR_INVALID_ARGUMENT, SessionName(id) + " is not open in this engine (it holds sessions 0 to " +
                                             std::to_string(max_sessions - 1) + "); open one with "
                                             "mobilec_session_open");
  }
  return *sessions[id];
}

// Free pages beyond those the generating sequences may still claim before they end (engine.py _make_room's free).
int64_t mobilec_engine::FreePages() const {
  int64_t reserved = 0;
  for (const auto& session : sessions) {
    if (session && session->seq_id >= 0) {
      reserved += Pages(session->FinalLength()) - Pages(static_cast<int64_t>(session->kv_tokens.size()));
    }
  }
  return model->available_pages(kv_cache).cast<int64_t>() - reserved;
}

// Evict cached sequences, least recently used first (`keep` last), until `need` pages are free.
bool mobilec_engine::MakeRoom(int64_t need, int64_t keep) {
  std::stable_partition(cached.begin(), cached.end(), [&](const CachedSequence& c) { return c.seq_id != keep; });
  while (FreePages() < need && !cached.empty()) {
    model->remove_sequence(kv_cache, cached.front().seq_id);
    cached.erase(cached.begin());
  }
  return FreePages() >= need;
}

void mobilec_engine::Feed(Session& session, const int32_t* ids, size_t count,
                          const mobilec_generation_config& config) {
  std::vector<int32_t> prompt(ids, ids + count);
  // The cached sequence sharing the longest start with the prompt; at most all but the prompt's last token is
  // reused, since the first output token is sampled from the logits after it.
  int64_t parent = -1;
  size_t reused = 0;
  for (const CachedSequence& candidate : cached) {
    size_t n = 0;
    while (n < candidate.tokens.size() && n + 1 < prompt.size() && candidate.tokens[n] == prompt[n]) ++n;
    if (n > reused) parent = candidate.seq_id, reused = n;
  }
  const int64_t need = Pages(static_cast<int64_t>(count) + config.max_new_tokens - 1);
  // A fork shares the parent's whole pages (the cache copies only a partly filled last one).
  bool room = MakeRoom(need - static_cast<int64_t>(reused) / model->artifact.page_size, parent);
  const auto parent_entry = [&] {
    return std::find_if(cached.begin(), cached.end(), [&](const CachedSequence& c) { return c.seq_id == parent; });
  };
  if (room && parent >= 0 && parent_entry() == cached.end()) {  // evicted for room after all: nothing shared
    parent = -1;
    room = MakeRoom(need, -1);
  }
  if (!room) {
    Fail(MOBILEC_ERROR_BUSY, "the engine's KV cache has no room for " + std::to_string(count) + " prompt tokens + " +
                                 std::to_string(config.max_new_tokens) + " new ones while the other sessions "
                                 "generate; feed it again after one has finished");
  }
  const int64_t seq_id = next_seq_id++;
  if (parent >= 0) {
    model->fork_sequence(kv_cache, parent, seq_id, static_cast<int64_t>(reused));
    auto entry = parent_entry();
    std::rotate(entry, entry + 1, cached.end());  // most recently used
  } else {
    reused = 0;
    model->add_sequence(kv_cache, seq_id);
  }
  session = Session();
  session.state = MOBILEC_SESSION_PREFILLING;
  session.seq_id = seq_id;
  session.fed_order = next_fed_order++;
  session.prompt = std::move(prompt);
  session.kv_tokens.assign(session.prompt.begin(), session.prompt.begin() + reused);
  session.pending.assign(session.prompt.begin() + reused, session.prompt.end());
  session.reused = static_cast<int32_t>(reused);
  session.generation.emplace(*model, config, &session.generator);
  session.fed_at = std::chrono::steady_clock::now();
}

// Take the session's sequence out of the batch: a finished one stays as a cached prefix (dropping cached sequences
// it extends), any other is freed.
void mobilec_engine::End(Session& session, mobilec_session_state state) {
  session.state = state;
  if (session.seq_id < 0) return;
  const int64_t seq_id = std::exchange(session.seq_id, -1);
  if (state != MOBILEC_SESSION_FINISHED) {
    model->remove_sequence(kv_cache, seq_id);
    return;
  }
  for (auto it = cached.begin(); it != cached.end();) {
    const bool extended = it->tokens.size() <= session.kv_tokens.size() &&
                          std::equal(it->tokens.begin(), it->tokens.end(), session.kv_tokens.begin());
    if (extended) model->remove_sequence(kv_cache, it->seq_id);
    it = extended ? cached.erase(it) : it + 1;
  }
  cached.push_back({seq_id, session.kv_tokens});
}

// A model call that fails ends the sessions in it (engine.py _guarded), then the step reports the error.
template <typename Body>
void mobilec_engine::EndOnFailure(const std::vector<int32_t>& ids, Body body) {
  try {
    body();
  } catch (...) {
    for (int32_t id : ids) {
      try {
        End(*sessions[id], MOBILEC_SESSION_FAILED);
      } catch (...) {  // the cache may refuse after the failure: the session is failed either way
        sessions[id]->seq_id = -1;
      }
    }
    throw;
  }
}

void mobilec_engine::Take(Session& session, int32_t id, const float* logits, mobilec_session_callback callback,
                          void* user_data) {
  std::string piece;
  const int32_t token = session.generation->Take(logits, callback ? &piece : nullptr);
  if (session.generation->tokens().size() == 1) {
    session.ttft_ms = SecondsSince(session.fed_at) * 1e3;
    session.state = MOBILEC_SESSION_GENERATING;
  }
  if (callback && callback(user_data, id, token, piece.c_str(), piece.size()) != 0) {
    session.generation->StopAfterThis();
  }
  if (session.generation->Done()) End(session, MOBILEC_SESSION_FINISHED);
}

bool mobilec_engine::Step(mobilec_session_callback callback, void* user_data) {
  int32_t prefilling = -1;
  for (int32_t id = 0; id < max_sessions; ++id) {
    const auto& session = sessions[id];
    if (session && session->state == MOBILEC_SESSION_PREFILLING &&
        (prefilling < 0 || session->fed_order < sessions[prefilling]->fed_order)) {
      prefilling = id;
    }
  }
  if (prefilling >= 0) {
    Session& session = *sessions[prefilling];
    const int64_t chunk = std::min<int64_t>(model->artifact.prefill_chunk, session.pending.size());
    EndOnFailure({prefilling}, [&] {
      model->ReadLogits(model->Forward(model->prefill_function, kv_cache, {session.seq_id}, session.pending.data(),
                                       {chunk}), 1, &logits);
    });
    session.kv_tokens.insert(session.kv_tokens.end(), session.pending.begin(), session.pending.begin() + chunk);
    session.pending.erase(session.pending.begin(), session.pending.begin() + chunk);
    session.prefilled += static_cast<int32_t>(chunk);
    if (session.pending.empty()) Take(session, prefilling, logits.data(), callback, user_data);
  }
  // Every generating sequence feeds back its last token (the one just prefilled included, as engine.py does).
  std::vector<int32_t> decoding;
  for (int32_t id = 0; id < max_sessions; ++id) {
    if (sessions[id] && sessions[id]->state == MOBILEC_SESSION_GENERATING) decoding.push_back(id);
  }
  const auto last_token = [&](int32_t id) { return sessions[id]->generation->tokens().back(); };
  const auto fed_back = [&](int32_t id) { sessions[id]->kv_tokens.push_back(last_token(id)); };
  const int64_t vocab = model->vocab_size;
  if (decoding.size() > 1 && model->batch_function) {
    // One call over every sequence's last token, in begin_forward's order: the weights read once for all of them.
    std::vector<int64_t> seq_ids;
    std::vector<int32_t> tokens;
    for (int32_t id : decoding) seq_ids.push_back(sessions[id]->seq_id), tokens.push_back(last_token(id));
    EndOnFailure(decoding, [&] {
      model->ReadLogits(model->Forward(*model->batch_function, kv_cache, seq_ids, tokens.data(),
                                       std::vector<int64_t>(decoding.size(), 1)),
                        static_cast<int64_t>(decoding.size()), &logits);
    });
    for (size_t i = 0; i < decoding.size(); ++i) {
      fed_back(decoding[i]);
      Take(*sessions[decoding[i]], decoding[i], logits.data() + i * vocab, callback, user_data);
    }
  } else {
    for (int32_t id : decoding) {
      const int32_t token = last_token(id);
      EndOnFailure({id}, [&] {
        model->ReadLogits(model->Forward(model->decode_function, kv_cache, {sessions[id]->seq_id}, &token, {1}), 1,
                          &logits);
      });
      fed_back(id);
      Take(*sessions[id], id, logits.data(), callback, user_data);
    }
  }
  return std::any_of(sessions.begin(), sessions.end(), [](const std::optional<Session>& session) {
    return session && (session->state == MOBILEC_SESSION_PREFILLING || session->state == MOBILEC_SESSION_GENERATING);
  });
}

extern "C" {

const char* mobilec_last_error(void) { return last_error.c_str(); }

const char* mobilec_runtime_versions(void) {
  return "mobilec " MOBILEC_VERSION ", apache-tvm " MOBILEC_TVM_VERSION ", apache-tvm-ffi " MOBILEC_TVM_FFI_VERSION;
}

mobilec_status mobilec_open(const char* artifact_dir, mobilec_model** out_model) {
  return mobilec_open_verified(artifact_dir, MOBILEC_VERIFY_SHA256, out_model);
}

mobilec_status mobilec_open_verified(const char* artifact_dir, mobilec_verify verify, mobilec_model** out_model) {
  if (out_model != nullptr) *out_model = nullptr;
  return Guarded([&] {
    Require(artifact_dir != nullptr && out_model != nullptr, "mobilec_open: artifact_dir and out_model are required");
    if (verify != MOBILEC_VERIFY_SHA256 && verify != MOBILEC_VERIFY_SIZES) {
      Fail(MOBILEC_ERROR_INVALID_ARGUMENT, "mobilec_open_verified: verify must be MOBILEC_VERIFY_SHA256 or "
                                           "MOBILEC_VERIFY_SIZES, got " + std::to_string(static_cast<int>(verify)));
    }
    auto model = std::make_unique<mobilec_model>();
    model->artifact = LoadArtifact(artifact_dir, verify == MOBILEC_VERIFY_SIZES);
    CheckRunsHere(model->artifact);  // before loading: code this CPU cannot run would kill the process
    const fs::path tokenizer_dir = model->artifact.root / kTokenizerDir;
    std::string error;
    model->tokenizer = mobilec::BpeTokenizer::FromFile((tokenizer_dir / "tokenizer.json").string(), &error);
    if (!model->tokenizer) {
      Fail(MOBILEC_ERROR_ARTIFACT, "cannot load the tokenizer in " + tokenizer_dir.string() + ": " + error);
    }
    model->single_template = SingleTemplate(tokenizer_dir / "tokenizer.json");
    std::error_code missing;
    const json::Object tokenizer_config = fs::exists(tokenizer_dir / "tokenizer_config.json", missing)
                                              ? ReadJsonObject(tokenizer_dir / "tokenizer_config.json",
                                                               "tokenizer/tokenizer_config.json")
                                              : json::Object();
    const std::string eos = TokenContent(Field(tokenizer_config, "eos_token"));
    model->eos_token_id = eos.empty() ? -1 : model->tokenizer->TokenId(eos);
    model->chat_prompt = mobilec::ChatPrompt::FromConfig(model->artifact.config);
    const UsableCpus cpus = ReadUsableCpus();
    PinThreadCountVariable(cpus);
    SharePoolCores(ffi::Function::GetGlobalRequired("runtime.NumThreads")().cast<int>(), cpus);
    model->LoadModel();
    *out_model = model.release();
  });
}

void mobilec_close(mobilec_model* model) { delete model; }

mobilec_status mobilec_set_threads(mobilec_model* model, int32_t threads) {
  return Guarded([&] {
    Require(model != nullptr, "mobilec_set_threads: no model");
    if (threads < 1) {
      Fail(MOBILEC_ERROR_INVALID_ARGUMENT, "--threads must be at least 1, got " + std::to_string(threads));
    }
    // As compiler/target/host.py set_threads: the variable too (see PinThreadCountVariable)
    setenv(kThreadsVariable, std::to_string(threads).c_str(), 1);
    SharePoolCores(threads, ReadUsableCpus());
  });
}

int32_t mobilec_context_window(const mobilec_model* model) {
  return model ? static_cast<int32_t>(model->artifact.context_window) : 0;
}

int32_t mobilec_vocab_size(const mobilec_model* model) { return model ? model->vocab_size : 0; }

int32_t mobilec_eos_token_id(const mobilec_model* model) { return model ? model->eos_token_id : -1; }

int32_t mobilec_sequence_length(const mobilec_model* model) {
  return model ? static_cast<int32_t>(model->length) : 0;
}

mobilec_status mobilec_tokenize(mobilec_model* model, const char* text, int add_special_tokens,
                                const int32_t** out_ids, size_t* out_count) {
  return Guarded([&] {
    Require(model && text && out_ids && out_count, "mobilec_tokenize: model, text, out_ids and out_count are required");
    std::vector<int32_t> text_ids = model->tokenizer->Encode(text);
    model->ids_out.clear();
    if (add_special_tokens && !model->single_template.empty()) {
      for (const TemplatePiece& piece : model->single_template) {
        const auto& ids = piece.is_text ? text_ids : piece.special;
        model->ids_out.insert(model->ids_out.end(), ids.begin(), ids.end());
      }
    } else {
      model->ids_out = std::move(text_ids);
    }
    *out_ids = model->ids_out.data();
    *out_count = model->ids_out.size();
  });
}

mobilec_status mobilec_detokenize(mobilec_model* model, const int32_t* ids, size_t count, int skip_special_tokens,
                                  const char** out_text) {
  return Guarded([&] {
    Require(model && (ids || count == 0) && out_text, "mobilec_detokenize: model, ids and out_text are required");
    model->text_out = LossyUtf8(model->tokenizer->Decode(std::vector<int32_t>(ids, ids + count),
                                                         skip_special_tokens != 0));
    *out_text = model->text_out.c_str();
  });
}

mobilec_status mobilec_chat_prompt(mobilec_model* model, const char* user_message, const char** out_text) {
  return Guarded([&] {
    Require(model && user_message && out_text, "mobilec_chat_prompt: model, user_message and out_text are required");
    if (!model->chat_prompt.Unavailable().empty()) Fail(MOBILEC_ERROR_UNSUPPORTED, model->chat_prompt.Unavailable());
    model->text_out = model->chat_prompt.Render(user_message, std::time(nullptr));
    *out_text = model->text_out.c_str();
  });
}

mobilec_status mobilec_reset(mobilec_model* model) {
  return Guarded([&] {
    Require(model != nullptr, "mobilec_reset: no model");
    model->Reset();
  });
}

mobilec_status mobilec_prefill(mobilec_model* model, const int32_t* ids, size_t count, const float** out_logits) {
  return Guarded([&] {
    Require(model && ids && count > 0 && out_logits, "mobilec_prefill: model, ids (at least one) and out_logits are "
                                                     "required");
    for (size_t i = 0; i < count; ++i) CheckToken(model, ids[i]);
    *out_logits = model->Prefill(ids, count);
  });
}

mobilec_status mobilec_decode(mobilec_model* model, int32_t token_id, const float** out_logits) {
  return Guarded([&] {
    Require(model && out_logits, "mobilec_decode: model and out_logits are required");
    CheckToken(model, token_id);
    *out_logits = model->Decode(token_id);
  });
}

mobilec_status mobilec_seed(mobilec_model* model, uint64_t seed) {
  return Guarded([&] {
    Require(model != nullptr, "mobilec_seed: no model");
    model->generator.seed(seed);
  });
}

mobilec_status mobilec_sample(mobilec_model* model, const float* logits, double temperature, double top_p,
                              int32_t* out_token) {
  return Guarded([&] {
    Require(model && logits && out_token, "mobilec_sample: model, logits and out_token are required");
    CheckSampling(temperature, top_p);
    *out_token = Sample(logits, model->vocab_size, temperature, top_p, model->generator);
  });
}

void mobilec_generation_config_init(mobilec_generation_config* config) {
  if (config == nullptr) return;
  *config = mobilec_generation_config{};
  config->max_new_tokens = 64;
  config->temperature = 0.0;
  config->top_p = 1.0;
}

mobilec_status mobilec_generate(mobilec_model* model, const int32_t* prompt_ids, size_t prompt_count,
                                const mobilec_generation_config* config, mobilec_token_callback callback,
                                void* user_data, mobilec_result* out_result) {
  return Guarded([&] {
    Require(model && (prompt_ids || prompt_count == 0) && config && out_result,
            "mobilec_generate: model, prompt_ids, config and out_result are required");
    CheckConfig(*config);
    for (size_t i = 0; i < prompt_count; ++i) CheckToken(model, prompt_ids[i]);
    CheckFits(static_cast<int64_t>(prompt_count), config->max_new_tokens, model->artifact.context_window);
    Generation generation(*model, *config, &model->generator);
    model->Reset();
    std::string piece;
    const auto emit = [&](const float* logits) {
      const int32_t token = generation.Take(logits, callback ? &piece : nullptr);
      if (callback && callback(user_data, token, piece.c_str(), piece.size()) != 0) generation.StopAfterThis();
      return token;
    };
    const auto start = std::chrono::steady_clock::now();
    int32_t token = emit(model->Prefill(prompt_ids, prompt_count));
    const double ttft_s = SecondsSince(start);  // includes the callback's time, as it did
    const auto first_token_at = std::chrono::steady_clock::now();
    while (!generation.Done()) token = emit(model->Decode(token));
    const double decode_s = SecondsSince(first_token_at);
    model->generated = generation.tokens();
    const size_t decode_steps = model->generated.size() - 1;
    model->generated_text = generation.Text();
    *out_result = mobilec_result{};
    out_result->token_ids = model->generated.data();
    out_result->num_tokens = model->generated.size();
    out_result->text = model->generated_text.c_str();
    out_result->prompt_tokens = static_cast<int32_t>(prompt_count);
    out_result->ttft_ms = ttft_s * 1e3;
    out_result->prefill_tok_s = prompt_count / ttft_s;
    out_result->decode_tok_s = decode_steps ? decode_steps / decode_s : std::nan("");
  });
}

mobilec_status mobilec_engine_create(mobilec_model* model, int32_t max_sessions, mobilec_engine** out_engine) {
  if (out_engine != nullptr) *out_engine = nullptr;
  return Guarded([&] {
    Require(model && out_engine, "mobilec_engine_create: model and out_engine are required");
    if (max_sessions < 1 || max_sessions > MOBILEC_MAX_SESSIONS) {
      Fail(MOBILEC_ERROR_INVALID_ARGUMENT, "--max-sessions must be 1 to " + std::to_string(MOBILEC_MAX_SESSIONS) +
                                               ", got " + std::to_string(max_sessions));
    }
    auto engine = std::make_unique<mobilec_engine>();
    engine->model = model;
    engine->max_sessions = max_sessions;
    engine->sessions.resize(max_sessions);
    // Room for every session to fill the context window; cached prefixes live in what they leave free.
    engine->kv_cache = model->CreateKvCache(max_sessions, max_sessions * model->artifact.context_window);
    *out_engine = engine.release();
  });
}

int32_t mobilec_engine_batched_decode(const mobilec_engine* engine) {
  return engine && engine->model->batch_function ? 1 : 0;
}

void mobilec_engine_destroy(mobilec_engine* engine) { delete engine; }

mobilec_status mobilec_session_open(mobilec_engine* engine, int32_t* out_session) {
  return Guarded([&] {
    Require(engine && out_session, "mobilec_session_open: engine and out_session are required");
    auto free_slot = std::find_if(engine->sessions.begin(), engine->sessions.end(),
                                  [](const std::optional<Session>& session) { return !session; });
    if (free_slot == engine->sessions.end()) {
      Fail(MOBILEC_ERROR_BUSY, "all " + std::to_string(engine->max_sessions) + " sessions of the engine are open; "
                               "close one first, or create the engine with more (at most " +
                               std::to_string(MOBILEC_MAX_SESSIONS) + ")");
    }
    free_slot->emplace();
    *out_session = static_cast<int32_t>(free_slot - engine->sessions.begin());
  });
}

mobilec_status mobilec_session_close(mobilec_engine* engine, int32_t session) {
  return Guarded([&] {
    Require(engine != nullptr, "mobilec_session_close: no engine");
    Session& target = engine->Open(session);
    if (target.seq_id >= 0) engine->End(target, MOBILEC_SESSION_CANCELLED);
    engine->sessions[session].reset();
  });
}

mobilec_status mobilec_session_feed(mobilec_engine* engine, int32_t session, const int32_t* prompt_ids,
                                    size_t count, const mobilec_generation_config* config) {
  return Guarded([&] {
    Require(engine && (prompt_ids || count == 0) && config,
            "mobilec_session_feed: engine, prompt_ids and config are required");
    Session& target = engine->Open(session);
    if (target.seq_id >= 0) {
      Fail(MOBILEC_ERROR_INVALID_ARGUMENT, SessionName(session) + " is still generating; feed it after it has "
                                           "finished, or cancel it first");
    }
    CheckConfig(*config);
    for (size_t i = 0; i < count; ++i) CheckToken(engine->model, prompt_ids[i]);
    CheckFits(static_cast<int64_t>(count), config->max_new_tokens, engine->model->artifact.context_window);
    engine->Feed(target, prompt_ids, count, *config);
  });
}

mobilec_status mobilec_session_cancel(mobilec_engine* engine, int32_t session) {
  return Guarded([&] {
    Require(engine != nullptr, "mobilec_session_cancel: no engine");
    Session& target = engine->Open(session);
    if (target.seq_id >= 0) engine->End(target, MOBILEC_SESSION_CANCELLED);
  });
}

mobilec_status mobilec_engine_step(mobilec_engine* engine, mobilec_session_callback callback, void* user_data,
                                   int32_t* out_busy) {
  return Guarded([&] {
    Require(engine != nullptr, "mobilec_engine_step: no engine");
    const bool busy = engine->Step(callback, user_data);
    if (out_busy != nullptr) *out_busy = busy;
  });
}

mobilec_status mobilec_session_get_result(mobilec_engine* engine, int32_t session,
                                          mobilec_session_result* out_result) {
  return Guarded([&] {
    Require(engine && out_result, "mobilec_session_get_result: engine and out_result are required");
    Session& target = engine->Open(session);
    *out_result = mobilec_session_result{};
    out_result->state = target.state;
    out_result->prompt_tokens = static_cast<int32_t>(target.prompt.size());
    out_result->reused_tokens = target.reused;
    out_result->prefilled_tokens = target.prefilled;
    out_result->ttft_ms = target.ttft_ms;
    if (target.generation) {
      target.text = target.generation->Text();
      out_result->token_ids = target.generation->tokens().data();
      out_result->num_tokens = target.generation->tokens().size();
    } else {
      target.text.clear();
    }
    out_result->text = target.text.c_str();
  });
}

}  // extern "C"
