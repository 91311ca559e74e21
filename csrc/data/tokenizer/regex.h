// The regex engine of the Split pre-tokenizers: PCRE2 with its JIT, made to give the matches
// of Oniguruma, the engine behind Hugging Face tokenizers.
//
// Two things differ between them and are bridged here. The patterns: Oniguruma's Unicode
// \s, \w and \h are not PCRE2's, so the pattern is rewritten with explicit classes first
// (\s: White_Space; \w: letters, marks, numbers and connector punctuation; \h: a hex digit).
// The iteration: after a match ending at e, Oniguruma's find_iter drops an empty match at e
// and searches again one character later.
//
// Constructs whose meaning differs and are not rewritten (\b, inline flags other than i) are
// refused with a TokenizerError naming them.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace barqtrain::tokenizer {

class Regex {
 public:
  // Compiles pattern (Oniguruma syntax, as in tokenizer.json); throws TokenizerError.
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [start, end) byte ranges of the successive matches in text (valid UTF-8),
  // empty ones included, in Oniguruma's find_iter order. Safe to call from many threads.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;

  // Whether the pattern matches text (valid UTF-8) starting exactly at pos.
  bool matches_at(std::string_view text, size_t pos) const;

  // The pattern PCRE2 compiled, after the rewriting above.
  const std::string& pcre2_pattern() const { return pcre2_pattern_; }
  // Whether PCRE2's JIT compiled it (else PCRE2's interpreter matches, with the same results).
  bool jit_compiled() const { return jit_compiled_; }

 private:
  std::string pattern_;
  std::string pcre2_pattern_;
  void* code_ = nullptr;  // pcre2_code_8, kept out of this header with PCRE2's macros
  bool jit_compiled_ = false;
};

// Whether the character at text[pos] (valid UTF-8) is a word character as the Rust regex
// crate's \w defines it (Alphabetic, marks, decimal numbers, connector punctuation, the
// joiners): Hugging Face tests added tokens' single_word with it.
bool is_word_character_at(std::string_view text, size_t pos);

// Rewrites an Oniguruma pattern into the PCRE2 pattern with the same meaning; throws
// TokenizerError for what cannot be rewritten.
std::string oniguruma_to_pcre2(std::string_view pattern);

}  // namespace barqtrain::tokenizer
