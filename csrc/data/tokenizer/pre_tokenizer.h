// The regex split pre-tokenizers of byte-level BPE models, as hand-written scanners.
//
// Each supported pattern is recognized by its exact regex string from tokenizer.json and
// scanned with the semantics of the regex engine behind Hugging Face tokenizers
// (leftmost-first alternation, greedy repetition with backtracking).
#pragma once

#include <optional>
#include <string_view>
#include <vector>

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

}  // namespace barqtrain::tokenizer
