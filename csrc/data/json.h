// A small JSON reader (RFC 8259) for configuration files such as tokenizer.json.
//
// It builds a tree of Values; objects keep their members in document order, which is
// what tokenizer.json needs (the order of "merges" and "added_tokens" carries meaning).
// Every syntax error is a JsonError naming the line and column.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace barqtrain::json {

class JsonError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value {
 public:
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;

  Value() = default;
  explicit Value(bool value) : data_(value) {}
  explicit Value(double value) : data_(value) {}
  explicit Value(std::string value) : data_(std::move(value)) {}
  explicit Value(Array value) : data_(std::move(value)) {}
  explicit Value(Object value) : data_(std::move(value)) {}

  bool is_null() const { return std::holds_alternative<std::nullptr_t>(data_); }
  bool is_bool() const { return std::holds_alternative<bool>(data_); }
  bool is_number() const { return std::holds_alternative<double>(data_); }
  bool is_string() const { return std::holds_alternative<std::string>(data_); }
  bool is_array() const { return std::holds_alternative<Array>(data_); }
  bool is_object() const { return std::holds_alternative<Object>(data_); }

  // "null", "boolean", "number", "string", "array" or "object", for error messages.
  const char* type_name() const;

  // Typed access; each throws JsonError naming the expected and the actual type.
  bool as_bool() const;
  double as_number() const;
  int64_t as_integer() const;  // also throws when the number is not a whole number
  const std::string& as_string() const;
  const Array& as_array() const;
  const Object& as_object() const;

  // The member named key of an object, or nullptr when this is not an object or has no
  // such member.
  const Value* find(std::string_view key) const;

 private:
  std::variant<std::nullptr_t, bool, double, std::string, Array, Object> data_;
};

// Parses one JSON document; trailing non-whitespace is an error.
Value parse(std::string_view text);

// Reads and parses a file; a file that cannot be read is a JsonError naming its path.
Value parse_file(const std::string& path);

}  // namespace barqtrain::json
