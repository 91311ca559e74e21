// Reading tokenizer.json components: their type, their boolean options, and the error for
// a feature the tokenizer does not implement.
#pragma once

#include <string>

#include "data/json.h"
#include "data/tokenizer/error.h"

namespace barqtrain::tokenizer {

// The "type" of a component, or "(no type)".
inline std::string type_of(const json::Value& component) {
  const json::Value* type = component.find("type");
  return type && type->is_string() ? type->as_string() : "(no type)";
}

// The boolean option name of a component, or fallback when it is absent or null.
inline bool flag(const json::Value& component, const char* name, bool fallback) {
  const json::Value* value = component.find(name);
  return value && !value->is_null() ? value->as_bool() : fallback;
}

[[noreturn]] inline void unsupported(const std::string& what) {
  throw TokenizerError("unsupported tokenizer.json feature: " + what);
}

}  // namespace barqtrain::tokenizer
