// libFuzzer target: the JSON parser either parses the input or throws JsonError, and
// never crashes, hangs or trips a sanitizer.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "data/json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const barqtrain::json::Value value = barqtrain::json::parse(text);
    // Walk what was parsed through the accessors the tokenizer loader uses.
    if (value.is_object()) {
      for (const auto& [key, member] : value.as_object()) (void)value.find(key), (void)member.is_string();
    } else if (value.is_array()) {
      for (const auto& item : value.as_array()) (void)item.is_null();
    }
  } catch (const barqtrain::json::JsonError&) {
  }
  return 0;
}
