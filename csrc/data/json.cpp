#include "data/json.h"

#include "data/utf8.h"

#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

namespace barqtrain::json {
namespace {

// Deeper documents are rejected instead of exhausting the stack.
constexpr int kMaxDepth = 512;

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Value parse_document() {
    skip_whitespace();
    Value value = parse_value(0);
    skip_whitespace();
    if (pos_ != text_.size()) fail("unexpected text after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    size_t line = 1, column = 1;
    for (size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw JsonError("JSON syntax error at line " + std::to_string(line) + ", column " +
                    std::to_string(column) + ": " + what);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }

  void skip_whitespace() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }

  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  void expect_word(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail("invalid literal");
    pos_ += word.size();
  }

  Value parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    switch (peek()) {
      case '{': return parse_object(depth);
      case '[': return parse_array(depth);
      case '"': return Value(parse_string());
      case 't': expect_word("true"); return Value(true);
      case 'f': expect_word("false"); return Value(false);
      case 'n': expect_word("null"); return Value();
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return Value(parse_number());
        fail(at_end() ? "unexpected end of input" : "expected a JSON value");
    }
  }

  Value parse_object(int depth) {
    expect('{');
    Value::Object members;
    skip_whitespace();
    if (peek() == '}') {
      ++pos_;
      return Value(std::move(members));
    }
    while (true) {
      skip_whitespace();
      if (peek() != '"') fail("expected a string as object key");
      std::string key = parse_string();
      skip_whitespace();
      expect(':');
      skip_whitespace();
      members.emplace_back(std::move(key), parse_value(depth + 1));
      skip_whitespace();
      if (peek() == '}') {
        ++pos_;
        return Value(std::move(members));
      }
      if (peek() != ',') fail("expected ',' or '}' in object");
      ++pos_;
    }
  }

  Value parse_array(int depth) {
    expect('[');
    Value::Array elements;
    skip_whitespace();
    if (peek() == ']') {
      ++pos_;
      return Value(std::move(elements));
    }
    while (true) {
      skip_whitespace();
      elements.push_back(parse_value(depth + 1));
      skip_whitespace();
      if (peek() == ']') {
        ++pos_;
        return Value(std::move(elements));
      }
      if (peek() != ',') fail("expected ',' or ']' in array");
      ++pos_;
    }
  }

  double parse_number() {
    // Validate the JSON grammar first: from_chars accepts forms JSON does not ("inf", "1.").
    const size_t start = pos_;
    auto digits = [&] {
      const size_t first = pos_;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
      if (pos_ == first) fail("expected a digit");
    };
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else {
      digits();
    }
    if (peek() == '.') {
      ++pos_;
      digits();
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      digits();
    }
    double value = 0;
    const auto [end, error] = std::from_chars(text_.data() + start, text_.data() + pos_, value);
    if (error != std::errc() || end != text_.data() + pos_) fail("number out of range");
    return value;
  }

  unsigned parse_hex4() {
    unsigned value = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      const char c = peek();
      value <<= 4;
      if (c >= '0' && c <= '9') value |= c - '0';
      else if (c >= 'a' && c <= 'f') value |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') value |= c - 'A' + 10;
      else fail("expected four hexadecimal digits after \\u");
    }
    return value;
  }

  // Copies one raw UTF-8 sequence, rejecting malformed ones (JSON text is UTF-8).
  void copy_utf8_sequence(std::string& out) {
    const auto lead = static_cast<unsigned char>(peek());
    int length = 0;
    char32_t min = 0;
    if (lead >= 0xC2 && lead <= 0xDF) length = 2, min = 0x80;
    else if (lead >= 0xE0 && lead <= 0xEF) length = 3, min = 0x800;
    else if (lead >= 0xF0 && lead <= 0xF4) length = 4, min = 0x10000;
    else fail("invalid UTF-8 in string");
    char32_t cp = lead & (0x3F >> (length - 1));
    for (int i = 1; i < length; ++i) {
      if (pos_ + i >= text_.size()) fail("invalid UTF-8 in string");
      const auto next = static_cast<unsigned char>(text_[pos_ + i]);
      if ((next & 0xC0) != 0x80) fail("invalid UTF-8 in string");
      cp = (cp << 6) | (next & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) fail("invalid UTF-8 in string");
    out.append(text_.data() + pos_, length);
    pos_ += length;
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const char c = peek();
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (static_cast<unsigned char>(c) >= 0x80) {
        copy_utf8_sequence(out);
        continue;
      }
      ++pos_;
      if (c != '\\') {
        out += c;
        continue;
      }
      const char escape = peek();
      ++pos_;
      switch (escape) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          char32_t cp = parse_hex4();
          if (cp >= 0xDC00 && cp < 0xE000) fail("unpaired low surrogate in \\u escape");
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (text_.substr(pos_, 2) != "\\u") fail("unpaired high surrogate in \\u escape");
            pos_ += 2;
            const char32_t low = parse_hex4();
            if (low < 0xDC00 || low >= 0xE000) fail("unpaired high surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          utf8::append(out, cp);
          break;
        }
        default:
          --pos_;
          fail("invalid escape in string");
      }
    }
  }

  std::string_view text_;
  size_t pos_ = 0;
};

[[noreturn]] void wrong_type(const char* expected, const Value& value) {
  throw JsonError(std::string("expected a JSON ") + expected + ", found " + value.type_name());
}

}  // namespace

const char* Value::type_name() const {
  static constexpr const char* kNames[] = {"null", "boolean", "number", "string", "array", "object"};
  return kNames[data_.index()];
}

bool Value::as_bool() const {
  if (!is_bool()) wrong_type("boolean", *this);
  return std::get<bool>(data_);
}

double Value::as_number() const {
  if (!is_number()) wrong_type("number", *this);
  return std::get<double>(data_);
}

int64_t Value::as_integer() const {
  const double number = as_number();
  if (number != std::trunc(number) || std::fabs(number) > 9007199254740992.0) {
    throw JsonError("expected a JSON integer, found " + std::to_string(number));
  }
  return static_cast<int64_t>(number);
}

const std::string& Value::as_string() const {
  if (!is_string()) wrong_type("string", *this);
  return std::get<std::string>(data_);
}

const Value::Array& Value::as_array() const {
  if (!is_array()) wrong_type("array", *this);
  return std::get<Array>(data_);
}

const Value::Object& Value::as_object() const {
  if (!is_object()) wrong_type("object", *this);
  return std::get<Object>(data_);
}

const Value* Value::find(std::string_view key) const {
  if (!is_object()) return nullptr;
  for (const auto& [name, value] : std::get<Object>(data_)) {
    if (name == key) return &value;
  }
  return nullptr;
}

Value parse(std::string_view text) { return Parser(text).parse_document(); }

Value parse_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw JsonError("cannot open " + path);
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) throw JsonError("cannot read " + path);
  try {
    return parse(contents.str());
  } catch (const JsonError& error) {
    throw JsonError(path + ": " + error.what());
  }
}

}  // namespace barqtrain::json
