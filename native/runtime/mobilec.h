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
 * Several sequences at once: an engine (mobilec_engine_create, below the single-sequence functions) holds up to 8
 * sessions in one paged KV cache and decodes one token for each of them per mobilec_engine_step.
 *
 * Chat: mobilec_chat_prompt renders one user message as the model's chat template does, whatever its family
 * (ChatML, Llama 3, Gemma, Phi-3, Mistral...): the compiler renders the template around a placeholder message and
 * stores the text before and after it in the artifact (compiler/model_import/chat_prompt.py), with the dates the
 * template asks for (Llama 3.2) written at call time. A template whose text around the message depends on the
 * message is refused with MOBILEC_ERROR_UNSUPPORTED: the caller renders such prompts itself and tokenizes them with
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
  MOBILEC_ERROR_RUNTIME = 6,          /* TVM failed while loading or running the model */
  MOBILEC_ERROR_BUSY = 7              /* an engine has every session open, or no KV-cache room for one more
                                       * generation while the others run: retry once a session has finished */
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
 * /sys/devices/system/cpu/online at every parallel kernel launch). The pool's threads, the calling one included, share
 * its cores (the fastest, one per physical core): no thread is pinned to one (TVM_BIND_THREADS, where set, keeps TVM's
 * placement). */
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

/* ---------------------------------------------------------------------------------------------------------------
 * Engines: several sessions stepped together (what `mobilec serve` does in Python, compiler/serve/engine.py).
 *
 *   mobilec_engine* engine;
 *   mobilec_engine_create(model, 3, &engine);          // one KV cache for 3 sequences decoded together
 *   int32_t a, b;
 *   mobilec_session_open(engine, &a);
 *   mobilec_session_open(engine, &b);
 *   mobilec_session_feed(engine, a, prompt_a, len_a, &config);
 *   mobilec_session_feed(engine, b, prompt_b, len_b, &config);
 *   int32_t busy = 1;
 *   while (busy) mobilec_engine_step(engine, on_token, user_data, &busy);
 *   mobilec_session_result result;
 *   mobilec_session_get_result(engine, a, &result);
 *   mobilec_engine_destroy(engine);
 *
 * Each step prefills one chunk (the artifact's prefill chunk) of one session still reading its prompt (the one fed
 * first), so that the others' streams keep flowing during a long prompt, then decodes one token for every session
 * that is generating, all of them in one model call (the weights read once for all rows) where the artifact has a
 * batched decode: `batch_decode` (exported by artifacts whose decode GEMVs are integer-dot kernels: a row per
 * session, each row quantized alone and given exactly what the one-row decode gives it), or `prefill_logits` where
 * the decode GEMVs are float kernels. Older artifacts with integer-dot GEMVs and no batch_decode decode each session
 * with its own decode call. Greedy tokens are the same as alone either way (float rows within rounding).
 *
 * Prefix reuse: a session's sequence stays in the cache after it finishes (finished, stopped by its callback, or
 * closed after finishing). A later prompt that starts with such a sequence's tokens (its prompt and the tokens fed
 * back) forks it and prefills only the rest (mobilec_session_result.prefilled_tokens says how many). Cached
 * sequences are evicted least recently used first when a new generation needs their room. Cancelled sequences are
 * not kept.
 *
 * Ownership: the engine uses the model's library, weights and tokenizer: destroy every engine of a model before
 * closing it. Threads: an engine and its model are not thread-safe; make every call on one thread (or lock around
 * them), the token callback included (it must not call the engine; it returns non-zero to stop its session).
 * Errors: as above (a status, and mobilec_last_error); a failed call changes nothing, except that a model call that
 * fails inside a step ends the sessions in that call (state MOBILEC_SESSION_FAILED) and returns
 * MOBILEC_ERROR_RUNTIME. Pointers a call hands back belong to the engine and stay valid until its next call. */

typedef struct mobilec_engine mobilec_engine;

/* Sessions an engine holds at most. */
#define MOBILEC_MAX_SESSIONS 8

/* An engine over `model` with room for `max_sessions` (1 to MOBILEC_MAX_SESSIONS) sequences of the whole context
 * window, decoded together: its KV cache is allocated now, max_sessions x the context window's worth. On failure
 * *out_engine is NULL (MOBILEC_ERROR_INVALID_ARGUMENT for a session count out of range). */
MOBILEC_API mobilec_status mobilec_engine_create(mobilec_model* model, int32_t max_sessions,
                                                 mobilec_engine** out_engine);

