// mobilec-run: `mobilec generate` without Python, on the C API of mobilec.h. Same options, the same JSON with
// --json, one line `mobilec-run: error: ...` on stderr and exit code 2 for bad options and bad artifacts.
#include <sched.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mobilec.h"

namespace {

constexpr const char* kUsage =
    "usage: mobilec-run ARTIFACT (--prompt TEXT | --prompt-ids IDS) [options]\n"
    "\n"
    "Load ARTIFACT (the directory `mobilec compile` wrote) and generate text from --prompt, streaming it as it\n"
    "comes, as `mobilec generate` does, without Python.\n"
    "\n"
    "options:\n"
    "  --prompt TEXT          the prompt text (this or --prompt-ids is required); with --parallel N, give it once\n"
    "                         (run N times) or N times (one per session)\n"
    "  --prompt-ids IDS       the prompt as token ids, comma-separated, fed as they are (no BOS added): to\n"
    "                         replay `mobilec bench`'s prompts or compare with another runtime token for token\n"
    "  --max-new-tokens N     tokens to generate at most [default: 64]\n"
    "  --temperature T        0 means greedy [default: 0]\n"
    "  --top-p P              nucleus sampling mass, with --temperature [default: 1]\n"
    "  --seed S               the sampling seed [default: 0]\n"
    "  --chat                 wrap the prompt in the model's chat template, as `mobilec generate --chat` does\n"
    "  --ignore-eos           keep generating past end-of-sequence (for benchmarks)\n"
    "  --threads N            CPU threads [default: TVM_NUM_THREADS or one per core]\n"
    "  --verify sha256|sizes  check every artifact file's sha256 before loading, or only its size (faster start\n"
    "                         once the files were checked after copying them) [default: sha256]\n"
    "  --parallel N           run N prompts (1 to 8) as N sessions of one engine, decoded together; prints each\n"
    "                         session's text and the aggregate decode tok/s (not streamed)\n"
    "  --json                 print the text, tokens and timings as `mobilec generate --json` does (not streamed);\n"
    "                         with --parallel, {\"sessions\": [...], \"decode_tok_s\": ..., \"batched_decode\": ...,\n"
    "                         \"peak_rss_mb\": ...}\n"
    "  -h, --help             show this and exit\n"
    "\n"
    "Errors: one line on stderr and exit code 2 (bad option, bad artifact, a CPU that cannot run it, a prompt\n"
    "longer than the context window); 1 when the runtime fails while running the model.\n";

constexpr int64_t kMaxTokens = int64_t{1} << 20;  // compiler/validate.py MAX_CONTEXT
constexpr const char* kThreadsVariable = "TVM_NUM_THREADS";

struct UsageError {
  std::string message;
};

[[noreturn]] void Usage(const std::string& message) { throw UsageError{message}; }

// A float as Python's repr writes it (the shortest text that reads back the same, "2.0" not "2"), so that
// messages and --json read as `mobilec generate`'s.
std::string PythonFloat(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  char text[40];
  int digits = 1;  // the fewest significant digits that read back as the same double
  for (; digits < 17; ++digits) {
    std::snprintf(text, sizeof(text), "%.*e", digits - 1, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  std::snprintf(text, sizeof(text), "%.*e", digits - 1, value);
  const int exponent = std::atoi(std::strchr(text, 'e') + 1);
  if (exponent < -4 || exponent >= 16) return text;  // Python's repr switches to 1e+16 / 1e-05 there too
  std::snprintf(text, sizeof(text), "%.*f", std::max(digits - 1 - exponent, 0), value);
  std::string fixed = text;
  return fixed.find('.') == std::string::npos ? fixed + ".0" : fixed;
}

// A figure in --json: null where it does not exist (NaN: a rate over no steps), as `mobilec generate --json` writes
// it; strict JSON parsers reject NaN and Infinity.
std::string JsonNumber(double value) { return std::isfinite(value) ? PythonFloat(value) : "null"; }

std::string Quoted(const std::string& text) { return "'" + text + "'"; }

int64_t WholeNumber(const std::string& option, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);  // NOLINT(runtime/int)
  if (text.empty() || *end != '\0' || errno == ERANGE) {
    Usage(option + " must be a whole number, got " + Quoted(text));
  }
  return value;
}

// "1,2,3": token ids, each a whole number from 0 (the vocabulary's bound is checked once the artifact is open).
std::vector<int32_t> TokenIds(const std::string& option, const std::string& text) {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const int64_t id = WholeNumber(option, text.substr(start, comma - start));
    if (id < 0 || id > INT32_MAX) Usage(option + " holds " + std::to_string(id) + ", not a token id");
    ids.push_back(static_cast<int32_t>(id));
    start = comma + 1;
  }
  return ids;
}

double Number(const std::string& option, const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') Usage(option + " must be a number, got " + Quoted(text));
  return value;
}

int UsableCores() {
  cpu_set_t cores;
  if (sched_getaffinity(0, sizeof(cores), &cores) == 0) return CPU_COUNT(&cores);
  return 1;
}

bool ValidUtf8(const std::string& text) {
  for (size_t at = 0; at < text.size();) {
    const auto lead = static_cast<unsigned char>(text[at]);
    const size_t length = lead < 0x80 ? 1 : (lead >> 5) == 6 ? 2 : (lead >> 4) == 14 ? 3 : (lead >> 3) == 30 ? 4 : 0;
    if (length == 0 || at + length > text.size()) return false;
    for (size_t i = 1; i < length; ++i) {
      if ((static_cast<unsigned char>(text[at + i]) & 0xC0) != 0x80) return false;
    }
    at += length;
  }
  return true;
}

struct Options {
  std::string artifact;
  std::vector<std::string> prompts;  // --prompt, once or (with --parallel) once per session
  bool has_prompt = false;
  std::vector<int32_t> prompt_ids;
  bool has_prompt_ids = false;
  int64_t max_new_tokens = 64;
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t seed = 0;
  bool chat = false;
  bool ignore_eos = false;
  int64_t threads = 0;  // 0: TVM_NUM_THREADS or TVM's default
  mobilec_verify verify = MOBILEC_VERIFY_SHA256;
  int64_t parallel = 0;  // 0: one sequence through mobilec_generate
  bool json = false;
  bool help = false;
};

// The options, each checked as compiler/validate.py checks `mobilec generate`'s (same messages).
Options ParseOptions(int argc, char** argv) {
  Options options;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      options.help = true;
      return options;
    }
    if (arg.rfind("--", 0) != 0 || arg == "--") {
      positional.push_back(arg);
      continue;
    }
    std::string value;
    bool inline_value = false;
    if (const size_t equals = arg.find('='); equals != std::string::npos) {
      value = arg.substr(equals + 1);
      arg = arg.substr(0, equals);
      inline_value = true;
    }
    const auto flag = [&](bool* target) {
      if (inline_value) Usage("option " + arg + " does not take a value");
      *target = true;
    };
    const auto take_value = [&]() {
      if (inline_value) return value;
      if (i + 1 >= argc) Usage("option " + arg + " requires a value");
      return std::string(argv[++i]);
    };
    if (arg == "--chat") {
      flag(&options.chat);
    } else if (arg == "--ignore-eos") {
      flag(&options.ignore_eos);
    } else if (arg == "--json") {
      flag(&options.json);
    } else if (arg == "--prompt") {
      options.prompts.push_back(take_value());
      options.has_prompt = true;
    } else if (arg == "--prompt-ids") {
      options.prompt_ids = TokenIds(arg, take_value());
      options.has_prompt_ids = true;
    } else if (arg == "--max-new-tokens") {
      options.max_new_tokens = WholeNumber(arg, take_value());
    } else if (arg == "--temperature") {
      options.temperature = Number(arg, take_value());
    } else if (arg == "--top-p") {
      options.top_p = Number(arg, take_value());
    } else if (arg == "--seed") {
      options.seed = WholeNumber(arg, take_value());
    } else if (arg == "--verify") {
      const std::string mode = take_value();
      if (mode != "sha256" && mode != "sizes") Usage("--verify must be sha256 or sizes, got '" + mode + "'");
      options.verify = mode == "sizes" ? MOBILEC_VERIFY_SIZES : MOBILEC_VERIFY_SHA256;
    } else if (arg == "--parallel") {
      options.parallel = WholeNumber(arg, take_value());
      if (options.parallel < 1 || options.parallel > MOBILEC_MAX_SESSIONS) {
        Usage("--parallel must be 1 to " + std::to_string(MOBILEC_MAX_SESSIONS) + ", got " +
              std::to_string(options.parallel));
      }
    } else if (arg == "--threads") {
      options.threads = WholeNumber(arg, take_value());
      if (options.threads < 1) Usage("--threads must be at least 1, got " + std::to_string(options.threads));
    } else {
      Usage("no such option: " + arg + " (see mobilec-run --help)");
    }
  }
  if (positional.empty()) Usage("missing ARTIFACT, the directory `mobilec compile` wrote (see mobilec-run --help)");
  if (positional.size() > 1) Usage("got more than one ARTIFACT: " + positional[0] + ", " + positional[1]);
  options.artifact = positional[0];
  if (options.has_prompt == options.has_prompt_ids) {
    Usage(options.has_prompt ? "pass --prompt or --prompt-ids, not both"
                             : "missing option --prompt or --prompt-ids (see mobilec-run --help)");
  }
  if (options.has_prompt_ids && options.chat) Usage("--chat renders a --prompt text; --prompt-ids are fed as they are");
  const size_t prompts = options.prompts.size();
  if (prompts > 1 && options.parallel == 0) {
    Usage("--prompt is given " + std::to_string(prompts) + " times; pass --parallel " + std::to_string(prompts) +
          " to run them together, or one --prompt");
  }
  if (prompts > 1 && static_cast<int64_t>(prompts) != options.parallel) {
    Usage("--parallel " + std::to_string(options.parallel) + " runs " + std::to_string(options.parallel) +
          " prompts, got " + std::to_string(prompts) + " --prompt values; pass one (run " +
          std::to_string(options.parallel) + " times) or " + std::to_string(options.parallel));
  }

  const int cores = UsableCores();
  const std::string cores_unit = " (the cores this machine lets this process use)";
  if (options.threads > cores) {
    Usage("--threads must be at most " + std::to_string(cores) + cores_unit + ", got " +
          std::to_string(options.threads));
  }
  if (const char* env = std::getenv(kThreadsVariable); options.threads == 0 && env && *env) {
    char* end = nullptr;
    const long long value = std::strtoll(env, &end, 10);  // NOLINT(runtime/int)
    if (*end != '\0' || value < 1 || value > cores) {
      Usage(std::string(kThreadsVariable) + "=" + Quoted(env) + " is not a thread count from 1 to " +
            std::to_string(cores) + cores_unit + "; fix or unset it, or pass --threads");
    }
  }
  for (const std::string& prompt : options.prompts) {
    if (!ValidUtf8(prompt)) Usage("--prompt is not valid UTF-8; pass UTF-8 text");
    if (prompt.find_first_not_of(" \t\n\r\f\v") == std::string::npos) Usage("--prompt is empty; pass some text");
  }
  if (options.max_new_tokens < 1) {
    Usage("--max-new-tokens must be at least 1, got " + std::to_string(options.max_new_tokens));
  }
  if (options.max_new_tokens > kMaxTokens) {
    Usage("--max-new-tokens must be at most " + std::to_string(kMaxTokens) + " tokens, got " +
          std::to_string(options.max_new_tokens));
  }
  if (!(options.temperature >= 0 && std::isfinite(options.temperature))) {
    Usage("--temperature must be 0 (greedy) or a positive number, got " + PythonFloat(options.temperature));
  }
  if (!(options.top_p > 0 && options.top_p <= 1)) {
    Usage("--top-p must be above 0 and at most 1, got " + PythonFloat(options.top_p));
  }
  if (options.seed < 0) Usage("--seed must be at least 0, got " + std::to_string(options.seed));
  return options;
}

