// bpe_tokenizer.cc: see bpe_tokenizer.h. The steps follow the `tokenizers` library's encode: split the text on the
// added tokens, normalize, split on the added tokens matched in normalized text, pre-tokenize into words (a regex
// and the GPT-2 byte alphabet, Metaspace, or a string split), map each word's characters to vocabulary ids (byte
// fallback or unk for the missing ones) and merge them by BPE rank. Decoding maps each token to its text once, when
// loading (TokenText), and applies the decoder's Strip to the whole text.
#include "bpe_tokenizer.h"

#include <tvm/ffi/extra/json.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <queue>
#include <sstream>
#include <utility>

#include "unicode_categories.h"

namespace mobilec {
namespace {

namespace json = tvm::ffi::json;
using tvm::ffi::Any;
using tvm::ffi::String;

// A problem with the tokenizer file: Load throws it, FromFile returns its message as the one-line error.
struct LoadError {
  std::string message;
};

// ---------------------------------------------------------------------------------------------------------------
// UTF-8 and Unicode classes

// A byte that does not start a valid UTF-8 sequence is kept as the code point kRawByteBase + byte (beyond Unicode):
// it classifies as "other", never normalizes, and is written back as that byte.
constexpr char32_t kRawByteBase = 0x110000;

struct CodePoint {
  char32_t value;
  size_t offset;  // of its first byte in the text
};

// The code points of `text`, followed by an end marker whose offset is text.size().
std::vector<CodePoint> DecodeUtf8(std::string_view text) {
  std::vector<CodePoint> code_points;
  code_points.reserve(text.size() + 1);
  size_t i = 0;
  while (i < text.size()) {
    auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
    unsigned char lead = byte(i);
    size_t length = lead < 0x80 ? 1 : lead >= 0xC2 && lead <= 0xDF ? 2 : lead >= 0xE0 && lead <= 0xEF ? 3
                                  : lead >= 0xF0 && lead <= 0xF4 ? 4 : 0;
    char32_t value = length == 1 ? lead : length == 2 ? lead & 0x1F : length == 3 ? lead & 0x0F : lead & 0x07;
    bool valid = length != 0 && i + length <= text.size();
    for (size_t k = 1; valid && k < length; ++k) {
      valid = (byte(i + k) & 0xC0) == 0x80;
      value = (value << 6) | (byte(i + k) & 0x3F);
    }
    // Overlong 3- and 4-byte forms, UTF-16 surrogates and values past U+10FFFF are not valid UTF-8 either.
    valid = valid && !(length == 3 && (value < 0x800 || (value >= 0xD800 && value <= 0xDFFF))) &&
            !(length == 4 && (value < 0x10000 || value > 0x10FFFF));
    if (!valid) {
      value = kRawByteBase + lead;
      length = 1;
    }
    code_points.push_back({value, i});
    i += length;
  }
  code_points.push_back({0, text.size()});
  return code_points;
}

void AppendUtf8(char32_t value, std::string* out) {
  if (value >= kRawByteBase) {
    out->push_back(static_cast<char>(value - kRawByteBase));
  } else if (value < 0x80) {
    out->push_back(static_cast<char>(value));
  } else if (value < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (value >> 6)));
    out->push_back(static_cast<char>(0x80 | (value & 0x3F)));
  } else if (value < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (value >> 12)));
    out->push_back(static_cast<char>(0x80 | ((value >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (value & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (value >> 18)));
    out->push_back(static_cast<char>(0x80 | ((value >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((value >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (value & 0x3F)));
  }
}

// `text` with every occurrence of `pattern` (not empty), left to right, replaced by `content`.
std::string ReplaceAll(std::string_view text, std::string_view pattern, std::string_view content) {
  std::string out;
  size_t start = 0;
  for (size_t found; (found = text.find(pattern, start)) != std::string_view::npos; start = found + pattern.size()) {
    out.append(text.substr(start, found - start)).append(content);
  }
  return out.append(text.substr(start));
}

template <size_t N>
bool InRanges(const unicode::Range (&ranges)[N], char32_t value) {
  auto after = std::upper_bound(std::begin(ranges), std::end(ranges), value,
                                [](char32_t v, const unicode::Range& r) { return v < r.first; });
  return after != std::begin(ranges) && value <= (after - 1)->last;
}

// The classes the pre-tokenizer regexes distinguish: \p{L}, \p{N}, \s, and everything else.
enum class CharClass { kLetter, kNumber, kSpace, kOther };

CharClass Classify(char32_t value) {
  if (value < 0x80) {
    if ((value >= 'a' && value <= 'z') || (value >= 'A' && value <= 'Z')) return CharClass::kLetter;
    if (value >= '0' && value <= '9') return CharClass::kNumber;
    if (value == ' ' || (value >= '\t' && value <= '\r')) return CharClass::kSpace;
    return CharClass::kOther;
  }
  if (InRanges(unicode::kLetters, value)) return CharClass::kLetter;
  if (InRanges(unicode::kNumbers, value)) return CharClass::kNumber;
  if (InRanges(unicode::kWhiteSpace, value)) return CharClass::kSpace;
  return CharClass::kOther;
}

// ---------------------------------------------------------------------------------------------------------------
// NFC (Unicode Standard Annex #15): canonical decomposition, canonical ordering, canonical composition.

constexpr char32_t kHangulFirst = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr char32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr char32_t kHangulCount = kHangulLCount * kHangulVCount * kHangulTCount;

uint32_t CombiningClass(char32_t value) {
  if (value < 0x300) return 0;
  auto after = std::upper_bound(std::begin(unicode::kCombiningClasses), std::end(unicode::kCombiningClasses), value,
                                [](char32_t v, const unicode::CombiningClassRange& r) { return v < r.first; });
  if (after == std::begin(unicode::kCombiningClasses) || value > (after - 1)->last) return 0;
  return (after - 1)->combining_class;
}

void AppendCanonicalDecomposition(char32_t value, std::vector<char32_t>* out) {
  if (value >= kHangulFirst && value < kHangulFirst + kHangulCount) {
    char32_t index = value - kHangulFirst;
    out->push_back(kHangulL + index / (kHangulVCount * kHangulTCount));
    out->push_back(kHangulV + index % (kHangulVCount * kHangulTCount) / kHangulTCount);
    if (index % kHangulTCount != 0) out->push_back(kHangulT + index % kHangulTCount);
    return;
  }
  auto found = std::lower_bound(std::begin(unicode::kDecompositions), std::end(unicode::kDecompositions), value,
                                [](const unicode::Decomposition& d, char32_t v) { return d.code_point < v; });
  if (found == std::end(unicode::kDecompositions) || found->code_point != value) {
    out->push_back(value);
    return;
  }
  AppendCanonicalDecomposition(found->first, out);
  if (found->second != 0) AppendCanonicalDecomposition(found->second, out);
}

// The primary composite of `first` followed by `second`, or 0 if they do not compose.
char32_t Compose(char32_t first, char32_t second) {
  if (first >= kHangulL && first < kHangulL + kHangulLCount && second >= kHangulV &&
      second < kHangulV + kHangulVCount) {
    return kHangulFirst + ((first - kHangulL) * kHangulVCount + (second - kHangulV)) * kHangulTCount;
  }
  if (first >= kHangulFirst && first < kHangulFirst + kHangulCount && (first - kHangulFirst) % kHangulTCount == 0 &&
      second > kHangulT && second < kHangulT + kHangulTCount) {
    return first + (second - kHangulT);
  }
  auto found = std::lower_bound(std::begin(unicode::kCompositions), std::end(unicode::kCompositions),
                                std::make_pair(first, second),
                                [](const unicode::Composition& c, const std::pair<char32_t, char32_t>& key) {
                                  return std::make_pair(char32_t{c.first}, char32_t{c.second}) < key;
                                });
  bool hit = found != std::end(unicode::kCompositions) && found->first == first && found->second == second;
  return hit ? found->composite : 0;
}

std::string Nfc(std::string_view text) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
    return std::string(text);  // ASCII is already NFC
  }
  std::vector<CodePoint> code_points = DecodeUtf8(text);
  std::vector<char32_t> decomposed;
  for (size_t i = 0; i + 1 < code_points.size(); ++i) AppendCanonicalDecomposition(code_points[i].value, &decomposed);
  // Canonical ordering: each run of non-starters sorted by combining class, stably.
  for (size_t start = 0; start < decomposed.size();) {
    size_t end = start;
    while (end < decomposed.size() && CombiningClass(decomposed[end]) != 0) ++end;
    std::stable_sort(decomposed.begin() + start, decomposed.begin() + end,
                     [](char32_t a, char32_t b) { return CombiningClass(a) < CombiningClass(b); });
    start = end + 1;
  }
  // Canonical composition: a code point joins the last starter unless a code point between them blocks it (one of
  // combining class 0, or of a class at least its own). Those between are non-starters in class order, so the last
  // one kept decides.
  std::vector<char32_t> composed;
  std::optional<size_t> starter;
  uint32_t last_class = 0;
  for (char32_t value : decomposed) {
    uint32_t combining_class = CombiningClass(value);
    bool adjacent_to_starter = starter && *starter == composed.size() - 1;
    if (starter && (adjacent_to_starter || (last_class != 0 && last_class < combining_class))) {
      if (char32_t composite = Compose(composed[*starter], value)) {
        composed[*starter] = composite;
        continue;
      }
    }
    if (combining_class == 0) starter = composed.size();
    last_class = combining_class;
    composed.push_back(value);
  }
  std::string out;
  out.reserve(text.size());
  for (char32_t value : composed) AppendUtf8(value, &out);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Pre-tokenizer regexes. Each matcher gives the end of the match that starts at `start` (start < end marker), as
// the regex engine would find it: alternatives tried in order, quantifiers greedy with backtracking. Every code
// point starts a match of these patterns (the last alternative, \s+, takes whitespace; the others take the rest),
// so the matches tile the text.

// The Split regexes as tokenizer.json spells them (the GPT-2 one, built into ByteLevel, is never in the file).
constexpr char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kQwen2Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";

class PatternMatcher {
 public:
  explicit PatternMatcher(const std::vector<CodePoint>& code_points) : code_points_(code_points) {
    classes_.reserve(code_points.size());
    for (const CodePoint& cp : code_points) classes_.push_back(Classify(cp.value));
  }

  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ (ByteLevel's built-in regex)
  size_t MatchGpt2(size_t start) const {
    if (size_t end = Contraction(start, /*ignore_case=*/false)) return end;
    size_t after_space = At(start) == ' ' ? start + 1 : start;  // the optional leading " "
    for (CharClass run_class : {CharClass::kLetter, CharClass::kNumber, CharClass::kOther}) {
      if (IsClass(after_space, run_class)) return RunEnd(after_space, run_class);
    }
    return WhitespaceEnd(start);
  }

  // kLlama3Pattern, or kQwen2Pattern with max_digits 1 (\p{N} instead of \p{N}{1,3}).
  size_t MatchLlama3(size_t start, size_t max_digits) const {
    if (size_t end = Contraction(start, /*ignore_case=*/true)) return end;
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (IsClass(start, CharClass::kLetter)) return RunEnd(start, CharClass::kLetter);
    bool may_lead_letters = !IsClass(start, CharClass::kNumber) && At(start) != '\r' && At(start) != '\n';
    if (may_lead_letters && IsClass(start + 1, CharClass::kLetter)) return RunEnd(start + 1, CharClass::kLetter);
    // \p{N}{1,3}
    if (IsClass(start, CharClass::kNumber)) return std::min(RunEnd(start, CharClass::kNumber), start + max_digits);
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    size_t after_space = At(start) == ' ' ? start + 1 : start;
    if (IsClass(after_space, CharClass::kOther)) {
      size_t end = RunEnd(after_space, CharClass::kOther);
      while (At(end) == '\r' || At(end) == '\n') ++end;
      return end;
    }
    // \s*[\r\n]+ : backtracking leaves \s* everything before the run's last line break.
    size_t run_end = RunEnd(start, CharClass::kSpace);
    for (size_t i = run_end; i > start; --i) {
      if (At(i - 1) == '\r' || At(i - 1) == '\n') return i;
    }
    return WhitespaceEnd(start);
  }

 private:
  char32_t At(size_t i) const { return i < End() ? code_points_[i].value : 0; }
  bool IsClass(size_t i, CharClass c) const { return i < End() && classes_[i] == c; }
  size_t End() const { return code_points_.size() - 1; }
  size_t RunEnd(size_t i, CharClass c) const {
    while (IsClass(i, c)) ++i;
    return i;
  }

  // 's|'t|'re|'ve|'m|'ll|'d, or with ignore_case (?i:...) under Unicode simple case folding, where the only
  // letters besides A-Z folding to these are U+017F LATIN SMALL LETTER LONG S (to s); 0 if none matches.
  size_t Contraction(size_t start, bool ignore_case) const {
    if (At(start) != '\'') return 0;
    auto letter = [&](size_t i) -> char32_t {
      char32_t c = At(i);
      if (!ignore_case) return c;
      return c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c == 0x17F ? 's' : c;
    };
    char32_t first = letter(start + 1);
    if (first == 's' || first == 't' || first == 'm' || first == 'd') return start + 2;
    char32_t second = letter(start + 2);
    if ((first == 'r' && second == 'e') || (first == 'v' && second == 'e') || (first == 'l' && second == 'l')) {
      return start + 3;
    }
    return 0;
  }

  // \s+(?!\S)|\s+ : a whitespace run, less its last code point when a non-space follows it and that leaves some.
  size_t WhitespaceEnd(size_t start) const {
    size_t end = RunEnd(start, CharClass::kSpace);
    return end < End() && end - start > 1 ? end - 1 : end;
  }

  const std::vector<CodePoint>& code_points_;
  std::vector<CharClass> classes_;
};

// ---------------------------------------------------------------------------------------------------------------
// Byte-level alphabet (GPT-2's bytes_to_unicode): printable bytes stand for themselves, the others for U+0100...

std::vector<char32_t> ByteToCodePoint() {
  std::vector<char32_t> table(256);
  char32_t next_unprintable = 256;
  for (int byte = 0; byte < 256; ++byte) {
    bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE);
    table[byte] = printable ? byte : next_unprintable++;
  }
  return table;
}

// The ByteLevel decoder on one token: the bytes its code points stand for, or, when one of them is outside the
// byte-level alphabet (an added token such as "my token"), the token's own UTF-8.
std::string DecodeByteLevel(const std::string& token) {
  static const std::unordered_map<char32_t, char> code_point_to_byte = [] {
    std::unordered_map<char32_t, char> inverse;
    std::vector<char32_t> code_points = ByteToCodePoint();
    for (int byte = 0; byte < 256; ++byte) inverse[code_points[byte]] = static_cast<char>(byte);
    return inverse;
  }();
  std::vector<CodePoint> code_points = DecodeUtf8(token);
  std::string bytes;
  for (size_t i = 0; i + 1 < code_points.size(); ++i) {
    auto found = code_point_to_byte.find(code_points[i].value);
    if (found == code_point_to_byte.end()) return token;
    bytes.push_back(found->second);
  }
  return bytes;
}

// ---------------------------------------------------------------------------------------------------------------
// Reading tokenizer.json

std::string Describe(const Any& value) {
  std::string text = json::Stringify(value);
  return text.size() > 80 ? text.substr(0, 77) + "..." : text;
}

json::Object AsObject(const Any& value, const std::string& where) {
  auto object = value.as<json::Object>();
  if (!object) throw LoadError{where + " is not a JSON object: " + Describe(value)};
  return *object;
}

json::Array AsArray(const Any& value, const std::string& where) {
  auto array = value.as<json::Array>();
  if (!array) throw LoadError{where + " is not a JSON array: " + Describe(value)};
  return *array;
}

std::string AsString(const Any& value, const std::string& where) {
  auto string = value.as<String>();
  if (!string) throw LoadError{where + " is not a string: " + Describe(value)};
  return *string;
}

int32_t AsId(const Any& value, const std::string& where) {
  auto number = value.as<int64_t>();
  if (!number || *number < 0 || *number > INT32_MAX) throw LoadError{where + " is not a token id: " + Describe(value)};
  return static_cast<int32_t>(*number);
}

// The field, or null when absent.
Any Field(const json::Object& object, const char* key) {
  std::optional<Any> value = object.Get(String(key));
  return value ? *value : Any(nullptr);
}

bool BoolField(const json::Object& object, const char* key, const std::string& where, bool if_absent) {
  Any value = Field(object, key);
  if (value == nullptr) return if_absent;
  auto flag = value.as<bool>();
  if (!flag) throw LoadError{where + "." + key + " is not true or false: " + Describe(value)};
  return *flag;
}

[[noreturn]] void Refuse(const std::string& where, const Any& value, const std::string& supported) {
  throw LoadError{where + " " + Describe(value) + " is not supported (" + supported + ")"};
}

std::string TypeOf(const json::Object& object, const std::string& where) {
  return AsString(Field(object, "type"), where + ".type");
}

void CheckByteLevel(const json::Object& byte_level, const std::string& where, bool use_regex) {
  if (BoolField(byte_level, "add_prefix_space", where, true)) {
    Refuse(where + ".add_prefix_space", Field(byte_level, "add_prefix_space"), "only false");
  }
  if (BoolField(byte_level, "use_regex", where, true) != use_regex) {
    Refuse(where + ".use_regex", Field(byte_level, "use_regex"), use_regex ? "here only true" : "here only false");
  }
}

// The string of a Replace or Split step's {"String": ...} pattern (a {"Regex": ...} one is refused).
std::string StringPattern(const json::Object& step, const std::string& where) {
  Any pattern = Field(step, "pattern");
  Any string = Field(AsObject(pattern, where + ".pattern"), "String");
  if (string == nullptr) Refuse(where + ".pattern", pattern, "only a {\"String\": ...} pattern");
  return AsString(string, where + ".pattern.String");
}

// The normalizer as steps applied in order: null, NFC, Prepend, Replace on a string, or a Sequence of them.
void ReadNormalizer(const Any& value, const std::string& where, std::vector<BpeTokenizer::NormalizerStep>* steps) {
  using Kind = BpeTokenizer::NormalizerStep::Kind;
  if (value == nullptr) return;
  json::Object normalizer = AsObject(value, where);
  std::string type = TypeOf(normalizer, where);
  if (type == "Sequence") {
    json::Array normalizers = AsArray(Field(normalizer, "normalizers"), where + ".normalizers");
    for (size_t i = 0; i < normalizers.size(); ++i) {
      ReadNormalizer(normalizers[i], where + ".normalizers[" + std::to_string(i) + "]", steps);
    }
  } else if (type == "NFC") {
    steps->push_back({Kind::kNfc, "", ""});
  } else if (type == "Prepend") {
    steps->push_back({Kind::kPrepend, "", AsString(Field(normalizer, "prepend"), where + ".prepend")});
  } else if (type == "Replace") {
    std::string pattern = StringPattern(normalizer, where);
    if (pattern.empty()) Refuse(where + ".pattern", Field(normalizer, "pattern"), "only a non-empty string");
    steps->push_back({Kind::kReplace, pattern, AsString(Field(normalizer, "content"), where + ".content")});
  } else {
    Refuse(where + ".type", Field(normalizer, "type"), "only null, NFC, Prepend, Replace or a Sequence of them");
  }
}

// A string of exactly one character (Metaspace's replacement, Strip's content).
std::string OneCharacter(const Any& value, const std::string& where) {
  std::string text = AsString(value, where);
  if (DecodeUtf8(text).size() != 2) Refuse(where, value, "only one character");
  return text;
}

BpeTokenizer::PreTokenizer ReadPreTokenizer(const Any& value) {
  using PreTokenizer = BpeTokenizer::PreTokenizer;
  const std::string where = "pre_tokenizer";
  const std::string supported =
      "null, ByteLevel with its regex, Sequence of Split on the Llama 3 or Qwen2 regex and ByteLevel without regex, "
      "Metaspace, or Split on a string MergedWithPrevious";
  PreTokenizer result;
  if (value == nullptr) {
    result.kind = PreTokenizer::Kind::kNone;
    return result;
  }
  json::Object pre_tokenizer = AsObject(value, where);
  std::string type = TypeOf(pre_tokenizer, where);
  if (type == "ByteLevel") {
    CheckByteLevel(pre_tokenizer, where, /*use_regex=*/true);
    result.kind = PreTokenizer::Kind::kGpt2;
    return result;
  }
  if (type == "Metaspace") {
    result.kind = PreTokenizer::Kind::kMetaspace;
    result.string = OneCharacter(Field(pre_tokenizer, "replacement"), where + ".replacement");
    // Files from before prepend_scheme have add_prefix_space; tokenizers reads a missing scheme as "always".
    Any scheme = Field(pre_tokenizer, "prepend_scheme");
    std::string scheme_name = scheme != nullptr ? AsString(scheme, where + ".prepend_scheme")
                              : BoolField(pre_tokenizer, "add_prefix_space", where, true) ? "always"
                                                                                          : "never";
    if (scheme_name == "always") {
      result.prepend_scheme = PreTokenizer::PrependScheme::kAlways;
    } else if (scheme_name == "first") {
      result.prepend_scheme = PreTokenizer::PrependScheme::kFirst;
    } else if (scheme_name == "never") {
      result.prepend_scheme = PreTokenizer::PrependScheme::kNever;
    } else {
      Refuse(where + ".prepend_scheme", scheme, "only always, first or never");
    }
    result.split = BoolField(pre_tokenizer, "split", where, true);
    return result;
  }
  if (type == "Split") {
    if (Field(pre_tokenizer, "behavior").as<String>().value_or("") != "MergedWithPrevious") {
      Refuse(where + ".behavior", Field(pre_tokenizer, "behavior"), "a lone Split only MergedWithPrevious");
    }
    if (BoolField(pre_tokenizer, "invert", where, false)) {
      Refuse(where + ".invert", Field(pre_tokenizer, "invert"), "only false");
    }
    result.kind = PreTokenizer::Kind::kSplitAfterString;
    result.string = StringPattern(pre_tokenizer, where);
    if (result.string.empty()) Refuse(where + ".pattern", Field(pre_tokenizer, "pattern"), "only a non-empty string");
    return result;
  }
  if (type != "Sequence") Refuse(where + ".type", Field(pre_tokenizer, "type"), supported);
  json::Array steps = AsArray(Field(pre_tokenizer, "pretokenizers"), where + ".pretokenizers");
  if (steps.size() != 2) Refuse(where + ".pretokenizers", Field(pre_tokenizer, "pretokenizers"), supported);
  json::Object split = AsObject(steps[0], where + ".pretokenizers[0]");
  json::Object byte_level = AsObject(steps[1], where + ".pretokenizers[1]");
  if (TypeOf(split, where + ".pretokenizers[0]") != "Split") {
    Refuse(where + ".pretokenizers[0].type", Field(split, "type"), supported);
  }
  if (TypeOf(byte_level, where + ".pretokenizers[1]") != "ByteLevel") {
    Refuse(where + ".pretokenizers[1].type", Field(byte_level, "type"), supported);
  }
  CheckByteLevel(byte_level, where + ".pretokenizers[1]", /*use_regex=*/false);
  const std::string split_where = where + ".pretokenizers[0]";
  if (Field(split, "behavior").as<String>().value_or("") != "Isolated") {
    Refuse(split_where + ".behavior", Field(split, "behavior"), "only Isolated");
  }
  if (BoolField(split, "invert", split_where, false)) {
    Refuse(split_where + ".invert", Field(split, "invert"), "only false");
  }
  Any pattern = Field(AsObject(Field(split, "pattern"), split_where + ".pattern"), "Regex");
  std::string regex = pattern.as<String>().value_or("");
  if (regex == kLlama3Pattern) {
    result.kind = PreTokenizer::Kind::kLlama3;
  } else if (regex == kQwen2Pattern) {
    result.kind = PreTokenizer::Kind::kQwen2;
  } else {
    Refuse(split_where + ".pattern", Field(split, "pattern"), "only the Llama 3 and Qwen2 regexes");
  }
  return result;
}

// The decoder: ByteLevel alone, or the steps Replace (on a string)..., ByteFallback, Fuse, Strip in this order,
// each optional, Strip only after Fuse (it then acts on the whole text, not on each token); one step may stand
// alone instead of in a Sequence.
struct DecoderSteps {
  bool byte_level = false;
  std::vector<std::pair<std::string, std::string>> replacements;  // pattern -> content, in order
  bool byte_fallback = false;
  std::string strip_content;
  size_t strip_start = 0, strip_stop = 0;
};

DecoderSteps ReadDecoder(const Any& value) {
  const std::string supported =
      "only ByteLevel, or Replace on a string, ByteFallback, Fuse and Strip in this order, Strip after Fuse";
  DecoderSteps result;
  if (value == nullptr) Refuse("decoder", value, supported);
  json::Object decoder = AsObject(value, "decoder");
  std::string type = TypeOf(decoder, "decoder");
  if (type == "ByteLevel") {
    result.byte_level = true;
    return result;
  }
  bool sequence = type == "Sequence";
  json::Array steps = sequence ? AsArray(Field(decoder, "decoders"), "decoder.decoders") : json::Array{value};
  enum Stage { kReplace, kByteFallback, kFuse, kStrip };
  int stage = kReplace;
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string where = sequence ? "decoder.decoders[" + std::to_string(i) + "]" : std::string("decoder");
    json::Object step = AsObject(steps[i], where);
    std::string step_type = TypeOf(step, where);
    int step_stage = step_type == "Replace" ? kReplace : step_type == "ByteFallback" ? kByteFallback
                     : step_type == "Fuse"  ? kFuse    : step_type == "Strip"        ? kStrip
                                                                                     : -1;
    if (step_stage < 0 || step_stage < stage || (step_stage != kReplace && step_stage == stage) ||
        (step_stage == kStrip && stage != kFuse)) {
      Refuse(where + ".type", Field(step, "type"), supported);
    }
    stage = step_stage;
    if (step_stage == kReplace) {
      std::string pattern = StringPattern(step, where);
      if (pattern.empty()) Refuse(where + ".pattern", Field(step, "pattern"), "only a non-empty string");
      result.replacements.emplace_back(pattern, AsString(Field(step, "content"), where + ".content"));
    } else if (step_stage == kByteFallback) {
      result.byte_fallback = true;
    } else if (step_stage == kStrip) {
      result.strip_content = OneCharacter(Field(step, "content"), where + ".content");
      result.strip_start = AsId(Field(step, "start"), where + ".start");
      result.strip_stop = AsId(Field(step, "stop"), where + ".stop");
    }
  }
  return result;
}

// The decoder on one token, before Strip: ByteLevel's bytes, or the token with the replacements made and, under
// ByteFallback, "<0xXX>" read as that byte.
std::string DecodeToken(const DecoderSteps& decoder, const std::string& token) {
  if (decoder.byte_level) return DecodeByteLevel(token);
  std::string text = token;
  for (const auto& [pattern, content] : decoder.replacements) text = ReplaceAll(text, pattern, content);
  if (decoder.byte_fallback && text.size() == 6 && text.compare(0, 3, "<0x") == 0 && text[5] == '>' &&
      std::isxdigit(static_cast<unsigned char>(text[3])) && std::isxdigit(static_cast<unsigned char>(text[4]))) {
    return std::string(1, static_cast<char>(std::stoi(text.substr(3, 2), nullptr, 16)));
  }
  return text;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// BpeTokenizer

std::unique_ptr<BpeTokenizer> BpeTokenizer::FromFile(const std::string& path, std::string* error) {
  std::unique_ptr<BpeTokenizer> tokenizer(new BpeTokenizer());
  std::string problem = tokenizer->Load(path);
  if (problem.empty()) return tokenizer;
  if (error != nullptr) *error = problem;
  return nullptr;
}

std::string BpeTokenizer::Load(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return "cannot open tokenizer file " + path + ": " + std::strerror(errno);
  std::stringstream contents;
  contents << file.rdbuf();
  try {
    LoadJson(contents.str());
    return "";
  } catch (const LoadError& e) {
    return path + ": " + e.message;
  } catch (const std::exception& e) {  // tvm-ffi's errors, or bad_alloc
    std::string what = e.what();
    return path + ": " + what.substr(0, what.find('\n'));
  }
}

void BpeTokenizer::LoadJson(const std::string& text) {
  String parse_error;
  Any root_value = json::Parse(String(text), &parse_error);
  if (!parse_error.empty()) throw LoadError{"not a JSON file (" + std::string(parse_error) + ")"};
  json::Object root = AsObject(root_value, "the file");

  json::Object model = AsObject(Field(root, "model"), "model");
  if (Field(model, "type").as<String>().value_or("") != "BPE") Refuse("model.type", Field(model, "type"), "only BPE");
  if (Field(model, "dropout") != nullptr) Refuse("model.dropout", Field(model, "dropout"), "only null");
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    Any value = Field(model, affix);
    if (value != nullptr && value.as<String>().value_or("x") != "") {
      Refuse(std::string("model.") + affix, value, "only null or empty");
    }
  }
  ignore_merges_ = BoolField(model, "ignore_merges", "model", false);
  fuse_unk_ = BoolField(model, "fuse_unk", "model", false);
  bool byte_fallback = BoolField(model, "byte_fallback", "model", false);

  int32_t max_id = -1;
  json::Object vocab = AsObject(Field(model, "vocab"), "model.vocab");
  for (const auto& [token, id] : vocab) {
    std::string token_text = AsString(token, "model.vocab key");
    int32_t token_id = AsId(id, "model.vocab[" + Describe(token) + "]");
    vocab_.emplace(token_text, token_id);
    max_id = std::max(max_id, token_id);
    std::vector<CodePoint> code_points = DecodeUtf8(token_text);
    if (code_points.size() == 2) char_ids_.emplace(code_points[0].value, token_id);
  }
  auto vocab_id = [&](const std::string& token, const std::string& where) {
    auto found = vocab_.find(token);
    if (found == vocab_.end()) throw LoadError{where + ": \"" + token + "\" is not in model.vocab"};
    return found->second;
  };
  for (int byte = 0; byte < 256; ++byte) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", byte);
    auto found = vocab_.find(name);
    byte_fallback_ids_[byte] = byte_fallback && found != vocab_.end() ? found->second : -1;
  }

  Any unknown = Field(model, "unk_token");
  if (unknown != nullptr) unknown_id_ = vocab_id(AsString(unknown, "model.unk_token"), "model.unk_token");

  json::Array merges = AsArray(Field(model, "merges"), "model.merges");
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string where = "model.merges[" + std::to_string(rank) + "]";
    std::string left, right;
    if (auto pair = merges[rank].as<json::Array>()) {  // ["a", "b"]
      if (pair->size() != 2) throw LoadError{where + " is not a pair: " + Describe(merges[rank])};
      left = AsString((*pair)[0], where);
      right = AsString((*pair)[1], where);
    } else {  // "a b"
      std::string merge = AsString(merges[rank], where);
      size_t space = merge.find(' ');
      if (space == std::string::npos) throw LoadError{where + " is not \"left right\": " + merge};
      left = merge.substr(0, space);
      right = merge.substr(space + 1);
    }
    uint64_t key = (uint64_t{static_cast<uint32_t>(vocab_id(left, where))} << 32) |
                   static_cast<uint32_t>(vocab_id(right, where));
    // A repeated pair keeps its first (lowest) rank, as in tokenizers.
    merges_.emplace(key, Merge{static_cast<int32_t>(rank), vocab_id(left + right, where)});
  }

  ReadNormalizer(Field(root, "normalizer"), "normalizer", &normalizer_);
  pre_tokenizer_ = ReadPreTokenizer(Field(root, "pre_tokenizer"));
  DecoderSteps decoder = ReadDecoder(Field(root, "decoder"));
  strip_content_ = decoder.strip_content;
  strip_start_ = decoder.strip_start;
  strip_stop_ = decoder.strip_stop;

  struct AddedTokenEntry {
    std::string content;
    int32_t id;
    bool special;
  };
  std::vector<AddedTokenEntry> added_entries;
  Any added_value = Field(root, "added_tokens");
  json::Array added_tokens = added_value == nullptr ? json::Array() : AsArray(added_value, "added_tokens");
  for (size_t i = 0; i < added_tokens.size(); ++i) {
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    json::Object added = AsObject(added_tokens[i], where);
    AddedTokenEntry entry{AsString(Field(added, "content"), where + ".content"),
                          AsId(Field(added, "id"), where + ".id"), BoolField(added, "special", where, false)};
    if (BoolField(added, "single_word", where, false)) {
      Refuse(where + ".single_word", Field(added, "single_word"),
             "only false; the token is " + Describe(Field(added, "content")));
    }
    added_token_ids_[entry.content] = entry.id;
    max_id = std::max(max_id, entry.id);
    added_entries.push_back(entry);
    if (entry.content.empty()) continue;
    bool lstrip = BoolField(added, "lstrip", where, false), rstrip = BoolField(added, "rstrip", where, false);
    // tokenizers matches a normalized added token in the normalized text, so normalizes its content too.
    if (BoolField(added, "normalized", where, !entry.special)) {
      normalized_added_tokens_.push_back({Normalize(entry.content), entry.id, lstrip, rstrip});
    } else {
      raw_added_tokens_.push_back({entry.content, entry.id, lstrip, rstrip});
    }
  }
  for (auto* tokens : {&raw_added_tokens_, &normalized_added_tokens_}) {
    std::stable_sort(tokens->begin(), tokens->end(),
                     [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  }

  token_bytes_.assign(max_id + 1, std::string());
  is_special_.assign(max_id + 1, false);
  for (const auto& [token, id] : vocab_) token_bytes_[id] = DecodeToken(decoder, token);
  // An added token's text wins over a vocabulary entry with the same id, as in tokenizers' id_to_token.
  for (const AddedTokenEntry& entry : added_entries) {
    token_bytes_[entry.id] = DecodeToken(decoder, entry.content);
    is_special_[entry.id] = is_special_[entry.id] || entry.special;
  }
}

template <typename OnText>
void BpeTokenizer::SplitOnAddedTokens(std::string_view text, const std::vector<AddedToken>& tokens,
                                      std::vector<int32_t>* ids, OnText on_text) const {
  // White_Space, as Rust's char::is_whitespace that tokenizers strips with.
  auto space_at = [&](size_t i) {
    std::vector<CodePoint> code_point = DecodeUtf8(text.substr(i, std::min<size_t>(4, text.size() - i)));
    return Classify(code_point[0].value) == CharClass::kSpace ? code_point[1].offset : 0;
  };
  auto space_before = [&](size_t i) {  // the length of the whitespace character ending at i, or 0
    for (size_t length = 1; length <= std::min<size_t>(4, i); ++length) {
      if ((static_cast<unsigned char>(text[i - length]) & 0xC0) != 0x80) {
        return space_at(i - length) == length ? length : 0;
      }
    }
    return size_t{0};
  };
  size_t text_start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    // The tokens are sorted longest first: the first one found at i is the longest.
    auto match = std::find_if(tokens.begin(), tokens.end(),
                              [&](const AddedToken& t) { return text.compare(i, t.content.size(), t.content) == 0; });
    if (match == tokens.end()) continue;
    size_t start = i, stop = i + match->content.size();
    if (match->lstrip) {
      while (start > text_start && space_before(start) != 0) start -= space_before(start);
    }
    if (match->rstrip) {
      while (stop < text.size() && space_at(stop) != 0) stop += space_at(stop);
    }
    if (start > text_start) on_text(text.substr(text_start, start - text_start), text_start);
    ids->push_back(match->id);
    // The next match is looked for after the token itself, as tokenizers does, but text resumes after the stripped
    // whitespace.
    i += match->content.size() - 1;
    text_start = std::max(text_start, stop);
  }
  if (text_start < text.size()) on_text(text.substr(text_start), text_start);
}

std::string BpeTokenizer::Normalize(std::string_view text) const {
  std::string normalized(text);
  for (const NormalizerStep& step : normalizer_) {
    switch (step.kind) {
      case NormalizerStep::Kind::kNfc:
        normalized = Nfc(normalized);
        break;
      case NormalizerStep::Kind::kPrepend:
        if (!normalized.empty()) normalized.insert(0, step.content);
        break;
      case NormalizerStep::Kind::kReplace:
        normalized = ReplaceAll(normalized, step.pattern, step.content);
        break;
    }
  }
  return normalized;
}

std::vector<int32_t> BpeTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  SplitOnAddedTokens(text, raw_added_tokens_, &ids, [&](std::string_view raw_text, size_t raw_offset) {
    std::string normalized = Normalize(raw_text);
    SplitOnAddedTokens(normalized, normalized_added_tokens_, &ids, [&](std::string_view plain_text, size_t offset) {
      EncodePlainText(plain_text, raw_offset == 0 && offset == 0, &ids);
    });
  });
  return ids;
}

void BpeTokenizer::EncodePlainText(std::string_view text, bool at_start, std::vector<int32_t>* ids) const {
  using Kind = PreTokenizer::Kind;
  const std::string& delimiter = pre_tokenizer_.string;
  switch (pre_tokenizer_.kind) {
    case Kind::kNone:
      EncodeWord(text, ids);
      return;
    case Kind::kSplitAfterString:  // each delimiter ends a word
      for (size_t start = 0; start < text.size();) {
        size_t found = text.find(delimiter, start);
        size_t end = found == std::string_view::npos ? text.size() : found + delimiter.size();
        EncodeWord(text.substr(start, end - start), ids);
        start = end;
      }
      return;
    case Kind::kMetaspace: {
      using Scheme = PreTokenizer::PrependScheme;
      std::string replaced = ReplaceAll(text, " ", delimiter);
      bool prepend = pre_tokenizer_.prepend_scheme == Scheme::kAlways ||
                     (pre_tokenizer_.prepend_scheme == Scheme::kFirst && at_start);
      if (prepend && !replaced.empty() && replaced.compare(0, delimiter.size(), delimiter) != 0) {
        replaced.insert(0, delimiter);
      }
      if (!pre_tokenizer_.split) {
        EncodeWord(replaced, ids);
        return;
      }
      // Each replacement starts a word.
      std::string_view words = replaced;
      for (size_t start = 0; start < words.size();) {
        size_t end = words.find(delimiter, start + 1);
        if (end == std::string_view::npos) end = words.size();
        EncodeWord(words.substr(start, end - start), ids);
        start = end;
      }
      return;
    }
    case Kind::kGpt2:
    case Kind::kLlama3:
    case Kind::kQwen2:
      break;
  }
  std::vector<CodePoint> code_points = DecodeUtf8(text);
  PatternMatcher matcher(code_points);
  size_t count = code_points.size() - 1;
  for (size_t start = 0; start < count;) {
    size_t end = pre_tokenizer_.kind == Kind::kGpt2     ? matcher.MatchGpt2(start)
                 : pre_tokenizer_.kind == Kind::kLlama3 ? matcher.MatchLlama3(start, 3)
                                                        : matcher.MatchLlama3(start, 1);
    size_t offset = code_points[start].offset;
    EncodeWord(text.substr(offset, code_points[end].offset - offset), ids);
    start = end;
  }
}

void BpeTokenizer::EncodeWord(std::string_view word, std::vector<int32_t>* ids) const {
  // The word's characters as the vocabulary spells them: for byte-level pre-tokenizers, one symbol of the GPT-2
  // alphabet per byte.
  std::vector<char32_t> characters;
  if (pre_tokenizer_.ByteLevel()) {
    static const std::vector<char32_t> byte_to_code_point = ByteToCodePoint();
    for (unsigned char byte : word) characters.push_back(byte_to_code_point[byte]);
  } else {
    std::vector<CodePoint> code_points = DecodeUtf8(word);
    for (size_t i = 0; i + 1 < code_points.size(); ++i) characters.push_back(code_points[i].value);
  }
  if (ignore_merges_) {
    std::string spelled;
    for (char32_t character : characters) AppendUtf8(character, &spelled);
    auto whole = vocab_.find(spelled);
    if (whole != vocab_.end()) {
      ids->push_back(whole->second);
      return;
    }
  }
  // The symbols as a doubly linked list; a merged-away symbol gets id -1.
  struct Symbol {
    int32_t id;
    int prev, next;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(characters.size());
  auto add_symbol = [&](int32_t id) {
    int index = static_cast<int>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  };
  // A character missing from the vocabulary: its bytes' <0xXX> tokens under byte_fallback when all exist, else the
  // unk token (one for a run of them under fuse_unk), else nothing. As in tokenizers, a pending unk token is added
  // when a known character follows (or at the end), after byte tokens that came in between.
  bool unknown_pending = false;
  for (char32_t character : characters) {
    auto found = char_ids_.find(character);
    if (found != char_ids_.end()) {
      if (unknown_pending) add_symbol(unknown_id_);
      unknown_pending = false;
      add_symbol(found->second);
      continue;
    }
    std::string bytes;
    AppendUtf8(character, &bytes);
    bool all_bytes = std::all_of(bytes.begin(), bytes.end(),
                                 [&](char byte) { return byte_fallback_ids_[static_cast<unsigned char>(byte)] >= 0; });
    if (all_bytes) {
      for (unsigned char byte : bytes) add_symbol(byte_fallback_ids_[byte]);
    } else if (unknown_id_ >= 0) {
      if (unknown_pending && !fuse_unk_) add_symbol(unknown_id_);
      unknown_pending = true;
    }
  }
  if (unknown_pending) add_symbol(unknown_id_);
  if (symbols.empty()) return;
  symbols.back().next = -1;

  // Candidate merges, lowest rank first, then leftmost; checked when popped, since merges around them may have
  // changed their pair since (the same check as tokenizers', on the merged id).
  struct Candidate {
    int32_t rank;
    int position;
    int32_t merged_id;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto find_merge = [&](int left) -> const Merge* {
    int right = symbols[left].next;
    if (right < 0) return nullptr;
    uint64_t key = (uint64_t{static_cast<uint32_t>(symbols[left].id)} << 32) |
                   static_cast<uint32_t>(symbols[right].id);
    auto found = merges_.find(key);
    return found == merges_.end() ? nullptr : &found->second;
  };
  auto push_candidate = [&](int left) {
    if (const Merge* merge = find_merge(left)) queue.push({merge->rank, left, merge->merged_id});
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) push_candidate(i);

  while (!queue.empty()) {
    Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.position];
    const Merge* merge = left.id < 0 ? nullptr : find_merge(top.position);
    if (merge == nullptr || merge->merged_id != top.merged_id) continue;
    int right = left.next;
    left.id = top.merged_id;
    left.next = symbols[right].next;
    symbols[right].id = -1;
    if (left.next >= 0) symbols[left.next].prev = top.position;
    if (left.prev >= 0) push_candidate(left.prev);
    push_candidate(top.position);
  }
  for (int i = 0; i >= 0; i = symbols[i].next) ids->push_back(symbols[i].id);
}

std::string BpeTokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string text;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= token_bytes_.size()) continue;
    if (skip_special_tokens && is_special_[id]) continue;
    text += token_bytes_[id];
  }
  // Strip, after Fuse: on the whole text.
  const std::string& strip = strip_content_;
  size_t start = 0, stop = text.size();
  for (size_t n = 0; n < strip_start_ && text.compare(start, strip.size(), strip) == 0; ++n) start += strip.size();
  for (size_t n = 0; n < strip_stop_ && stop >= start + strip.size() &&
                     text.compare(stop - strip.size(), strip.size(), strip) == 0;
       ++n) {
    stop -= strip.size();
  }
  return text.substr(start, stop - start);
}

std::string BpeTokenizer::TokenText(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < token_bytes_.size() ? token_bytes_[id] : std::string();
}

int32_t BpeTokenizer::TokenId(std::string_view token) const {
  std::string key(token);
  auto added = added_token_ids_.find(key);
  if (added != added_token_ids_.end()) return added->second;
  auto found = vocab_.find(key);
  return found == vocab_.end() ? -1 : found->second;
}

size_t BpeTokenizer::VocabSize() const { return token_bytes_.size(); }

}  // namespace mobilec
