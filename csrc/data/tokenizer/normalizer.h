// Normalizers of tokenizer.json (NFC, Prepend, Replace and Sequences of them) and the text
// edits they share with the Metaspace pre-tokenizer.
//
// Text can be edited with or without alignment tracking. Tracking keeps, for every byte
// of the edited text, the span of the original text it came from, with the rules of
// Hugging Face's NormalizedString: a replacing character takes the span of the character
// it replaces, an inserted one the span of the byte before it. Token offsets are read
// from these spans; encoding without offsets does not track them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/json.h"

namespace barqtrain::tokenizer {

// A byte range of the original text.
struct Span {
  uint32_t start;
  uint32_t end;
};

// Text being normalized; spans (one per byte of text) only when offsets are tracked.
struct AlignedText {
  std::string text;
  std::vector<Span> spans;
  bool tracked = false;

  // Starts from segment, which begins segment_offset bytes into the input.
  void assign(std::string_view segment, size_t segment_offset, bool track);
};

// Each occurrence of pattern (non-empty) becomes content.
void replace_all(AlignedText& text, std::string_view pattern, std::string_view content, std::string& scratch,
                 std::vector<Span>& scratch_spans);
// prefix before the text when the text is not empty.
void prepend(AlignedText& text, std::string_view prefix);

class Normalizer {
 public:
  Normalizer() = default;
  // Reads a tokenizer.json "normalizer" (null or absent: no normalization); throws
  // TokenizerError naming anything unsupported.
  explicit Normalizer(const json::Value* config);

  bool empty() const { return steps_.empty(); }
  void normalize(AlignedText& text) const;

 private:
  struct Step {
    enum class Kind { kNfc, kPrepend, kReplace } kind;
    std::string pattern;  // kReplace
    std::string content;  // kPrepend, kReplace
  };
  void read(const json::Value& config);

  std::vector<Step> steps_;
};

}  // namespace barqtrain::tokenizer
