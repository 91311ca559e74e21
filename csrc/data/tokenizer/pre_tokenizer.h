// Pre-tokenizers: the Split, Digits and ByteLevel steps that cut text into pieces, and the
// options of Metaspace (SentencePiece-style models).
//
// A Split's regex runs on PCRE2 with Oniguruma's semantics (regex.h), except the split
// patterns of GPT-2, Llama-3 and Qwen2, which are recognized by their exact regex string and
// run on hand-written scanners with the same results (leftmost-first alternation, greedy
// repetition with backtracking).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/json.h"
#include "data/tokenizer/regex.h"

namespace barqtrain::tokenizer {

enum class SplitPattern {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
  // Llama-3's pattern with \p{N} instead of \p{N}{1,3}: one digit per piece.
  kQwen2,
};

// The pattern whose regex is exactly `regex`, or nothing when no scanner implements it.
std::optional<SplitPattern> split_pattern_from_regex(std::string_view regex);

// The regex string of a pattern (GPT-2's is implied by ByteLevel's use_regex).
std::string_view regex_of(SplitPattern pattern);

// Appends the pieces of text (valid UTF-8) to pieces; they cover text in order.
void split(SplitPattern pattern, std::string_view text, std::vector<std::string_view>& pieces);

// Metaspace, as a pre-tokenizer: spaces become the replacement character, which is put in
// front of the text (always, only at the start of the input, or never) unless it is
// already there, and with split the text is cut before each replacement character. As a
// decoder: the replacement character becomes a space, and is dropped from the first token
// unless the scheme is never.
struct Metaspace {
  enum class PrependScheme { kAlways, kFirst, kNever };
  std::string replacement;  // one character, UTF-8
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;

  // Reads a tokenizer.json Metaspace object, with Hugging Face's defaults and its legacy
  // add_prefix_space; throws TokenizerError when it is malformed.
  static Metaspace read(const json::Value& config);
};

// Cuts text before each occurrence of separator (Hugging Face's MergedWithNext).
void split_before(std::string_view separator, std::string_view text, std::vector<std::string_view>& pieces);

// What a Split does with the matches of its pattern (Hugging Face's SplitDelimiterBehavior):
// drop them, keep each as a piece, join each to the piece before or after it, or join runs
// of matches (and runs of the text between them) into one piece.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One step that cuts each piece into smaller ones: a Split (a regex, a literal string) or
// Digits. Immutable and safe to use from many threads.
class SplitStep {
 public:
  // A tokenizer.json Split; throws TokenizerError when it is malformed or unsupported.
  static SplitStep read_split(const json::Value& config);
  // Digits: each \p{N} character its own piece, or each run of them one piece.
  static SplitStep digits(bool individual_digits);
  // The Isolated split of a hand-written pattern (ByteLevel's use_regex is GPT-2's).
  static SplitStep isolated(SplitPattern pattern);

  // Appends the non-empty pieces of text (valid UTF-8) to pieces.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  struct Match {
    size_t start, end;
    bool is_match;
  };
  // The pattern's matches and the text between them, in order, covering text.
  void find_matches(std::string_view text, std::vector<Match>& matches) const;

  enum class Kind { kScanner, kRegex, kLiteral, kDigits };
  Kind kind_ = Kind::kScanner;
  SplitPattern scanner_ = SplitPattern::kGpt2;
  std::shared_ptr<const Regex> regex_;
  std::string literal_;
  SplitBehavior behavior_ = SplitBehavior::kIsolated;
  bool invert_ = false;
};

// A tokenizer.json pre_tokenizer: Metaspace alone, or splitting steps (Split and Digits,
// in a Sequence or alone) optionally followed by ByteLevel, which makes the model
// byte-level (its use_regex adds GPT-2's split as the last step).
class PreTokenizer {
 public:
  // Reads config (null: no pre-tokenizer); throws TokenizerError naming what is unsupported.
  static PreTokenizer read(const json::Value* config);

  bool byte_level() const { return byte_level_; }
  // ByteLevel's add_prefix_space: a space in front of text that does not start with one.
  bool add_prefix_space() const { return add_prefix_space_; }
  const std::optional<Metaspace>& metaspace() const { return metaspace_; }

  // Appends the pieces the splitting steps cut text into (text itself when there are none).
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  void read_step(const json::Value& step, bool last);

  std::vector<SplitStep> steps_;
  bool byte_level_ = false;
  bool add_prefix_space_ = false;
  std::optional<Metaspace> metaspace_;
};

}  // namespace barqtrain::tokenizer
