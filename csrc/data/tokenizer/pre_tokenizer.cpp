#include "data/tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <cstdint>

#include "data/tokenizer/config.h"
#include "data/tokenizer/error.h"
#include "data/tokenizer/unicode.h"

namespace barqtrain::tokenizer {
namespace {

using unicode::CodePointClass;

constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Walks the code points of one text; positions are byte offsets. ASCII bytes, nearly all of
// English text and code, are classified by a 128-entry table without decoding, and each
// code point is decoded once per step.
class Scanner {
 public:
  explicit Scanner(std::string_view text) : text_(text) {}

  struct CodePoint {
    char32_t code_point;
    uint32_t length;
    CodePointClass code_class;
  };

  size_t size() const { return text_.size(); }
  // The code point at pos < size().
  CodePoint at(size_t pos) const {
    const auto byte = static_cast<unsigned char>(text_[pos]);
    if (byte < 0x80) return {byte, 1, unicode::classify_ascii(byte)};
    const auto decoded = unicode::decode_at(text_, pos);
    return {decoded.code_point, decoded.length, unicode::classify(decoded.code_point)};
  }
  char32_t code_point_at(size_t pos) const {
    const auto byte = static_cast<unsigned char>(text_[pos]);
    return byte < 0x80 ? byte : unicode::decode_at(text_, pos).code_point;
  }
  size_t next(size_t pos) const {
    return static_cast<unsigned char>(text_[pos]) < 0x80 ? pos + 1 : pos + unicode::decode_at(text_, pos).length;
  }
  bool is_at(size_t pos, CodePointClass c) const { return pos < text_.size() && at(pos).code_class == c; }

  // The end of the run of code points of class c that starts at pos, at most max_count long.
  size_t skip_class(size_t pos, CodePointClass c, size_t max_count = SIZE_MAX) const {
    const size_t n = text_.size();
    for (size_t count = 0; count < max_count && pos < n; ++count) {
      const auto byte = static_cast<unsigned char>(text_[pos]);
      if (byte < 0x80) {
        if (unicode::classify_ascii(byte) != c) break;
        ++pos;
        continue;
      }
      const auto decoded = unicode::decode_at(text_, pos);
      if (unicode::classify(decoded.code_point) != c) break;
      pos += decoded.length;
    }
    return pos;
  }

  // The end of a contraction ('s 't 're 've 'm 'll 'd) at pos, or pos when there is none.
  size_t match_contraction(size_t pos, bool ignore_case) const {
    if (pos >= text_.size() || text_[pos] != '\'') return pos;
    auto letter_at = [&](size_t at) -> char32_t {
      if (at >= text_.size()) return 0;
      const char32_t cp = code_point_at(at);
      if (!ignore_case) return cp;
      if (cp >= 'A' && cp <= 'Z') return cp - 'A' + 'a';
      return cp == 0x17F ? U's' : cp;  // LATIN SMALL LETTER LONG S case-folds to s
    };
    const size_t first = pos + 1;
    const char32_t a = letter_at(first);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return next(first);
    if (a != 'r' && a != 'v' && a != 'l') return pos;
    const size_t second = next(first);
    const char32_t b = letter_at(second);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return next(second);
    return pos;
  }

  // \s+(?!\S)|\s+ at pos, which starts a run of white space: the run, less its last
  // character when a non-space follows and the run is longer than one character.
  size_t match_trailing_white_space(size_t pos) const {
    size_t last_start = pos;
    size_t end = pos;
    while (end < text_.size()) {
      const CodePoint c = at(end);
      if (c.code_class != CodePointClass::kWhiteSpace) break;
      last_start = end;
      end += c.length;
    }
    if (end == text_.size() || last_start == pos) return end;
    return last_start;
  }

