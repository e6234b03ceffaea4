// bpe_tokenize_main.cc: a test driver for mobilec::BpeTokenizer (native/runtime/bpe_tokenizer.h).
//
//     bpe_tokenize_main TOKENIZER_JSON < requests
//
// Each stdin line is one JSON request, each answered by one stdout line:
//   "text"                                                  -> [ids of Encode(text)]
//   {"op": "decode", "ids": [...], "skip_special_tokens": b} -> "hex of Decode(ids, b)"
//   {"op": "token_text", "id": n}                            -> "hex of TokenText(n)"
//   {"op": "token_id", "token": "..."}                       -> TokenId(token)
//   {"op": "vocab_size"}                                     -> VocabSize()
// Bytes come back as hex since they need not be UTF-8. If the tokenizer does not load, the error goes to stderr
// and the exit status is 1.
#include <tvm/ffi/extra/json.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "bpe_tokenizer.h"

namespace json = tvm::ffi::json;
using tvm::ffi::Any;
using tvm::ffi::String;

namespace {

std::string Hex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string hex = "\"";
  for (unsigned char byte : bytes) {
    hex += kDigits[byte >> 4];
    hex += kDigits[byte & 15];
  }
  return hex + "\"";
}

std::string IdList(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out + "]";
}

std::string Answer(const mobilec::BpeTokenizer& tokenizer, const Any& request) {
  if (auto text = request.as<String>()) return IdList(tokenizer.Encode(std::string(*text)));
  auto object = request.as<json::Object>().value();
  std::string op = object.at(String("op")).cast<String>();
  if (op == "decode") {
    std::vector<int32_t> ids;
    for (const Any& id : object.at(String("ids")).cast<json::Array>()) ids.push_back(id.cast<int64_t>());
    return Hex(tokenizer.Decode(ids, object.at(String("skip_special_tokens")).cast<bool>()));
  }
  if (op == "token_text") return Hex(tokenizer.TokenText(object.at(String("id")).cast<int64_t>()));
  if (op == "token_id") {
    return std::to_string(tokenizer.TokenId(std::string(object.at(String("token")).cast<String>())));
  }
  if (op == "vocab_size") return std::to_string(tokenizer.VocabSize());
  throw std::runtime_error("unknown op " + op);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: bpe_tokenize_main TOKENIZER_JSON < requests\n";
    return 2;
  }
  std::string error;
  std::unique_ptr<mobilec::BpeTokenizer> tokenizer = mobilec::BpeTokenizer::FromFile(argv[1], &error);
  if (!tokenizer) {
    std::cerr << error << "\n";
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    String parse_error;
    Any request = json::Parse(String(line), &parse_error);
    if (!parse_error.empty()) {
      std::cerr << "bad request line: " << std::string(parse_error) << "\n";
      return 2;
    }
    std::cout << Answer(*tokenizer, request) << "\n";
  }
  return 0;
}