// JSON text as Python's json.dumps writes it (ASCII only: \uXXXX escapes, surrogate pairs past U+FFFF).
std::string JsonString(const std::string& text) {
  std::string out = "\"";
  char escape[16];
  for (size_t at = 0; at < text.size();) {
    const auto lead = static_cast<unsigned char>(text[at]);
    uint32_t code = lead;
    size_t length = 1;
    if (lead >= 0xF0) {
      code = lead & 0x07, length = 4;
    } else if (lead >= 0xE0) {
      code = lead & 0x0F, length = 3;
    } else if (lead >= 0xC0) {
      code = lead & 0x1F, length = 2;
    }
    for (size_t i = 1; i < length && at + i < text.size(); ++i) code = (code << 6) | (text[at + i] & 0x3F);
    at += length;
    switch (code) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (code >= 0x20 && code < 0x7F) {
      out += static_cast<char>(code);
    } else if (code >= 0x10000) {
      code -= 0x10000;
      std::snprintf(escape, sizeof(escape), "\\u%04x\\u%04x", 0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF));
      out += escape;
    } else {
      std::snprintf(escape, sizeof(escape), "\\u%04x", code);
      out += escape;
    }
  }
  return out + "\"";
}

double PeakRssMb() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // kilobytes on Linux, as Python's resource module reports them
}

