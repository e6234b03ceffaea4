// chat_prompt_main.cc: a test driver for mobilec::ChatPrompt (native/runtime/chat_prompt.h).
//
//     chat_prompt_main CONFIG_JSON < requests
//
// CONFIG_JSON is an artifact config (at least its "chat_prompt" entry). Each stdin line is one JSON request
// {"message": "...", "now": seconds since the epoch}, answered by one stdout line: the hex of the rendered prompt,
// or "unavailable: " and the reason.
#include <tvm/ffi/extra/json.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "chat_prompt.h"

namespace json = tvm::ffi::json;
using tvm::ffi::String;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: chat_prompt_main CONFIG_JSON < requests\n";
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const auto config = json::Parse(text.str()).cast<json::Object>();
  const mobilec::ChatPrompt prompt = mobilec::ChatPrompt::FromConfig(config);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (!prompt.Unavailable().empty()) {
      std::cout << "unavailable: " << prompt.Unavailable() << "\n";
      continue;
    }
    const auto request = json::Parse(line).cast<json::Object>();
    const std::string message = request.at(String("message")).cast<String>();
    const std::string rendered = prompt.Render(message, request.at(String("now")).cast<int64_t>());
    static const char kDigits[] = "0123456789abcdef";
    for (unsigned char byte : rendered) std::cout << kDigits[byte >> 4] << kDigits[byte & 15];
    std::cout << "\n";
  }
  return 0;
}