/* 1 when the engine decodes its generating sessions in one model call per step (the artifact exports batch_decode,
 * or its decode GEMVs are float kernels: running sessions together raises throughput), 0 when it decodes each with
 * its own call (integer-dot GEMVs without batch_decode, artifacts compiled before it: the aggregate rate stays near
 * one session's); 0 for NULL. */
MOBILEC_API int32_t mobilec_engine_batched_decode(const mobilec_engine* engine);

/* Free the engine, its KV cache and its sessions; NULL is ignored. */
MOBILEC_API void mobilec_engine_destroy(mobilec_engine* engine);

/* A new session (an id from 0 to max_sessions - 1), idle until a prompt is fed. MOBILEC_ERROR_BUSY when every
 * session is open. */
MOBILEC_API mobilec_status mobilec_session_open(mobilec_engine* engine, int32_t* out_session);

/* Close the session: a generation still running is cancelled; a finished sequence stays as a cached prefix. The
 * id may be handed out again by mobilec_session_open. MOBILEC_ERROR_INVALID_ARGUMENT for an id that is not open. */
MOBILEC_API mobilec_status mobilec_session_close(mobilec_engine* engine, int32_t session);

/* Start a generation in an open session that is not generating (idle, finished or cancelled; the previous result
 * is dropped): `count` prompt ids (copied), prefilled in chunks by the following steps, then up to
 * config->max_new_tokens tokens (EOS and the stop ids end it unless ignore_eos), sampled with the session's own
 * generator seeded with config->seed (the same tokens as mobilec_generate with that config). Refused before
 * anything changes: MOBILEC_ERROR_CONTEXT_FULL when the prompt and max_new_tokens do not fit the context window
 * together (as mobilec_generate), MOBILEC_ERROR_INVALID_ARGUMENT for a bad id, session or config,
 * MOBILEC_ERROR_BUSY when the KV cache has no room now (the other sessions' generations reserve it). */
MOBILEC_API mobilec_status mobilec_session_feed(mobilec_engine* engine, int32_t session, const int32_t* prompt_ids,
                                                size_t count, const mobilec_generation_config* config);

/* Stop the session's generation now; its sequence is freed (not kept as a prefix). Nothing happens to a session
 * that is not generating. */
MOBILEC_API mobilec_status mobilec_session_cancel(mobilec_engine* engine, int32_t session);

/* Called by mobilec_engine_step for each token it generates, with the session, the token and the text it completes
 * (as mobilec_token_callback). Return 0 to go on, anything else to end that session after this token. */
typedef int (*mobilec_session_callback)(void* user_data, int32_t session, int32_t token_id, const char* text,
                                        size_t text_len);

/* One step: one prompt chunk of one session, then one token for every generating session (see above). `callback`
 * may be NULL. *out_busy (may be NULL) is 1 while a session is still prefilling or generating after this step, 0
 * when all are done. */
MOBILEC_API mobilec_status mobilec_engine_step(mobilec_engine* engine, mobilec_session_callback callback,
                                               void* user_data, int32_t* out_busy);

typedef enum {
  MOBILEC_SESSION_IDLE = 0,        /* nothing fed yet */
  MOBILEC_SESSION_PREFILLING = 1,  /* reading its prompt */
  MOBILEC_SESSION_GENERATING = 2,
  MOBILEC_SESSION_FINISHED = 3,    /* max_new_tokens, EOS / a stop id, or its callback asked to stop */
  MOBILEC_SESSION_CANCELLED = 4,   /* mobilec_session_cancel or mobilec_session_close while generating */
  MOBILEC_SESSION_FAILED = 5       /* the model failed in a step (that step's status and message say how) */
} mobilec_session_state;

typedef struct {
  mobilec_session_state state;
  const int32_t* token_ids;  /* the tokens generated so far, the stopping one included; owned by the engine */
  size_t num_tokens;
  const char* text;          /* their text, special tokens left out; owned by the engine */
  int32_t prompt_tokens;
  int32_t reused_tokens;     /* prompt tokens taken from a cached sequence (prefix reuse) */
  int32_t prefilled_tokens;  /* prompt tokens run through the model so far (prompt_tokens - reused_tokens at the end) */
  double ttft_ms;            /* fed to first token; NaN before it */
} mobilec_session_result;

/* Where the session stands and what it generated. */
MOBILEC_API mobilec_status mobilec_session_get_result(mobilec_engine* engine, int32_t session,
                                                      mobilec_session_result* out_result);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* MOBILEC_H_ */
