// bpe_tokenizer.h: a BPE tokenizer read from a Hugging Face tokenizer.json, giving the same ids as the `tokenizers`
// library's encode(text, add_special_tokens=False) and the same text as its decode, for the families the runtime
// ships:
//   - byte-level BPE: GPT-2 style (SmolLM2: pre_tokenizer ByteLevel with its built-in regex) and Llama 3 / Qwen2
//     style (Split on the Llama 3 or Qwen2 regex, then ByteLevel without regex), decoder ByteLevel;
//   - SentencePiece-style BPE on characters with byte_fallback (a character missing from the vocabulary becomes
//     its UTF-8 bytes as <0xXX> tokens): Llama 2 / Mistral / Phi-3 (pre_tokenizer Metaspace, or normalizer
//     Prepend("▁") + Replace(" ", "▁") without pre_tokenizer) and Gemma (normalizer Replace(" ", "▁"), possibly
//     pre_tokenizer Split(" ", MergedWithPrevious)), decoder Sequence of Replace, ByteFallback, Fuse and Strip.
// Normalizers: none, NFC, Prepend, Replace (string pattern) and Sequences of them. Added tokens may have lstrip and
// rstrip. Anything else in the file (another model, pre-tokenizer, regex, normalizer, decoder, or an option it does
// not implement) is refused when loading, never ignored. The post-processor is not applied: Encode adds no BOS/EOS.
#ifndef MOBILEC_NATIVE_RUNTIME_BPE_TOKENIZER_H_
#define MOBILEC_NATIVE_RUNTIME_BPE_TOKENIZER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mobilec {

class BpeTokenizer {
 public:
  // Reads a tokenizer.json (model.type "BPE"). On failure returns nullptr and sets *error to one line naming the
  // problem (missing file, not JSON, unsupported model/pre_tokenizer/normalizer/decoder type or option...).
  static std::unique_ptr<BpeTokenizer> FromFile(const std::string& path, std::string* error);

  // No BOS added; added/special tokens in the text are matched as tokens, as tokenizers'
  // encode(text, add_special_tokens=False) does (tokenizer_config.json's split_special_tokens is not read).
  // Bytes that are not valid UTF-8 are tokenized as bytes. A symbol the vocabulary lacks becomes its <0xXX> byte
  // tokens under byte_fallback, else the unk_token (consecutive ones fused into one under fuse_unk), else it is
  // dropped (SmolLM2's vocabulary lacks a few control bytes), as in tokenizers.
  // Thread-safe: Encode and the other methods change nothing.
  std::vector<int32_t> Encode(std::string_view text) const;
  // The bytes of the tokens, as tokenizers' decode gives them, except that byte sequences that are not valid
  // UTF-8 (a character split across ids) are returned as they are instead of replaced by U+FFFD. Unknown ids
  // decode to nothing.
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;
  // The decoded bytes of one token (for streaming): " the" for "▁the" or "Ġthe", the byte 0x0A for "<0x0A>"; empty
  // for an unknown id. Concatenated over ids they give Decode's text before the decoder's Strip step (Llama's
  // decoder strips the one leading space the pre-tokenizer adds).
  std::string TokenText(int32_t id) const;
  // The id of an added token's content or of a vocabulary entry as spelled in tokenizer.json ("Ġthe" or "▁the"
  // for " the"); -1 if absent (e.g. "<|im_end|>" in a tokenizer without it).
  int32_t TokenId(std::string_view token) const;
  // One more than the largest id of the vocabulary and the added tokens.
  size_t VocabSize() const;

  // The normalizer and pre-tokenizer as read (implementation details, public for the loader's helpers).
  struct NormalizerStep {
    enum class Kind { kNfc, kPrepend, kReplace } kind;
    std::string pattern;  // kReplace: the string replaced
    std::string content;  // kPrepend: the string prepended; kReplace: its replacement
  };
  struct PreTokenizer {
    // How the text is cut into words: on a byte-level regex (the words then go through the GPT-2 byte alphabet),
    // not at all, by Metaspace, or by Split on a string with the delimiter kept at the end of the word before it.
    enum class Kind { kGpt2, kLlama3, kQwen2, kNone, kMetaspace, kSplitAfterString } kind = Kind::kGpt2;
    std::string string;  // kMetaspace: the replacement of " "; kSplitAfterString: the delimiter
    enum class PrependScheme { kAlways, kFirst, kNever } prepend_scheme = PrependScheme::kAlways;  // kMetaspace
    bool split = true;  // kMetaspace: cut before each replacement
    bool ByteLevel() const { return kind == Kind::kGpt2 || kind == Kind::kLlama3 || kind == Kind::kQwen2; }
  };

 private:
  struct AddedToken {
    std::string content;  // as matched: normalized when the token is `normalized`
    int32_t id;
    bool lstrip, rstrip;  // the match takes the whitespace before / after it
  };
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };

  BpeTokenizer() = default;
  std::string Load(const std::string& path);  // returns the error, empty on success
  void LoadJson(const std::string& text);      // throws LoadError (bpe_tokenizer.cc)

  // Splits `text` on `tokens` (leftmost match, then longest, widened by lstrip/rstrip) and calls
  // on_text(piece, offset) for the text between them, appending the added tokens' ids to `ids` in between.
  template <typename OnText>
  void SplitOnAddedTokens(std::string_view text, const std::vector<AddedToken>& tokens, std::vector<int32_t>* ids,
                          OnText on_text) const;
  std::string Normalize(std::string_view text) const;
  // Appends the ids of normalized text that holds no added token: pre-tokenize, then BPE each word. `at_start`:
  // the text begins the input (Metaspace's prepend_scheme "first" adds its "▁" only there).
  void EncodePlainText(std::string_view text, bool at_start, std::vector<int32_t>* ids) const;
  // Appends the ids of one word (for byte-level pre-tokenizers, of its bytes' symbols).
  void EncodeWord(std::string_view word, std::vector<int32_t>* ids) const;

  std::vector<NormalizerStep> normalizer_;
  PreTokenizer pre_tokenizer_;
  bool ignore_merges_ = false;
  bool fuse_unk_ = false;
  int32_t unknown_id_ = -1;  // the unk_token's id, or -1: then a symbol missing from the vocabulary is dropped
  std::array<int32_t, 256> byte_fallback_ids_;  // byte -> id of "<0xXX>" under byte_fallback, else -1

  std::unordered_map<std::string, int32_t> vocab_;  // tokenizer.json's model.vocab
  std::unordered_map<char32_t, int32_t> char_ids_;  // the vocabulary's one-character tokens
  std::unordered_map<uint64_t, Merge> merges_;      // (left id << 32 | right id) -> rank and merged token
  // Added tokens matched in the raw text (normalized false) and in the normalized text (normalized true), each
  // sorted longest first so the first match at a position is the longest.
  std::vector<AddedToken> raw_added_tokens_;
  std::vector<AddedToken> normalized_added_tokens_;
  std::unordered_map<std::string, int32_t> added_token_ids_;
  std::vector<std::string> token_bytes_;  // id -> decoded bytes (TokenText)
  std::vector<bool> is_special_;          // id -> an added token marked special
  // The decoder's Strip step (after Fuse): up to strip_start_ leading and strip_stop_ trailing strip_content_.
  std::string strip_content_;
  size_t strip_start_ = 0, strip_stop_ = 0;
};

}  // namespace mobilec

#endif  // MOBILEC_NATIVE_RUNTIME_BPE_TOKENIZER_H_
