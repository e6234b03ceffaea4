/* mobilec.h: run a mobilec artifact (the directory `mobilec compile` writes) without Python.
 *
 * An app opens the artifact once, then tokenizes, generates and detokenizes on the handle:
 *
 *   mobilec_model* model;
 *   if (mobilec_open("smol-q4", &model) != MOBILEC_OK) { fprintf(stderr, "%s\n", mobilec_last_error()); ... }
 *   const int32_t* prompt; size_t prompt_len;
 *   mobilec_tokenize(model, "The capital of France is", 1, &prompt, &prompt_len);
 *   mobilec_generation_config config;
 *   mobilec_generation_config_init(&config);
 *   config.max_new_tokens = 32;
 *   mobilec_result result;
 *   mobilec_generate(model, prompt, prompt_len, &config, on_token, user_data, &result);
 *   mobilec_close(model);
 *
 * Opening checks the artifact as `mobilec generate` does, before anything is loaded: its format version, the
 * mobilec / TVM / tvm-ffi versions it was built with against those this runtime was built with, every file its
 * config lists (sizes and sha256), and that this CPU has the architecture and every instruction-set feature the
 * compiled code needs (an artifact needing, say, avx512f is refused naming it, instead of dying on SIGILL).
 *
 * Errors: every function returns a mobilec_status; on anything but MOBILEC_OK, mobilec_last_error() holds one
 * line naming the problem (per thread, until the next failing call on that thread). Nothing aborts the process.
 *
 * Threads: a handle is not thread-safe; use one handle per thread, or lock around calls. Pointers a call hands
 * back (token ids, text, logits, results) belong to the handle and stay valid until the next call on it.
 *
 * Chat: mobilec_chat_prompt renders one user message as the model's chat template does, whatever its family
 * (ChatML, Llama 3, Gemma, Phi-3, Mistral...): the compiler renders the template around a placeholder message and
 * stores the text before and after it in the artifact (compiler/chat_prompt.py), with the dates the template asks
 * for (Llama 3.2) written at call time. A template whose text around the message depends on the message is
 * refused with MOBILEC_ERROR_UNSUPPORTED: the caller renders such prompts itself and tokenizes them with
 * add_special_tokens = 0.
 */
#ifndef MOBILEC_H_
#define MOBILEC_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define MOBILEC_API __declspec(dllexport)
#else
#define MOBILEC_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MOBILEC_OK = 0,
  MOBILEC_ERROR_INVALID_ARGUMENT = 1, /* a bad value passed to a function (a null handle, top_p 2, ...) */
  MOBILEC_ERROR_ARTIFACT = 2,         /* the artifact is missing, corrupt, or built by other versions */
  MOBILEC_ERROR_UNSUPPORTED_CPU = 3,  /* this CPU cannot run the artifact's code (architecture, feature) */
  MOBILEC_ERROR_CONTEXT_FULL = 4,     /* the tokens do not fit the artifact's context window */
  MOBILEC_ERROR_UNSUPPORTED = 5,      /* something this runtime does not do (a non-ChatML chat template) */
  MOBILEC_ERROR_RUNTIME = 6           /* TVM failed while loading or running the model */
} mobilec_status;

typedef struct mobilec_model mobilec_model; /* an opened artifact: library, weights, KV cache, tokenizer */

/* The last error of this thread, one line; "" when none. */
MOBILEC_API const char* mobilec_last_error(void);

/* The versions this runtime was built with and checks artifacts against: "mobilec X, apache-tvm Y, ...". */
MOBILEC_API const char* mobilec_runtime_versions(void);

/* Open the artifact directory `artifact_dir` (check it, load its library, weights and tokenizer, create the KV
 * cache for one sequence). On failure *out_model is NULL. Every file's size and sha256 are checked first, as
 * `mobilec generate` checks them. */
MOBILEC_API mobilec_status mobilec_open(const char* artifact_dir, mobilec_model** out_model);

/* How mobilec_open_verified checks the artifact's files before loading them. */
typedef enum mobilec_verify {
  MOBILEC_VERIFY_SHA256 = 0, /* every file's size and sha256 (what mobilec_open does): a changed byte is refused */
  MOBILEC_VERIFY_SIZES = 1   /* sizes only (a truncated file is still refused): for an app that checked the
                              * sha256s once after copying the files, to start faster at every later launch */
} mobilec_verify;

/* mobilec_open with the file check `verify`. */
MOBILEC_API mobilec_status mobilec_open_verified(const char* artifact_dir, mobilec_verify verify,
                                                 mobilec_model** out_model);

/* Free everything the handle holds; NULL is ignored. */
MOBILEC_API void mobilec_close(mobilec_model* model);

/* Size TVM's CPU thread pool (process-wide: every handle shares it) and set TVM_NUM_THREADS to match, as
 * `mobilec generate --threads` does. Without a call: TVM_NUM_THREADS, else OMP_NUM_THREADS, else TVM's default
 * (one per physical core), which mobilec_open then writes into TVM_NUM_THREADS (TVM otherwise reads
 * /sys/devices/system/cpu/online at every parallel kernel launch). No core pinning (it fights other processes). */
MOBILEC_API mobilec_status mobilec_set_threads(mobilec_model* model, int32_t threads);

/* The artifact's context window (tokens the KV cache holds), the length of the logits vectors, and the
 * end-of-sequence token id (-1 when the tokenizer names none). */