 private:
  std::string_view text_;
};

size_t match_gpt2(const Scanner& s, size_t pos) {
  if (const size_t end = s.match_contraction(pos, /*ignore_case=*/false); end != pos) return end;
  // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`
  const size_t body = s.code_point_at(pos) == ' ' ? pos + 1 : pos;
  if (body < s.size()) {
    const Scanner::CodePoint first = s.at(body);
    if (first.code_class != CodePointClass::kWhiteSpace) {
      return s.skip_class(body + first.length, first.code_class);
    }
  }
  return s.match_trailing_white_space(pos);
}

bool is_line_break(char32_t cp) { return cp == '\r' || cp == '\n'; }

size_t match_llama3_family(const Scanner& s, size_t pos, size_t max_digits) {
  if (const size_t end = s.match_contraction(pos, /*ignore_case=*/true); end != pos) return end;
  const auto [cp, length, c] = s.at(pos);
  // `[^\r\n\p{L}\p{N}]?\p{L}+`
  if (c == CodePointClass::kLetter) return s.skip_class(pos + length, c);
  if (c != CodePointClass::kNumber && !is_line_break(cp) && s.is_at(pos + length, CodePointClass::kLetter)) {
    return s.skip_class(pos + length, CodePointClass::kLetter);
  }
  // `\p{N}{1,3}` or `\p{N}`
  if (c == CodePointClass::kNumber) return s.skip_class(pos + length, c, max_digits - 1);
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  const size_t body = cp == ' ' ? pos + 1 : pos;
  if (s.is_at(body, CodePointClass::kOther)) {
    size_t end = s.skip_class(body, CodePointClass::kOther);
    while (end < s.size() && is_line_break(s.code_point_at(end))) ++end;
    return end;
  }
  // `\s*[\r\n]+`: the white space up to and including its last line break.
  size_t after_last_break = pos;
  for (size_t at = pos; at < s.size();) {
    const Scanner::CodePoint here = s.at(at);
    if (here.code_class != CodePointClass::kWhiteSpace) break;
    if (is_line_break(here.code_point)) after_last_break = at + 1;
    at += here.length;
  }
  if (after_last_break != pos) return after_last_break;
  return s.match_trailing_white_space(pos);
}

}  // namespace

std::optional<SplitPattern> split_pattern_from_regex(std::string_view regex) {
  for (const SplitPattern pattern : {SplitPattern::kGpt2, SplitPattern::kLlama3, SplitPattern::kQwen2}) {
    if (regex == regex_of(pattern)) return pattern;
  }
  return std::nullopt;
}

std::string_view regex_of(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::kGpt2: return kGpt2Regex;
    case SplitPattern::kLlama3: return kLlama3Regex;
    case SplitPattern::kQwen2: return kQwen2Regex;
  }
  return {};
}

// Flattened: the scanners and the append of each piece inline into one loop (the hot path
// of byte-level encoding).
[[gnu::flatten]] void split(SplitPattern pattern, std::string_view text, std::vector<std::string_view>& pieces) {
  const Scanner scanner(text);
  for (size_t pos = 0; pos < text.size();) {
    size_t end = 0;
    switch (pattern) {
      case SplitPattern::kGpt2: end = match_gpt2(scanner, pos); break;
      case SplitPattern::kLlama3: end = match_llama3_family(scanner, pos, 3); break;
      case SplitPattern::kQwen2: end = match_llama3_family(scanner, pos, 1); break;
    }
    pieces.push_back(text.substr(pos, end - pos));
    pos = end;
  }
}

Metaspace Metaspace::read(const json::Value& config) {
  Metaspace metaspace;
  const json::Value* replacement = config.find("replacement");
  if (!replacement || !replacement->is_string() || replacement->as_string().empty() ||
      unicode::find_invalid_utf8(replacement->as_string()) != replacement->as_string().size() ||
      unicode::decode_at(replacement->as_string(), 0).length != replacement->as_string().size()) {
    throw TokenizerError("Metaspace: replacement must be one character");
  }
  metaspace.replacement = replacement->as_string();
  if (const json::Value* scheme = config.find("prepend_scheme"); scheme && !scheme->is_null()) {
    const std::string& name = scheme->as_string();
    if (name == "always") metaspace.prepend_scheme = PrependScheme::kAlways;
    else if (name == "first") metaspace.prepend_scheme = PrependScheme::kFirst;
    else if (name == "never") metaspace.prepend_scheme = PrependScheme::kNever;
    else throw TokenizerError("Metaspace: unknown prepend_scheme \"" + name + "\" (always, first or never)");
  }
  // Files written before prepend_scheme existed say add_prefix_space: false for never.
  if (const json::Value* add_prefix_space = config.find("add_prefix_space");
      add_prefix_space && !add_prefix_space->is_null() && !add_prefix_space->as_bool()) {
    const json::Value* scheme = config.find("prepend_scheme");
    if (scheme && !scheme->is_null() && metaspace.prepend_scheme != PrependScheme::kNever) {
      throw TokenizerError("Metaspace: add_prefix_space false contradicts prepend_scheme " + scheme->as_string());
    }
    metaspace.prepend_scheme = PrependScheme::kNever;
  }
  if (const json::Value* split = config.find("split"); split && !split->is_null()) metaspace.split = split->as_bool();
  return metaspace;
}

