#include "data/tokenizer/regex.h"

#include <cctype>

#include <pcre2.h>

#include "data/tokenizer/error.h"
#include "data/tokenizer/unicode.h"

namespace barqtrain::tokenizer {
namespace {

// Oniguruma's Unicode classes, as PCRE2 class items (without the brackets).
constexpr std::string_view kWhiteSpaceItems =
    R"(\t\n\x0B\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
constexpr std::string_view kWordItems = R"(\p{L}\p{M}\p{N}\p{Pc})";
constexpr std::string_view kHexDigitItems = "0-9A-Fa-f";

// The pattern on one line: its control characters (DeepSeek's holds CR and LF) escaped.
std::string printable(std::string_view pattern) {
  static const char* const kHex = "0123456789ABCDEF";
  std::string out;
  for (const char c : pattern) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (byte < 0x20 || byte == 0x7F) out += std::string("\\x") + kHex[byte >> 4] + kHex[byte & 15];
    else out += c;
  }
  return out;
}

[[noreturn]] void refuse(std::string_view pattern, const std::string& what) {
  throw TokenizerError("Split regex " + printable(pattern) + ": " + what);
}

bool is_hex_digit(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(error_code, buffer, sizeof(buffer)) < 0) {
    return "PCRE2 error " + std::to_string(error_code);
  }
  return reinterpret_cast<const char*>(buffer);
}

// The per-thread matching state: PCRE2's match data (group 0 is all we read) and a JIT
// stack large enough for long runs of backtracking.
class MatchState {
 public:
  MatchState()
      : data_(pcre2_match_data_create(1, nullptr)),
        context_(pcre2_match_context_create(nullptr)),
        stack_(pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr)) {
    if (!data_ || !context_ || !stack_) throw TokenizerError("out of memory for PCRE2's match state");
    pcre2_jit_stack_assign(context_, nullptr, stack_);
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack_);
    pcre2_match_context_free(context_);
    pcre2_match_data_free(data_);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;

  pcre2_match_data* data() const { return data_; }
  pcre2_match_context* context() const { return context_; }

 private:
  pcre2_match_data* data_;
  pcre2_match_context* context_;
  pcre2_jit_stack* stack_;
};

MatchState& this_thread_match_state() {
  thread_local MatchState state;
  return state;
}

}  // namespace

bool is_word_character_at(std::string_view text, size_t pos) {
  static const Regex word_character(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])");
  return word_character.matches_at(text, pos);
}

// Whether name is a Unicode script for PCRE2 (Han, Greek, ...), as opposed to a general
// category (L, Lu, ...) or a binary property (Alphabetic, ...).
bool is_script(std::string_view name) {
  const std::string probe = "\\p{sc:" + std::string(name) + "}";
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(probe.data()), probe.size(), PCRE2_UTF | PCRE2_UCP,
                                   &error_code, &error_offset, nullptr);
  pcre2_code_free(code);
  return code != nullptr;
}

