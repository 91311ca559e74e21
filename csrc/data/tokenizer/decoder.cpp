#include "data/tokenizer/decoder.h"

#include "data/tokenizer/config.h"
#include "data/tokenizer/error.h"
#include "data/tokenizer/unicode.h"

namespace barqtrain::tokenizer {
namespace {

// The byte of a "<0xNN>" token (two hex digits, either case, as Rust's from_str_radix
// reads them), or -1.
int fallback_byte(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int high = digit(token[3]), low = digit(token[4]);
  return high < 0 || low < 0 ? -1 : high * 16 + low;
}

std::vector<std::string> byte_fallback(std::vector<std::string> tokens) {
  std::vector<std::string> out;
  std::string bytes;
  auto flush = [&] {
    if (bytes.empty()) return;
    if (unicode::find_invalid_utf8(bytes) == bytes.size()) {
      out.push_back(bytes);
    } else {
      // Bytes that are not UTF-8 become one U+FFFD each.
      for (size_t i = 0; i < bytes.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
    }
    bytes.clear();
  };
  for (std::string& token : tokens) {
    if (const int byte = fallback_byte(token); byte >= 0) {
      bytes += static_cast<char>(byte);
      continue;
    }
    flush();
    out.push_back(std::move(token));
  }
  flush();
  return out;
}

std::string strip(const std::string& token, const std::string& character, size_t start, size_t stop) {
  std::vector<size_t> starts;  // the byte offset of each character
  for (size_t pos = 0; pos < token.size(); pos += unicode::decode_at(token, pos).length) starts.push_back(pos);
  auto is_stripped = [&](size_t index) {
    const size_t end = index + 1 < starts.size() ? starts[index + 1] : token.size();
    return token.compare(starts[index], end - starts[index], character) == 0;
  };
  size_t first = 0, last = starts.size();
  while (first < std::min(start, starts.size()) && is_stripped(first)) ++first;
  for (size_t i = 0; i < stop && i < starts.size() && is_stripped(starts.size() - 1 - i); ++i) {
    last = starts.size() - 1 - i;
  }
  if (first >= last) return "";
  const size_t begin = starts[first], end = last < starts.size() ? starts[last] : token.size();
  return token.substr(begin, end - begin);
}

}  // namespace

DecoderChain::DecoderChain(const json::Value& config) { read(config); }

void DecoderChain::read(const json::Value& config) {
  const std::string type = type_of(config);
  Step step;
  if (type == "Sequence") {
    const json::Value* decoders = config.find("decoders");
    if (!decoders || !decoders->is_array()) throw TokenizerError("decoder Sequence has no decoders list");
    for (const json::Value& each : decoders->as_array()) read(each);
    return;
  } else if (type == "Replace") {
    const json::Value* pattern = config.find("pattern");
    const json::Value* literal = pattern ? pattern->find("String") : nullptr;
    const json::Value* content = config.find("content");
    if (!literal || !literal->is_string()) {
      throw TokenizerError(
          "unsupported tokenizer.json feature: decoder Replace with a Regex pattern (only String patterns are "
          "supported)");
    }
    if (literal->as_string().empty() || !content || !content->is_string()) {
      throw TokenizerError("decoder Replace needs a non-empty pattern and a content string");
    }
    step.kind = Step::Kind::kReplace;
    step.pattern = literal->as_string();
    step.content = content->as_string();
  } else if (type == "ByteFallback") {
    step.kind = Step::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = Step::Kind::kFuse;
  } else if (type == "Strip") {
    const json::Value* content = config.find("content");
    const json::Value* start = config.find("start");
    const json::Value* stop = config.find("stop");
    if (!content || !content->is_string() || content->as_string().empty() ||
        unicode::decode_at(content->as_string(), 0).length != content->as_string().size() || !start || !stop ||
        start->as_integer() < 0 || stop->as_integer() < 0) {
      throw TokenizerError("decoder Strip needs a one-character content and non-negative start and stop");
    }
    step.kind = Step::Kind::kStrip;
    step.content = content->as_string();
    step.start = static_cast<size_t>(start->as_integer());
    step.stop = static_cast<size_t>(stop->as_integer());
  } else if (type == "Metaspace") {
    step.kind = Step::Kind::kMetaspace;
    step.metaspace = Metaspace::read(config);
  } else {
    throw TokenizerError("unsupported tokenizer.json feature: decoder " + type +
                         " (supported: ByteLevel alone, or Replace, ByteFallback, Fuse, Strip, Metaspace and "
                         "Sequences of them)");
  }
  steps_.push_back(std::move(step));
}

std::string DecoderChain::decode(std::vector<std::string> tokens) const {
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Step::Kind::kReplace:
        for (std::string& token : tokens) {
          std::string replaced;
          size_t copied = 0;
          for (size_t at = token.find(step.pattern); at != std::string::npos; at = token.find(step.pattern, copied)) {
            replaced.append(token, copied, at - copied);
            replaced += step.content;
            copied = at + step.pattern.size();
          }
          replaced.append(token, copied, std::string::npos);
          token.swap(replaced);
        }
        break;
      case Step::Kind::kByteFallback: tokens = byte_fallback(std::move(tokens)); break;
      case Step::Kind::kFuse: {
        std::string fused;
        for (const std::string& token : tokens) fused += token;
        tokens.assign(1, std::move(fused));
        break;
      }
      case Step::Kind::kStrip:
        for (std::string& token : tokens) token = strip(token, step.content, step.start, step.stop);
        break;
      case Step::Kind::kMetaspace: {
        const std::string& replacement = step.metaspace.replacement;
        for (size_t i = 0; i < tokens.size(); ++i) {
          // Every replacement character of the first token is dropped, as Hugging Face does.
          const bool drop = i == 0 && step.metaspace.prepend_scheme != Metaspace::PrependScheme::kNever;
          std::string out;
          size_t copied = 0;
          for (size_t at = tokens[i].find(replacement); at != std::string::npos;
               at = tokens[i].find(replacement, copied)) {
            out.append(tokens[i], copied, at - copied);
            if (!drop) out += ' ';
            copied = at + replacement.size();
          }
          out.append(tokens[i], copied, std::string::npos);
          tokens[i].swap(out);
        }
        break;
      }
    }
  }
  std::string text;
  for (const std::string& token : tokens) text += token;
  return text;
}

}  // namespace barqtrain::tokenizer