MOBILEC_API int32_t mobilec_context_window(const mobilec_model* model);
MOBILEC_API int32_t mobilec_vocab_size(const mobilec_model* model);
MOBILEC_API int32_t mobilec_eos_token_id(const mobilec_model* model);

/* Token ids of UTF-8 `text`. add_special_tokens != 0 adds what the tokenizer's post-processor adds (a BOS for
 * models that use one), as transformers' encode(text) does; 0 adds nothing (for a rendered chat prompt). Special
 * tokens written in the text are matched as tokens. */
MOBILEC_API mobilec_status mobilec_tokenize(mobilec_model* model, const char* text, int add_special_tokens,
                                            const int32_t** out_ids, size_t* out_count);

/* The text of `ids`, UTF-8 (an incomplete character at the end comes back as U+FFFD, as transformers does);
 * skip_special_tokens != 0 leaves out special tokens (EOS, <|im_start|>...). */
MOBILEC_API mobilec_status mobilec_detokenize(mobilec_model* model, const int32_t* ids, size_t count,
                                              int skip_special_tokens, const char** out_text);

/* `user_message` rendered with the model's chat template, ending with the assistant's generation prompt (the
 * text `mobilec generate --chat` tokenizes); tokenize it with add_special_tokens = 0. MOBILEC_ERROR_UNSUPPORTED for
 * a model without a chat template or with one the compiler could not split (see the top of this file). */
MOBILEC_API mobilec_status mobilec_chat_prompt(mobilec_model* model, const char* user_message,
                                               const char** out_text);

/* Forget the sequence: a fresh, empty KV cache. */
MOBILEC_API mobilec_status mobilec_reset(mobilec_model* model);

/* Tokens in the sequence (KV cache) now. */
MOBILEC_API int32_t mobilec_sequence_length(const mobilec_model* model);

/* Append `count` tokens to the sequence (fed in chunks of the artifact's prefill chunk); *out_logits gets the
 * logits after the last one (mobilec_vocab_size floats). Refused, with nothing appended, when the sequence would
 * outgrow the context window. */
MOBILEC_API mobilec_status mobilec_prefill(mobilec_model* model, const int32_t* ids, size_t count,
                                           const float** out_logits);

/* Append one token; *out_logits gets the logits after it. */
MOBILEC_API mobilec_status mobilec_decode(mobilec_model* model, int32_t token_id, const float** out_logits);

/* Seed the handle's random generator (used by mobilec_sample; mobilec_generate reseeds it with config.seed).
 * The generator is the runtime's own (a 64-bit Mersenne Twister): the same seed gives the same tokens on every
 * platform, though not numpy's. */
MOBILEC_API mobilec_status mobilec_seed(mobilec_model* model, uint64_t seed);

/* A token from `logits` (mobilec_vocab_size floats): the first largest when temperature is 0 (greedy), else
 * nucleus sampling as `mobilec generate` does it (softmax of logits / temperature, the most likely tokens up to
 * top_p of the mass, one drawn from them). temperature >= 0; 0 < top_p <= 1. */
MOBILEC_API mobilec_status mobilec_sample(mobilec_model* model, const float* logits, double temperature,
                                          double top_p, int32_t* out_token);

typedef struct {
  int32_t max_new_tokens;   /* at least 1; default 64 */
  double temperature;       /* 0 = greedy (default) */
  double top_p;             /* (0, 1]; default 1 */
  uint64_t seed;            /* default 0 */
  int ignore_eos;           /* != 0: keep going past EOS and the stop ids (benchmarks); default 0 */
  const int32_t* stop_ids;  /* more ids that end generation besides EOS (may be NULL); default none */
  size_t num_stop_ids;
} mobilec_generation_config;

/* The defaults above. */
MOBILEC_API void mobilec_generation_config_init(mobilec_generation_config* config);

/* Called once per generated token (the stopping token included) with its id and the text it completes (UTF-8,
 * special tokens left out; "" while a multi-byte character is incomplete, the whole character with the token
 * that completes it). Return 0 to go on, anything else to stop after this token. */
typedef int (*mobilec_token_callback)(void* user_data, int32_t token_id, const char* text, size_t text_len);

typedef struct {
  const int32_t* token_ids;  /* the generated tokens, the stopping one included; owned by the handle */
  size_t num_tokens;
  const char* text;          /* their text, special tokens left out; owned by the handle */
  int32_t prompt_tokens;
  double ttft_ms;            /* prompt in, first token out (prefill and one sample) */
  double prefill_tok_s;      /* prompt tokens / TTFT */
  double decode_tok_s;       /* tokens after the first / their time; NaN when only one was generated */
} mobilec_result;

/* Reset the sequence, prefill the prompt, then decode until config->max_new_tokens tokens, EOS or a stop id
 * (unless ignore_eos), or the callback asks to stop. The prompt and every token asked for must fit the context
 * window together: refused before anything runs (MOBILEC_ERROR_CONTEXT_FULL) otherwise. `callback` may be NULL. */
MOBILEC_API mobilec_status mobilec_generate(mobilec_model* model, const int32_t* prompt_ids, size_t prompt_count,
                                            const mobilec_generation_config* config,
                                            mobilec_token_callback callback, void* user_data,
                                            mobilec_result* out_result);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* MOBILEC_H_ */
