// UTF-8 and Unicode services for the tokenizer: code point classes for the pre-tokenizer
// scanners, UTF-8 validation and lossy decoding, and NFC normalization.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace barqtrain::tokenizer::unicode {

// The classes the supported split patterns distinguish; every code point is in exactly one.
enum class CodePointClass : uint8_t { kOther, kLetter, kNumber, kWhiteSpace };

CodePointClass classify(char32_t code_point);

// The classes of the ASCII code points, for the scanners' fast path: letters A-Z a-z,
// numbers 0-9, white space \t \n \v \f \r and space (Unicode's White_Space).
inline CodePointClass classify_ascii(unsigned char byte) {
  struct Table {
    CodePointClass classes[128];
    constexpr Table() : classes() {
      for (int b = 0; b < 128; ++b) {
        if ((b >= 'A' && b <= 'Z') || (b >= 'a' && b <= 'z')) classes[b] = CodePointClass::kLetter;
        else if (b >= '0' && b <= '9') classes[b] = CodePointClass::kNumber;
        else if ((b >= '\t' && b <= '\r') || b == ' ') classes[b] = CodePointClass::kWhiteSpace;
        else classes[b] = CodePointClass::kOther;
      }
    }
  };
  static constexpr Table table;
  return table.classes[byte];
}

struct DecodedCodePoint {
  char32_t code_point;
  uint32_t length;  // in bytes
};

// Decodes the code point starting at text[pos]; text must be valid UTF-8.
inline DecodedCodePoint decode_at(std::string_view text, size_t pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data()) + pos;
  if (p[0] < 0x80) return {p[0], 1};
  if (p[0] < 0xE0) return {static_cast<char32_t>(((p[0] & 0x1F) << 6) | (p[1] & 0x3F)), 2};
  if (p[0] < 0xF0) {
    return {static_cast<char32_t>(((p[0] & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F)), 3};
  }
  return {static_cast<char32_t>(((p[0] & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) |
                                (p[3] & 0x3F)),
          4};
}

// The offset of the first byte that is not part of well-formed UTF-8, or text.size().
size_t find_invalid_utf8(std::string_view text);

// Replaces each maximal ill-formed subsequence with U+FFFD, as Python's
// bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy do.
std::string decode_utf8_lossy(std::string_view bytes);

// Appends the NFC normalization of text (valid UTF-8) to out. With changes, also appends
// one entry per code point appended, as Hugging Face's NFC reports them for alignment: 0
// replaces the next input character, -n replaces it and drops the n after it, +1 inserts.
void append_nfc(std::string_view text, std::string& out, std::vector<int32_t>* changes = nullptr);

}  // namespace barqtrain::tokenizer::unicode