void split_before(std::string_view separator, std::string_view text, std::vector<std::string_view>& pieces) {
  size_t start = 0;
  for (size_t at = text.find(separator, 1); at != std::string_view::npos; at = text.find(separator, at + 1)) {
    pieces.push_back(text.substr(start, at - start));
    start = at;
  }
  if (start < text.size()) pieces.push_back(text.substr(start));
}

SplitStep SplitStep::read_split(const json::Value& config) {
  SplitStep step;
  const json::Value* pattern = config.find("pattern");
  const json::Value* regex = pattern ? pattern->find("Regex") : nullptr;
  const json::Value* literal = pattern ? pattern->find("String") : nullptr;
  if (regex && regex->is_string()) {
    if (const auto scanner = split_pattern_from_regex(regex->as_string())) {
      step.scanner_ = *scanner;
    } else {
      step.kind_ = Kind::kRegex;
      step.regex_ = std::make_shared<const Regex>(regex->as_string());
    }
  } else if (literal && literal->is_string() && !literal->as_string().empty()) {
    step.kind_ = Kind::kLiteral;
    step.literal_ = literal->as_string();
  } else {
    throw TokenizerError("Split pre-tokenizer: pattern must be {\"Regex\": ...} or a non-empty {\"String\": ...}");
  }
  const json::Value* behavior = config.find("behavior");
  const std::string name = behavior && behavior->is_string() ? behavior->as_string() : "(none)";
  if (name == "Removed") step.behavior_ = SplitBehavior::kRemoved;
  else if (name == "Isolated") step.behavior_ = SplitBehavior::kIsolated;
  else if (name == "MergedWithPrevious") step.behavior_ = SplitBehavior::kMergedWithPrevious;
  else if (name == "MergedWithNext") step.behavior_ = SplitBehavior::kMergedWithNext;
  else if (name == "Contiguous") step.behavior_ = SplitBehavior::kContiguous;
  else {
    throw TokenizerError("Split pre-tokenizer: unknown behavior " + name +
                         " (Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous)");
  }
  step.invert_ = flag(config, "invert", false);
  return step;
}

SplitStep SplitStep::digits(bool individual_digits) {
  SplitStep step;
  step.kind_ = Kind::kDigits;
  step.behavior_ = individual_digits ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
  return step;
}

SplitStep SplitStep::isolated(SplitPattern pattern) {
  SplitStep step;
  step.scanner_ = pattern;
  return step;
}

void SplitStep::find_matches(std::string_view text, std::vector<Match>& matches) const {
  // Each match, with the text before it as a non-match, as Hugging Face's find_matches.
  size_t done = 0;
  auto add_match = [&](size_t start, size_t end) {
    if (start > done) matches.push_back({done, start, false});
    matches.push_back({start, end, true});
    done = end;
  };
  switch (kind_) {
    case Kind::kScanner: {
      thread_local std::vector<std::string_view> pieces;
      pieces.clear();
      tokenizer::split(scanner_, text, pieces);
      for (const std::string_view piece : pieces) {
        const size_t start = piece.data() - text.data();
        add_match(start, start + piece.size());
      }
      break;
    }
    case Kind::kRegex: {
      thread_local std::vector<std::pair<size_t, size_t>> found;
      found.clear();
      regex_->find_all(text, found);
      for (const auto& [start, end] : found) add_match(start, end);
      break;
    }
    case Kind::kLiteral:
      for (size_t at = text.find(literal_); at != std::string_view::npos;
           at = text.find(literal_, at + literal_.size())) {
        add_match(at, at + literal_.size());
      }
      break;
    case Kind::kDigits:
      for (size_t pos = 0; pos < text.size();) {
        const auto [code_point, length] = unicode::decode_at(text, pos);
        if (unicode::classify(code_point) == CodePointClass::kNumber) add_match(pos, pos + length);
        pos += length;
      }
      break;
  }
  if (done < text.size()) matches.push_back({done, text.size(), false});
}