int StreamPiece(void*, int32_t, const char* text, size_t length) {
  std::fwrite(text, 1, length, stdout);
  std::fflush(stdout);
  return 0;
}

// The exit code for a failed call: 1 when the runtime failed while running, 2 for what the user can fix.
int ExitCode(mobilec_status status) { return status == MOBILEC_ERROR_RUNTIME ? 1 : 2; }

int Fail(mobilec_status status) {
  std::fprintf(stderr, "mobilec-run: error: %s\n", mobilec_last_error());
  return ExitCode(status);
}

// The prompt's token ids: --prompt-ids as they are, or the text (rendered with the chat template for --chat)
// tokenized. On failure, the exit code (the error printed).
int PromptTokens(mobilec_model* model, const Options& options, const std::string& text,
                 std::vector<int32_t>* out_tokens) {
  if (options.has_prompt_ids) {
    const int32_t vocab = mobilec_vocab_size(model);
    for (const int32_t id : options.prompt_ids) {
      if (id >= vocab) {
        std::fprintf(stderr, "mobilec-run: error: --prompt-ids holds %d; the model's vocabulary has ids 0 to %d\n", id,
                     vocab - 1);
        return 2;
      }
    }
    *out_tokens = options.prompt_ids;
    return 0;
  }
  const char* prompt = text.c_str();
  mobilec_status status;
  if (options.chat && (status = mobilec_chat_prompt(model, prompt, &prompt))) return Fail(status);
  const int32_t* prompt_ids = nullptr;
  size_t prompt_count = 0;
  // A rendered chat prompt has its special tokens written out, as transformers' encode(add_special_tokens=False).
  if ((status = mobilec_tokenize(model, prompt, options.chat ? 0 : 1, &prompt_ids, &prompt_count))) {
    return Fail(status);
  }
  out_tokens->assign(prompt_ids, prompt_ids + prompt_count);  // the ids belong to the handle until its next call
  return 0;
}

