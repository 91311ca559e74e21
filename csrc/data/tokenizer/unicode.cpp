#include "data/tokenizer/unicode.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "data/tokenizer/unicode_tables.h"
#include "data/utf8.h"

namespace barqtrain::tokenizer::unicode {
namespace {

namespace tables = unicode_tables;

template <size_t N>
bool in_ranges(const tables::CodePointRange (&ranges)[N], char32_t code_point) {
  const auto* it = std::upper_bound(std::begin(ranges), std::end(ranges), code_point,
                                    [](char32_t cp, const tables::CodePointRange& r) { return cp < r.first; });
  return it != std::begin(ranges) && code_point <= (it - 1)->last;
}

CodePointClass classify_slow(char32_t code_point) {
  if (in_ranges(tables::kLetters, code_point)) return CodePointClass::kLetter;
  if (in_ranges(tables::kNumbers, code_point)) return CodePointClass::kNumber;
  if (in_ranges(tables::kWhiteSpace, code_point)) return CodePointClass::kWhiteSpace;
  return CodePointClass::kOther;
}

// The Basic Multilingual Plane holds nearly all text: look it up in one flat table.
const std::array<CodePointClass, 0x10000>& bmp_classes() {
  static const auto* const table = [] {
    auto* classes = new std::array<CodePointClass, 0x10000>;
    for (char32_t cp = 0; cp < 0x10000; ++cp) (*classes)[cp] = classify_slow(cp);
    return classes;
  }();
  return *table;
}

// ---------------------------------------------------------------- NFC (UAX #15)

constexpr char32_t kHangulSBase = 0xAC00, kHangulLBase = 0x1100, kHangulVBase = 0x1161,
                   kHangulTBase = 0x11A7;
constexpr char32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr char32_t kHangulNCount = kHangulVCount * kHangulTCount;
constexpr char32_t kHangulSCount = kHangulLCount * kHangulNCount;

uint8_t combining_class_slow(char32_t code_point) {
  const auto* it = std::lower_bound(
      std::begin(tables::kCombiningClasses), std::end(tables::kCombiningClasses), code_point,
      [](const tables::CombiningClass& entry, char32_t cp) { return entry.code_point < cp; });
  return it != std::end(tables::kCombiningClasses) && it->code_point == code_point ? it->value : 0;
}

// What NFC asks of each Basic Multilingual Plane character, in flat tables: scripts whose
// vowel signs and marks may compose (Indic, Arabic, Hebrew, Korean jamo) ask for nearly
// every character, and a binary search per question cost more than the rest of encoding.
struct BmpNfcFacts {
  static constexpr uint8_t kUnstable = 1;        // NFC_Quick_Check is No or Maybe
  static constexpr uint8_t kDecomposes = 2;      // has a canonical decomposition
  static constexpr uint8_t kSecondOfPair = 4;    // is the second character of some composition
  std::array<uint8_t, 0x10000> combining_class;
  std::array<uint8_t, 0x10000> flags;
};

const BmpNfcFacts& bmp_nfc_facts() {
  static const auto* const facts = [] {
    auto* table = new BmpNfcFacts{};
    for (const auto& entry : tables::kCombiningClasses) {
      if (entry.code_point < 0x10000) table->combining_class[entry.code_point] = entry.value;
    }
    for (const auto& range : tables::kNfcUnstable) {
      for (char32_t cp = range.first; cp <= range.last && cp < 0x10000; ++cp) table->flags[cp] |= BmpNfcFacts::kUnstable;
    }
    for (const auto& entry : tables::kDecompositions) {
      if (entry.code_point < 0x10000) table->flags[entry.code_point] |= BmpNfcFacts::kDecomposes;
    }
    for (const auto& entry : tables::kCompositions) {
      if (entry.second < 0x10000) table->flags[entry.second] |= BmpNfcFacts::kSecondOfPair;
    }
    return table;
  }();
  return *facts;
}

uint8_t combining_class(char32_t code_point) {
  return code_point < 0x10000 ? bmp_nfc_facts().combining_class[code_point] : combining_class_slow(code_point);
}

bool has_flag(char32_t code_point, uint8_t flag) {
  return code_point >= 0x10000 || (bmp_nfc_facts().flags[code_point] & flag) != 0;
}

// A character of a segment being normalized, with its alignment change (see append_nfc).
struct ChangedChar {
  char32_t code_point;
  int32_t change;
};

// Appends the canonical decomposition of code_point: its first character replaces it
// (change 0), the others are insertions (+1).
void decompose(char32_t code_point, std::vector<ChangedChar>& out, bool first = true) {
  if (code_point >= kHangulSBase && code_point < kHangulSBase + kHangulSCount) {
    const char32_t index = code_point - kHangulSBase;
    out.push_back({kHangulLBase + index / kHangulNCount, first ? 0 : 1});
    out.push_back({kHangulVBase + (index % kHangulNCount) / kHangulTCount, 1});
    if (index % kHangulTCount != 0) out.push_back({kHangulTBase + index % kHangulTCount, 1});
    return;
  }
  if (!has_flag(code_point, BmpNfcFacts::kDecomposes)) {
    out.push_back({code_point, first ? 0 : 1});
    return;
  }
  const auto* it = std::lower_bound(
      std::begin(tables::kDecompositions), std::end(tables::kDecompositions), code_point,
      [](const tables::Decomposition& entry, char32_t cp) { return entry.code_point < cp; });
  if (it == std::end(tables::kDecompositions) || it->code_point != code_point) {
    out.push_back({code_point, first ? 0 : 1});
    return;
  }
  decompose(it->first, out, first);
  if (it->second != 0) decompose(it->second, out, false);
}

// The primary composite of (first, second), or 0 when they do not compose.
char32_t compose(char32_t first, char32_t second) {
  if (first >= kHangulLBase && first < kHangulLBase + kHangulLCount && second >= kHangulVBase &&
      second < kHangulVBase + kHangulVCount) {
    return kHangulSBase + ((first - kHangulLBase) * kHangulVCount + (second - kHangulVBase)) * kHangulTCount;
  }
  if (first >= kHangulSBase && first < kHangulSBase + kHangulSCount && (first - kHangulSBase) % kHangulTCount == 0 &&
      second > kHangulTBase && second < kHangulTBase + kHangulTCount) {
    return first + (second - kHangulTBase);
  }
  if (!has_flag(second, BmpNfcFacts::kSecondOfPair)) return 0;
  const auto* it = std::lower_bound(std::begin(tables::kCompositions), std::end(tables::kCompositions),
                                    std::make_pair(first, second),
                                    [](const tables::Composition& entry, std::pair<char32_t, char32_t> key) {
                                      return std::make_pair(entry.first, entry.second) < key;
                                    });
  return it != std::end(tables::kCompositions) && it->first == first && it->second == second ? it->composite
                                                                                            : 0;
}

// Full NFC of a segment: canonical decomposition, canonical ordering, canonical composition.
// Changes travel with their characters through the reordering, and a composite takes
// change(starter) + change(mark) - 1, as in the unicode-normalization crate behind
// Hugging Face tokenizers.
void append_nfc_segment(std::string_view segment, std::string& out, std::vector<int32_t>* changes) {
  thread_local std::vector<ChangedChar> chars;
  chars.clear();
  for (size_t pos = 0; pos < segment.size();) {
    const auto [cp, length] = decode_at(segment, pos);
    decompose(cp, chars);
    pos += length;
  }
  // Stable sort of each run of non-starters by combining class.
  auto class_of = [](const ChangedChar& c) { return combining_class(c.code_point); };
  for (size_t start = 0; start < chars.size();) {
    if (class_of(chars[start]) == 0) {
      ++start;
      continue;
    }
    size_t end = start;
    while (end < chars.size() && class_of(chars[end]) != 0) ++end;
    std::stable_sort(chars.begin() + start, chars.begin() + end,
                     [&](const ChangedChar& a, const ChangedChar& b) { return class_of(a) < class_of(b); });
    start = end;
  }
  // Compose each character with the last starter unless a character between them blocks it.
  size_t starter = 0;
  bool have_starter = false;
  int last_class = -1;
  size_t kept = 0;
  for (size_t i = 0; i < chars.size(); ++i) {
    const ChangedChar c = chars[i];
    const int cp_class = combining_class(c.code_point);
    if (have_starter && (last_class < cp_class || (last_class == -1 && cp_class == 0))) {
      if (const char32_t composite = compose(chars[starter].code_point, c.code_point)) {
        chars[starter] = {composite, chars[starter].change + c.change - 1};
        continue;
      }
    }
    if (cp_class == 0) {
      starter = kept;
      have_starter = true;
      last_class = -1;
    } else {
      last_class = cp_class;
    }
    chars[kept++] = c;
  }
  for (size_t i = 0; i < kept; ++i) {
    utf8::append(out, chars[i].code_point);
    if (changes) changes->push_back(chars[i].change);
  }
}

bool nfc_unstable(char32_t code_point) {
  return code_point < 0x10000 ? (bmp_nfc_facts().flags[code_point] & BmpNfcFacts::kUnstable) != 0
                              : in_ranges(tables::kNfcUnstable, code_point);
}

}  // namespace

CodePointClass classify(char32_t code_point) {
  return code_point < 0x10000 ? bmp_classes()[code_point] : classify_slow(code_point);
}

namespace {

// The length of the well-formed sequence at bytes[pos], or 0 when it is ill-formed; then
// *maximal_subpart is the length of the longest prefix that could start a valid sequence.
size_t utf8_sequence_length(std::string_view bytes, size_t pos, size_t* maximal_subpart) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  const unsigned lead = p[pos];
  *maximal_subpart = 1;
  if (lead < 0x80) return 1;
  size_t length;
  unsigned low = 0x80, high = 0xBF;  // the valid range of the second byte (Unicode Table 3-7)
  if (lead >= 0xC2 && lead <= 0xDF) length = 2;
  else if (lead == 0xE0) length = 3, low = 0xA0;
  else if (lead == 0xED) length = 3, high = 0x9F;
  else if (lead >= 0xE1 && lead <= 0xEF) length = 3;
  else if (lead == 0xF0) length = 4, low = 0x90;
  else if (lead == 0xF4) length = 4, high = 0x8F;
  else if (lead >= 0xF1 && lead <= 0xF3) length = 4;
  else return 0;
  for (size_t i = 1; i < length; ++i) {
    if (pos + i >= n) return 0;
    const unsigned byte = p[pos + i];
    if (i == 1 ? (byte < low || byte > high) : (byte & 0xC0) != 0x80) return 0;
    *maximal_subpart = i + 1;
  }
  return length;
}

}  // namespace

