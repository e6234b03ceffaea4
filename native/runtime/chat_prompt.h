// chat_prompt.h: one user message's chat prompt from the artifact config's "chat_prompt" entry, which the compiler
// splits out of the model's chat template (compiler/model_import/chat_prompt.py): the text before the message and
// after it, with dates the template asks for kept as strftime formats, and the message as it is or stripped of
// whitespace as Python's str.strip strips it. Renders what compiler/model_import/chat_prompt.py render() gives,
// without a Jinja engine.
#ifndef MOBILEC_NATIVE_RUNTIME_CHAT_PROMPT_H_
#define MOBILEC_NATIVE_RUNTIME_CHAT_PROMPT_H_

#include <tvm/ffi/extra/json.h>

#include <ctime>
#include <string>
#include <vector>

namespace mobilec {

class ChatPrompt {
 public:
  // From an artifact's config object. Never fails: a config without a template, with one the compiler could not
  // split, or with a malformed entry gives a prompt whose Unavailable() says so.
  static ChatPrompt FromConfig(const tvm::ffi::json::Object& config);

  // Empty when Render can be called; else one line saying why not, the same words as `mobilec generate --chat`.
  const std::string& Unavailable() const { return unavailable_; }

  // The prompt for `message`, dates written for local time `now`.
  std::string Render(const std::string& message, std::time_t now) const;

 private:
  struct Piece {
    bool is_date;
    std::string text;  // the text, or the strftime format of a date
  };
  static bool ReadPieces(const tvm::ffi::Any& value, std::vector<Piece>* pieces);
  static std::string Write(const std::vector<Piece>& pieces, const std::tm& moment);

  std::vector<Piece> before_, after_;
  bool strip_ = false;
  std::string unavailable_;
};

// `text` without the leading and trailing characters Python's str.isspace calls whitespace (UTF-8; the Unicode
// spaces U+00A0, U+3000... included); what Jinja's trim filter does.
std::string StripPythonWhitespace(const std::string& text);

}  // namespace mobilec

#endif  // MOBILEC_NATIVE_RUNTIME_CHAT_PROMPT_H_
