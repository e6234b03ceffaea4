// chat_prompt.cc: see chat_prompt.h.
#include "chat_prompt.h"

#include <cstdint>

namespace mobilec {

namespace ffi = tvm::ffi;
namespace json = tvm::ffi::json;

namespace {

// The code points Python's str.isspace accepts (Unicode White_Space plus the ASCII separators 0x1C-0x1F).
bool IsPythonSpace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// The code point of the valid UTF-8 sequence of `length` bytes at `p`, or UINT32_MAX.
uint32_t Decode(const unsigned char* p, size_t length) {
  static const unsigned char kLeadMask[] = {0, 0x7F, 0x1F, 0x0F, 0x07};
  uint32_t c = p[0] & kLeadMask[length];
  for (size_t i = 1; i < length; ++i) {
    if ((p[i] & 0xC0) != 0x80) return UINT32_MAX;
    c = (c << 6) | (p[i] & 0x3F);
  }
  return c;
}

size_t SequenceLength(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 0;
}

}  // namespace

std::string StripPythonWhitespace(const std::string& text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  size_t begin = 0, end = text.size();
  while (begin < end) {  // leading whitespace, one code point at a time
    const size_t length = SequenceLength(bytes[begin]);
    if (length == 0 || begin + length > end || !IsPythonSpace(Decode(bytes + begin, length))) break;
    begin += length;
  }
  while (end > begin) {  // trailing: find the start of the last code point (at most 4 bytes back)
    size_t start = end - 1;
    while (start > begin && end - start < 4 && (bytes[start] & 0xC0) == 0x80) --start;
    const size_t length = SequenceLength(bytes[start]);
    if (length != end - start || !IsPythonSpace(Decode(bytes + start, length))) break;
    end = start;
  }
  return text.substr(begin, end - begin);
}

bool ChatPrompt::ReadPieces(const ffi::Any& value, std::vector<Piece>* pieces) {
  auto array = value.as<json::Array>();
  if (!array) return false;
  for (const ffi::Any& item : *array) {
    if (auto text = item.as<ffi::String>()) {
      pieces->push_back({false, std::string(*text)});
      continue;
    }
    auto object = item.as<json::Object>();
    if (!object || object->size() != 1) return false;
    auto format = object->Get(ffi::String("strftime"));
    if (!format || !format->as<ffi::String>()) return false;
    pieces->push_back({true, std::string(format->as<ffi::String>().value())});
  }
  return true;
}

ChatPrompt ChatPrompt::FromConfig(const json::Object& config) {
  static const char kMalformed[] = "the artifact's chat_prompt entry is missing or malformed; recompile the artifact";
  ChatPrompt prompt;
  auto entry = config.Get(ffi::String("chat_prompt"));
  if (!entry) {
    prompt.unavailable_ = kMalformed;
    return prompt;
  }
  if (entry->type_index() == ffi::TypeIndex::kTVMFFINone) {
    prompt.unavailable_ = "this model's tokenizer has no chat template; drop --chat";
    return prompt;
  }
  auto object = entry->as<json::Object>();
  if (!object) {
    prompt.unavailable_ = kMalformed;
    return prompt;
  }
  if (auto why = object->Get(ffi::String("unsupported"))) {
    auto text = why->as<ffi::String>();
    prompt.unavailable_ = object->size() == 1 && text
                              ? "--chat cannot render this model's prompts: " + std::string(*text) +
                                    "; render the prompt with its template yourself and pass it without --chat"
                              : kMalformed;
    return prompt;
  }
  auto before = object->Get(ffi::String("before"));
  auto after = object->Get(ffi::String("after"));
  auto mode = object->Get(ffi::String("message"));
  auto mode_text = mode ? mode->as<ffi::String>() : std::nullopt;
  const bool valid = object->size() == 3 && before && after && mode_text &&
                     (*mode_text == "as-is" || *mode_text == "strip") && ReadPieces(*before, &prompt.before_) &&
                     ReadPieces(*after, &prompt.after_);
  if (!valid) {
    prompt.before_.clear();
    prompt.after_.clear();
    prompt.unavailable_ = kMalformed;
    return prompt;
  }
  prompt.strip_ = *mode_text == "strip";
  return prompt;
}

std::string ChatPrompt::Write(const std::vector<Piece>& pieces, const std::tm& moment) {
  std::string out;
  for (const Piece& piece : pieces) {
    if (!piece.is_date) {
      out += piece.text;
      continue;
    }
    // strftime gives 0 both for an empty result and for a too small buffer: grow until it fits, within reason
    for (size_t size = 64; size <= 4096; size *= 4) {
      std::string buffer(size, '\0');
      const size_t written = std::strftime(buffer.data(), size, piece.text.c_str(), &moment);
      if (written > 0 || piece.text.empty()) {
        out.append(buffer.data(), written);
        break;
      }
    }
  }
  return out;
}

std::string ChatPrompt::Render(const std::string& message, std::time_t now) const {
  std::tm moment{};
  localtime_r(&now, &moment);  // transformers' strftime_now: datetime.now(), local time
  return Write(before_, moment) + (strip_ ? StripPythonWhitespace(message) : message) + Write(after_, moment);
}

}  // namespace mobilec