void SplitStep::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  if (text.empty()) return;
  if (kind_ == Kind::kScanner && behavior_ == SplitBehavior::kIsolated && !invert_) {
    // The scanners' patterns match everywhere: their matches are the pieces.
    return tokenizer::split(scanner_, text, pieces);
  }
  thread_local std::vector<Match> matches;
  matches.clear();
  find_matches(text, matches);
  if (invert_) {
    for (Match& match : matches) match.is_match = !match.is_match;
  }
  // Hugging Face's SplitDelimiterBehavior, as folds over the matches; `removed` marks what
  // Removed drops.
  struct Piece {
    size_t start, end;
    bool removed;
  };
  thread_local std::vector<Piece> kept;
  kept.clear();
  bool previous_match = false;
  switch (behavior_) {
    case SplitBehavior::kRemoved:
    case SplitBehavior::kIsolated:
      for (const Match& match : matches) {
        kept.push_back({match.start, match.end, behavior_ == SplitBehavior::kRemoved && match.is_match});
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Match& match : matches) {
        if (match.is_match && !previous_match && !kept.empty()) kept.back().end = match.end;
        else kept.push_back({match.start, match.end, false});
        previous_match = match.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (size_t i = matches.size(); i-- > 0;) {
        const Match& match = matches[i];
        if (match.is_match && !previous_match && !kept.empty()) kept.back().start = match.start;
        else kept.push_back({match.start, match.end, false});
        previous_match = match.is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Match& match : matches) {
        if (match.is_match == previous_match && !kept.empty()) kept.back().end = match.end;
        else kept.push_back({match.start, match.end, false});
        previous_match = match.is_match;
      }
      break;
  }
  for (const Piece& piece : kept) {
    if (!piece.removed && piece.end > piece.start) pieces.push_back(text.substr(piece.start, piece.end - piece.start));
  }
}

PreTokenizer PreTokenizer::read(const json::Value* config) {
  PreTokenizer pre_tokenizer;
  if (!config || config->is_null()) return pre_tokenizer;
  if (type_of(*config) != "Sequence") {
    pre_tokenizer.read_step(*config, /*last=*/true);
    return pre_tokenizer;
  }
  const json::Value* steps = config->find("pretokenizers");
  if (!steps || !steps->is_array()) throw TokenizerError("pre_tokenizer Sequence without a pretokenizers list");
  const auto& list = steps->as_array();
  for (size_t i = 0; i < list.size(); ++i) {
    if (type_of(list[i]) == "Metaspace" && list.size() > 1) unsupported("Metaspace inside a pre_tokenizer Sequence");
    pre_tokenizer.read_step(list[i], i + 1 == list.size());
  }
  return pre_tokenizer;
}

void PreTokenizer::read_step(const json::Value& step, bool last) {
  const std::string type = type_of(step);
  if (type == "Split") {
    steps_.push_back(SplitStep::read_split(step));
  } else if (type == "Digits") {
    steps_.push_back(SplitStep::digits(flag(step, "individual_digits", false)));
  } else if (type == "Metaspace") {
    metaspace_ = Metaspace::read(step);
  } else if (type == "ByteLevel") {
    // It maps bytes to characters, which later splits would see: only last.
    if (!last) unsupported("ByteLevel before another pre-tokenizer in a Sequence");
    byte_level_ = true;
    add_prefix_space_ = flag(step, "add_prefix_space", true);
    // Hugging Face adds that space to each piece of the earlier steps, not to the text.
    if (add_prefix_space_ && !steps_.empty()) unsupported("ByteLevel with add_prefix_space after a Split or Digits");
    if (flag(step, "use_regex", true)) steps_.push_back(SplitStep::isolated(SplitPattern::kGpt2));
  } else {
    unsupported("pre_tokenizer " + type +
                " (supported: Split, Digits, ByteLevel, Metaspace, a Sequence of them, or none)");
  }
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  if (steps_.size() == 1) return steps_[0].split(text, pieces);
  if (steps_.empty()) {
    if (!text.empty()) pieces.push_back(text);
    return;
  }
  const size_t first = pieces.size();
  steps_[0].split(text, pieces);
  thread_local std::vector<std::string_view> previous;
  for (size_t k = 1; k < steps_.size(); ++k) {
    previous.assign(pieces.begin() + first, pieces.end());
    pieces.resize(first);
    for (const std::string_view piece : previous) steps_[k].split(piece, pieces);
  }
}

}  // namespace barqtrain::tokenizer