std::string oniguruma_to_pcre2(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  bool class_start = false;  // just after [ or [^, where ] is a literal
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    const bool at_class_start = class_start;
    class_start = false;
    if (c == '\\') {
      if (i + 1 == pattern.size()) refuse(pattern, "ends with a lone backslash");
      const char escaped = pattern[++i];
      // The class as items inside brackets, or as a bracketed class of its own.
      auto class_of = [&](std::string_view items, bool negated) {
        if (!in_class) {
          out += negated ? "[^" : "[";
          out.append(items);
          out += ']';
        } else if (!negated) {
          out.append(items);
        } else {
          refuse(pattern, std::string("\\") + escaped + " inside [...] (write the class out)");
        }
      };
      switch (escaped) {
        case 's': class_of(kWhiteSpaceItems, false); continue;
        case 'S': class_of(kWhiteSpaceItems, true); continue;
        case 'w': class_of(kWordItems, false); continue;
        case 'W': class_of(kWordItems, true); continue;
        case 'h': class_of(kHexDigitItems, false); continue;
        case 'H': class_of(kHexDigitItems, true); continue;
        case 'b':
        case 'B':
          if (!in_class) refuse(pattern, "word boundaries (\\b, \\B) are not supported");
          break;  // \b in a class is backspace in both
        case 'p':
        case 'P': {
          // A script is its Script property in Oniguruma, its Script_Extensions in PCRE2's
          // \p{Name}: written \p{sc:Name}. \p{^Name} is the negation, as \P{Name}.
          const size_t close = pattern.find('}', i);
          if (i + 1 >= pattern.size() || pattern[i + 1] != '{' || close == std::string_view::npos) {
            refuse(pattern, std::string("\\") + escaped + " needs a {name}");
          }
          std::string_view name = pattern.substr(i + 2, close - i - 2);
          bool negated = escaped == 'P';
          if (!name.empty() && name[0] == '^') {
            negated = !negated;
            name.remove_prefix(1);
          }
          out += negated ? "\\P{" : "\\p{";
          if (is_script(name)) out += "sc:";
          out.append(name);
          out += '}';
          i = close;
          continue;
        }
        case 'u': {
          // \uHHHH, a code point in Oniguruma's Ruby syntax.
          if (i + 4 >= pattern.size() || !is_hex_digit(pattern[i + 1]) || !is_hex_digit(pattern[i + 2]) ||
              !is_hex_digit(pattern[i + 3]) || !is_hex_digit(pattern[i + 4])) {
            refuse(pattern, "\\u needs four hex digits");
          }
          out += "\\x{";
          out.append(pattern.substr(i + 1, 4));
          out += '}';
          i += 4;
          continue;
        }
        default: break;
      }
      out += '\\';
      out += escaped;
      continue;
    }
    if (in_class) {
      if (c == ']' && !at_class_start) {
        in_class = false;
      } else if (c == '[' && pattern.compare(i, 2, "[:") == 0) {
        refuse(pattern, "POSIX bracket classes ([:punct:], ...) are not supported (Oniguruma's differ from PCRE2's)");
      } else if (c == '[') {
        refuse(pattern, "nested character classes are not supported");
      } else if (c == '&' && pattern.compare(i, 2, "&&") == 0) {
        refuse(pattern, "class intersection (&&) is not supported");
      } else if (c == '^' && at_class_start) {
        class_start = true;  // [^]...]: the ] is still a literal
      }
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_start = true;
    } else if (c == '(' && pattern.compare(i, 2, "(?") == 0 && i + 2 < pattern.size()) {
      // Inline flags: only i means the same in both (Oniguruma's Ruby m is PCRE2's s).
      size_t j = i + 2;
      while (j < pattern.size() && (pattern[j] == '-' || std::isalpha(static_cast<unsigned char>(pattern[j])))) {
        if (pattern[j] != 'i' && pattern[j] != '-') {
          refuse(pattern, std::string("inline flag ") + pattern[j] + " is not supported (only i)");
        }
        ++j;
      }
    }
    out += c;
  }
  if (in_class) refuse(pattern, "a character class is not closed");
  return out;
}

Regex::Regex(std::string_view pattern) : pattern_(pattern), pcre2_pattern_(oniguruma_to_pcre2(pattern)) {
  // Oniguruma's Ruby syntax: ^ and $ at every \n (and only there), \R any Unicode line break,
  // whatever defaults this PCRE2 was built with.
  pcre2_compile_context* context = pcre2_compile_context_create(nullptr);
  if (!context) throw TokenizerError("out of memory for PCRE2's compile context");
  pcre2_set_newline(context, PCRE2_NEWLINE_LF);
  pcre2_set_bsr(context, PCRE2_BSR_UNICODE);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pcre2_pattern_.data()), pcre2_pattern_.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE | PCRE2_NEVER_BACKSLASH_C, &error_code,
                                   &error_offset, context);
  pcre2_compile_context_free(context);
  if (!code) {
    refuse(pattern_, pcre2_message(error_code) + " (at offset " + std::to_string(error_offset) + " of " +
                         printable(pcre2_pattern_) + ")");
  }
  code_ = code;
  jit_compiled_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::matches_at(std::string_view text, size_t pos) const {
  MatchState& state = this_thread_match_state();
  const int rc = pcre2_match(static_cast<const pcre2_code*>(code_), reinterpret_cast<PCRE2_SPTR>(text.data()),
                             text.size(), pos, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, state.data(), state.context());
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) refuse(pattern_, "matching failed: " + pcre2_message(rc));
  return true;
}

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
  MatchState& state = this_thread_match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const auto* code = static_cast<const pcre2_code*>(code_);
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data());
  size_t search_from = 0;
  size_t last_match_end = SIZE_MAX;
  while (search_from <= text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), search_from, PCRE2_NO_UTF_CHECK, state.data(),
                               state.context());
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) refuse(pattern_, "matching failed: " + pcre2_message(rc));
    const size_t start = ovector[0], end = ovector[1];
    if (start == end && end == last_match_end) {
      // Oniguruma drops an empty match right after the previous one and moves on one character.
      search_from += search_from < text.size() ? unicode::decode_at(text, search_from).length : 1;
      continue;
    }
    matches.emplace_back(start, end);
    search_from = last_match_end = end;
  }
}

}  // namespace barqtrain::tokenizer