mobilec_generation_config GenerationConfig(const Options& options) {
  mobilec_generation_config config;
  mobilec_generation_config_init(&config);
  config.max_new_tokens = static_cast<int32_t>(options.max_new_tokens);
  config.temperature = options.temperature;
  config.top_p = options.top_p;
  config.seed = static_cast<uint64_t>(options.seed);
  config.ignore_eos = options.ignore_eos;
  return config;
}

std::string IdList(const int32_t* ids, size_t count) {
  std::string list;
  for (size_t i = 0; i < count; ++i) list += (i ? ", " : "") + std::to_string(ids[i]);
  return list;
}

int Generate(mobilec_model* model, const Options& options) {
  std::vector<int32_t> prompt_tokens;
  const std::string text = options.prompts.empty() ? "" : options.prompts[0];
  if (const int code = PromptTokens(model, options, text, &prompt_tokens)) return code;
  const mobilec_generation_config config = GenerationConfig(options);
  mobilec_result result;
  const mobilec_status status = mobilec_generate(model, prompt_tokens.data(), prompt_tokens.size(), &config,
                                                 options.json ? nullptr : StreamPiece, nullptr, &result);
  if (status != MOBILEC_OK) {
    if (!options.json) std::printf("\n");  // end the streamed text's line before the error
    return Fail(status);
  }
  const double peak_rss_mb = PeakRssMb();
  if (options.json) {
    std::printf("{\"text\": %s, \"token_ids\": [%s], \"prompt_tokens\": %d, \"ttft_ms\": %s, \"prefill_tok_s\": %s, "
                "\"decode_tok_s\": %s, \"peak_rss_mb\": %s}\n",
                JsonString(result.text).c_str(), IdList(result.token_ids, result.num_tokens).c_str(),
                result.prompt_tokens, JsonNumber(result.ttft_ms).c_str(), JsonNumber(result.prefill_tok_s).c_str(),
                JsonNumber(result.decode_tok_s).c_str(), JsonNumber(peak_rss_mb).c_str());
  } else {
    char decode[40] = "n/a (one token)";  // as `mobilec generate` prints it
    if (std::isfinite(result.decode_tok_s)) std::snprintf(decode, sizeof(decode), "%.1f tok/s", result.decode_tok_s);
    std::printf("\n\n[%d prompt tokens, %zu generated] TTFT %.1f ms | prefill %.1f tok/s | decode %s | "
                "peak RSS %.0f MB\n",
                result.prompt_tokens, result.num_tokens, result.ttft_ms, result.prefill_tok_s, decode, peak_rss_mb);
  }
  return 0;
}

// When the sessions' tokens came: the aggregate decode rate counts every token after a session's first, over the
// time from the first session's first token to the last token of all.
struct TokenClock {
  std::vector<bool> started;
  std::chrono::steady_clock::time_point first, last;
  bool any = false;
  size_t decode_tokens = 0;
};