size_t find_invalid_utf8(std::string_view text) {
  size_t subpart;
  for (size_t pos = 0; pos < text.size();) {
    // ASCII eight bytes at a time.
    uint64_t word;
    while (pos + 8 <= text.size() && (std::memcpy(&word, text.data() + pos, 8), (word & 0x8080808080808080ull) == 0)) {
      pos += 8;
    }
    if (pos == text.size()) break;
    const size_t length = utf8_sequence_length(text, pos, &subpart);
    if (length == 0) return pos;
    pos += length;
  }
  return text.size();
}

std::string decode_utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t subpart;
  for (size_t pos = 0; pos < bytes.size();) {
    const size_t length = utf8_sequence_length(bytes, pos, &subpart);
    if (length != 0) {
      out.append(bytes.data() + pos, length);
      pos += length;
    } else {
      out += "\xEF\xBF\xBD";
      pos += subpart;
    }
  }
  return out;
}

void append_nfc(std::string_view text, std::string& out, std::vector<int32_t>* changes) {
  // Copied characters keep their alignment: change 0 each.
  auto copy = [&](size_t first, size_t last) {
    out.append(text.data() + first, last - first);
    if (!changes) return;
    for (size_t pos = first; pos < last; ++pos) {
      if ((static_cast<unsigned char>(text[pos]) & 0xC0) != 0x80) changes->push_back(0);
    }
  };
  // Text changes only in segments around unstable characters. A segment runs from the
  // stable character before the first unstable one (it may compose with what follows) to
  // the next stable character, which nothing before it can interact with.
  size_t copied = 0;
  size_t previous = 0;  // start of the character before pos
  for (size_t pos = 0; pos < text.size();) {
    const auto [cp, length] = decode_at(text, pos);
    if (!nfc_unstable(cp)) {
      previous = pos;
      pos += length;
      continue;
    }
    const size_t segment_start = std::max(copied, previous);
    size_t segment_end = pos + length;
    while (segment_end < text.size()) {
      const auto next = decode_at(text, segment_end);
      if (!nfc_unstable(next.code_point)) break;
      segment_end += next.length;
    }
    copy(copied, segment_start);
    append_nfc_segment(text.substr(segment_start, segment_end - segment_start), out, changes);
    copied = previous = segment_end;
    pos = segment_end;
  }
  copy(copied, text.size());
}

}  // namespace barqtrain::tokenizer::unicode

