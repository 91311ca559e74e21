#include "data/tokenizer/normalizer.h"

#include "data/tokenizer/config.h"
#include "data/tokenizer/error.h"
#include "data/tokenizer/unicode.h"

namespace barqtrain::tokenizer {
namespace {

const std::string& string_field(const json::Value& component, const char* name, const std::string& where) {
  const json::Value* value = component.find(name);
  if (!value || !value->is_string()) throw TokenizerError(where + " has no string " + name);
  return value->as_string();
}

size_t utf8_length(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

// The spans of text after NFC replaced `before` (whose spans are text.spans), following
// the changes of append_nfc: Hugging Face's NormalizedString::transform.
std::vector<Span> nfc_spans(const AlignedText& before, std::string_view after, const std::vector<int32_t>& changes) {
  std::vector<Span> spans;
  spans.reserve(after.size());
  size_t input = 0, output = 0;
  for (const int32_t change : changes) {
    Span span;
    if (change > 0) {
      // An insertion before any input character has an empty span where the text starts.
      span = input > 0 ? before.spans[input - 1] : Span{before.spans[0].start, before.spans[0].start};
    } else {
      span = before.spans[input];
      input += utf8_length(before.text[input]);
      for (int32_t dropped = 0; dropped < -change; ++dropped) input += utf8_length(before.text[input]);
    }
    const size_t length = utf8_length(after[output]);
    spans.insert(spans.end(), length, span);
    output += length;
  }
  return spans;
}

}  // namespace

void AlignedText::assign(std::string_view segment, size_t segment_offset, bool track) {
  text.assign(segment.data(), segment.size());
  tracked = track;
  spans.clear();
  if (!track) return;
  spans.reserve(segment.size());
  for (size_t pos = 0; pos < segment.size();) {
    const size_t length = utf8_length(segment[pos]);
    const Span span{static_cast<uint32_t>(segment_offset + pos), static_cast<uint32_t>(segment_offset + pos + length)};
    spans.insert(spans.end(), length, span);
    pos += length;
  }
}

void replace_all(AlignedText& text, std::string_view pattern, std::string_view content, std::string& scratch,
                 std::vector<Span>& scratch_spans) {
  size_t match = text.text.find(pattern);
  if (match == std::string::npos) return;
  scratch.clear();
  scratch_spans.clear();
  size_t copied = 0;
  for (; match != std::string::npos; match = text.text.find(pattern, copied)) {
    scratch.append(text.text, copied, match - copied);
    scratch.append(content);
    if (text.tracked) {
      scratch_spans.insert(scratch_spans.end(), text.spans.begin() + copied, text.spans.begin() + match);
      // Inserted characters share the span of the byte before them: the match's last.
      scratch_spans.insert(scratch_spans.end(), content.size(), text.spans[match + pattern.size() - 1]);
    }
    copied = match + pattern.size();
  }
  scratch.append(text.text, copied, std::string::npos);
  text.text.swap(scratch);
  if (text.tracked) {
    scratch_spans.insert(scratch_spans.end(), text.spans.begin() + copied, text.spans.end());
    text.spans.swap(scratch_spans);
  }
}

void prepend(AlignedText& text, std::string_view prefix) {
  if (text.text.empty()) return;
  text.text.insert(0, prefix);
  // The prefix takes the span of the first character, which it replaces and re-inserts.
  if (text.tracked) text.spans.insert(text.spans.begin(), prefix.size(), text.spans[0]);
}

Normalizer::Normalizer(const json::Value* config) {
  if (config && !config->is_null()) read(*config);
}

void Normalizer::read(const json::Value& config) {
  const std::string type = type_of(config);
  if (type == "Sequence") {
    const json::Value* normalizers = config.find("normalizers");
    if (!normalizers || !normalizers->is_array()) throw TokenizerError("normalizer Sequence has no normalizers list");
    for (const json::Value& each : normalizers->as_array()) read(each);
  } else if (type == "NFC") {
    steps_.push_back({Step::Kind::kNfc, "", ""});
  } else if (type == "Prepend") {
    steps_.push_back({Step::Kind::kPrepend, "", string_field(config, "prepend", "normalizer Prepend")});
  } else if (type == "Replace") {
    const json::Value* pattern = config.find("pattern");
    const json::Value* literal = pattern ? pattern->find("String") : nullptr;
    if (!literal || !literal->is_string()) {
      throw TokenizerError(
          "unsupported tokenizer.json feature: normalizer Replace with a Regex pattern (only String patterns are "
          "supported)");
    }
    if (literal->as_string().empty()) throw TokenizerError("normalizer Replace has an empty pattern");
    steps_.push_back({Step::Kind::kReplace, literal->as_string(), string_field(config, "content", "normalizer Replace")});
  } else {
    throw TokenizerError("unsupported tokenizer.json feature: normalizer " + type +
                         " (supported: NFC, Prepend, Replace with a String pattern, and Sequences of them)");
  }
}

void Normalizer::normalize(AlignedText& text) const {
  thread_local std::string scratch;
  thread_local std::vector<Span> scratch_spans;
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Step::Kind::kNfc: {
        scratch.clear();
        if (!text.tracked) {
          unicode::append_nfc(text.text, scratch);
        } else {
          thread_local std::vector<int32_t> changes;
          changes.clear();
          unicode::append_nfc(text.text, scratch, &changes);
          text.spans = nfc_spans(text, scratch, changes);
        }
        text.text.swap(scratch);
        break;
      }
      case Step::Kind::kPrepend: prepend(text, step.content); break;
      case Step::Kind::kReplace: replace_all(text, step.pattern, step.content, scratch, scratch_spans); break;
    }
  }
}

}  // namespace barqtrain::tokenizer