int CountToken(void* user_data, int32_t session, int32_t, const char*, size_t) {
  auto& clock = *static_cast<TokenClock*>(user_data);
  clock.last = std::chrono::steady_clock::now();
  if (!clock.any) clock.first = clock.last, clock.any = true;
  if (clock.started[session]) ++clock.decode_tokens;
  clock.started[session] = true;
  return 0;
}

// --parallel N: N sessions of one engine, fed at once and stepped together until all are done.
int GenerateParallel(mobilec_model* model, const Options& options) {
  const int32_t sessions = static_cast<int32_t>(options.parallel);
  mobilec_engine* engine = nullptr;
  mobilec_status status = mobilec_engine_create(model, sessions, &engine);
  if (status != MOBILEC_OK) return Fail(status);
  struct Destroyer {
    mobilec_engine* engine;
    ~Destroyer() { mobilec_engine_destroy(engine); }
  } destroyer{engine};
  const mobilec_generation_config config = GenerationConfig(options);
  std::vector<int32_t> ids(sessions);
  for (int32_t i = 0; i < sessions; ++i) {
    std::vector<int32_t> prompt_tokens;
    const std::string text = options.prompts.empty() ? "" : options.prompts[options.prompts.size() > 1 ? i : 0];
    if (const int code = PromptTokens(model, options, text, &prompt_tokens)) return code;
    if ((status = mobilec_session_open(engine, &ids[i])) ||
        (status = mobilec_session_feed(engine, ids[i], prompt_tokens.data(), prompt_tokens.size(), &config))) {
      return Fail(status);
    }
  }
  TokenClock clock;
  clock.started.assign(sessions, false);
  for (int32_t busy = 1; busy;) {
    if ((status = mobilec_engine_step(engine, CountToken, &clock, &busy))) return Fail(status);
  }
  const double decode_s = std::chrono::duration<double>(clock.last - clock.first).count();
  const double decode_tok_s = clock.decode_tokens ? clock.decode_tokens / decode_s : std::nan("");
  const double peak_rss_mb = PeakRssMb();
  const bool batched = mobilec_engine_batched_decode(engine) != 0;
  std::string entries;
  size_t prompt_total = 0, generated_total = 0;
  for (int32_t i = 0; i < sessions; ++i) {
    mobilec_session_result result;
    if ((status = mobilec_session_get_result(engine, ids[i], &result))) return Fail(status);
    prompt_total += result.prompt_tokens;
    generated_total += result.num_tokens;
    if (options.json) {
      entries += std::string(i ? ", " : "") + "{\"text\": " + JsonString(result.text) + ", \"token_ids\": [" +
                 IdList(result.token_ids, result.num_tokens) + "], \"prompt_tokens\": " +
                 std::to_string(result.prompt_tokens) + ", \"prefilled_tokens\": " +
                 std::to_string(result.prefilled_tokens) + ", \"ttft_ms\": " + JsonNumber(result.ttft_ms) + "}";
    } else {
      std::printf("[session %d] %s\n", i, result.text);
    }
  }
  if (options.json) {
    std::printf("{\"sessions\": [%s], \"decode_tok_s\": %s, \"batched_decode\": %s, \"peak_rss_mb\": %s}\n",
                entries.c_str(), JsonNumber(decode_tok_s).c_str(), batched ? "true" : "false",
                JsonNumber(peak_rss_mb).c_str());
  } else {
    std::printf("\n[%d sessions, %zu prompt tokens, %zu generated] aggregate decode %.1f tok/s (%s) | peak RSS %.0f "
                "MB\n", sessions, prompt_total, generated_total, decode_tok_s,
                batched ? "one model call per step" : "one model call per session", peak_rss_mb);
  }
  return 0;
}

int Run(const Options& options) {
  mobilec_model* model = nullptr;
  mobilec_status status = mobilec_open_verified(options.artifact.c_str(), options.verify, &model);
  if (status != MOBILEC_OK) return Fail(status);
  struct Closer {
    mobilec_model* model;
    ~Closer() { mobilec_close(model); }
  } closer{model};

  if (options.threads > 0 && (status = mobilec_set_threads(model, static_cast<int32_t>(options.threads)))) {
    return Fail(status);
  }
  return options.parallel ? GenerateParallel(model, options) : Generate(model, options);
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = ParseOptions(argc, argv);
  } catch (const UsageError& error) {
    std::fprintf(stderr, "mobilec-run: error: %s\n", error.message.c_str());
    return 2;
  }
  if (options.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  return Run(options);
}
