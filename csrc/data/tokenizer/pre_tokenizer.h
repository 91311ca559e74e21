// Pre-tokenizers: the regex split patterns of byte-level BPE models, as hand-written
// scanners, and the options of Metaspace (SentencePiece-style models).
//
// Each supported pattern is recognized by its exact regex string from tokenizer.json and
// scanned with the semantics of the regex engine behind Hugging Face tokenizers
// (leftmost-first alternation, greedy repetition with backtracking).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/json.h"

namespace barqtrain::tokenizer {

enum class SplitPattern {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
  // Llama-3's pattern with \p{N} instead of \p{N}{1,3}: one digit per piece.
  kQwen2,
};

// The pattern whose regex is exactly `regex`, or nothing when it is not one we implement.
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

}  // namespace barqtrain::tokenizer
