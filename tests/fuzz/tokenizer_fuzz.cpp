// libFuzzer target: encode and decode on fixed tokenizers (one per hand-written split
// pattern, regex Splits run by PCRE2 with several behaviors, added tokens with lstrip,
// rstrip and single_word, two SentencePiece-style ones, built here, plus any tokenizer.json
// named in BARQTRAIN_FUZZ_TOKENIZERS, colon-separated).
//
// Input: one control byte (which tokenizer, which options), then the text. Checks:
//   - invalid UTF-8 is a TokenizerError, never a crash;
//   - each hand-written scanner splits the text as PCRE2 runs its pattern;
//   - decode(encode(x)) == x for valid x when the tokenizer does not normalize;
//   - encode_with_offsets gives encode's ids, with offsets that are ranges of the text
//     (start <= end <= size, on character boundaries);
//   - encode_batch_flat of the text split in two equals encode of each half;
//   - decoding arbitrary ids either works or throws TokenizerError.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/json.h"
#include "data/tokenizer/pre_tokenizer.h"
#include "data/tokenizer/regex.h"
#include "data/tokenizer/tokenizer.h"
#include "data/tokenizer/unicode.h"
#include "data/utf8.h"

namespace tk = barqtrain::tokenizer;

namespace {

std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// GPT-2's byte-level alphabet character for byte b.
std::string byte_level_char(int b) {
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  int cp = b;
  if (!printable) {
    int next = 256;
    for (int x = 0; x < b; ++x) {
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) ++next;
    }
    cp = next;
  }
  std::string out;
  barqtrain::utf8::append(out, static_cast<char32_t>(cp));
  return out;
}

// The added tokens of tiny_config: plain ones, or ones that take white space or match
// single words only.
const char* const kPlainAddedTokens = R"(
    {"id": 300, "content": "<|eot|>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 301, "content": "<|x|>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": true, "special": false})";
const char* const kStrippingAddedTokens = R"(
    {"id": 300, "content": "<|eot|>", "single_word": false, "lstrip": true, "rstrip": true,
     "normalized": false, "special": true},
    {"id": 301, "content": "<|x|>", "single_word": false, "lstrip": false, "rstrip": true,
     "normalized": true, "special": false},
    {"id": 302, "content": "in", "single_word": true, "lstrip": true, "rstrip": false,
     "normalized": false, "special": false})";

std::string tiny_config(const std::string& pre_tokenizer, const std::string& normalizer, bool ignore_merges,
                        const char* added_tokens = kPlainAddedTokens) {
  std::string vocab;
  for (int b = 0; b < 256; ++b) vocab += json_string(byte_level_char(b)) + ": " + std::to_string(b) + ", ";
  vocab += R"("Ġt": 256, "he": 257, "Ġthe": 258, "ll": 259, "Ġa": 260, "in": 261, "Ġthell": 262)";
  return R"({"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [)" + std::string(added_tokens) + R"(],
    "normalizer": )" + normalizer + R"(, "pre_tokenizer": )" + pre_tokenizer + R"(,
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<|eot|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [], "special_tokens": {"<|eot|>": {"id": "<|eot|>", "ids": [300], "tokens": ["<|eot|>"]}}},
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
              "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": )" +
         (ignore_merges ? "true" : "false") + R"(, "vocab": {)" + vocab +
         R"(}, "merges": ["Ġ t", "h e", "Ġt he", ["l", "l"], "Ġ a", "i n", "Ġthe ll"]}})";
}

// Sequence[steps..., ByteLevel without its regex].
std::string then_byte_level(const std::string& steps) {
  return R"({"type": "Sequence", "pretokenizers": [)" + steps + R"(,
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})";
}

std::string split_step(std::string_view regex, const char* behavior, bool invert) {
  return R"({"type": "Split", "pattern": {"Regex": )" + json_string(regex) + R"(}, "behavior": ")" + behavior +
         R"(", "invert": )" + (invert ? "true" : "false") + "}";
}

std::string split_pre_tokenizer(tk::SplitPattern pattern) {
  return then_byte_level(split_step(tk::regex_of(pattern), "Isolated", false));
}

// Mistral's Tekken pattern, which has no hand-written scanner.
constexpr std::string_view kTekkenRegex =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// A SentencePiece-style BPE over a few characters, with <0xNN> tokens for every byte
// (ids 3..258) and an unknown token, under the given normalizer / pre-tokenizer / decoder.
std::string sentencepiece_config(const std::string& normalizer, const std::string& pre_tokenizer,
                                 const std::string& decoder, bool byte_fallback) {
  static const char* const kHex = "0123456789ABCDEF";
  std::string vocab = R"("<unk>": 0, "<s>": 1, "</s>": 2, )";
  for (int b = 0; b < 256; ++b) {
    vocab += std::string("\"<0x") + kHex[b >> 4] + kHex[b & 15] + ">\": " + std::to_string(3 + b) + ", ";
  }
  vocab += R"("▁": 259, "t": 260, "h": 261, "e": 262, "a": 263, "é": 264, "▁t": 265, "he": 266, "▁the": 267,
              "▁a": 268, "▁▁": 269)";
  return R"({"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [{"id": 0, "content": "<unk>", "special": true, "normalized": false},
                     {"id": 1, "content": "<s>", "special": true, "normalized": false},
                     {"id": 2, "content": "</s>", "special": true, "normalized": false},
                     {"id": 270, "content": "the end", "special": false, "normalized": true}],
    "normalizer": )" + normalizer + R"(, "pre_tokenizer": )" + pre_tokenizer + R"(,
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": )" + decoder + R"(,
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": )" +
         (byte_fallback ? "true" : "false") + R"(, "vocab": {)" + vocab +
         R"(}, "merges": ["▁ t", "h e", "▁t he", "▁ a", "▁ ▁"]}})";
}

struct Fixture {
  std::unique_ptr<tk::Tokenizer> tokenizer;
  bool round_trips;  // decode(encode(x)) == x: no normalizer, no prefix space
};

std::vector<Fixture> make_fixtures() {
  std::vector<Fixture> fixtures;
  const std::string byte_level = R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})";
  const std::string prefixed = R"({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true})";
  auto add = [&](const std::string& config, bool round_trips) {
    fixtures.push_back({std::make_unique<tk::Tokenizer>(barqtrain::json::parse(config)), round_trips});
  };
  add(tiny_config(byte_level, "null", false), true);
  add(tiny_config(prefixed, "null", false), false);
  add(tiny_config(split_pre_tokenizer(tk::SplitPattern::kLlama3), "null", true), true);
  add(tiny_config(split_pre_tokenizer(tk::SplitPattern::kQwen2), R"({"type": "NFC"})", false), false);
  // Regex Splits run by PCRE2: Tekken's; a Split inverted and merged, then Digits; one that
  // drops what it matches, with an empty-matching alternative.
  add(tiny_config(then_byte_level(split_step(kTekkenRegex, "Isolated", false)), "null", false), true);
  add(tiny_config(then_byte_level(split_step(R"(\s+|\p{P}+)", "MergedWithNext", true) +
                                  R"(, {"type": "Digits", "individual_digits": true})"),
                  "null", false),
      true);
  add(tiny_config(then_byte_level(split_step(R"(\h+|x*|(?=\p{N}))", "Removed", false)), "null", false), false);
  add(tiny_config(split_pre_tokenizer(tk::SplitPattern::kLlama3), "null", false, kStrippingAddedTokens), false);
  // Llama-2's legacy normalizer and decoder: round-trips text without added tokens only.
  add(sentencepiece_config(
          R"({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
              {"type": "NFC"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})",
          "null",
          R"({"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
              {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})",
          true),
      false);
  add(sentencepiece_config(
          "null", R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true})",
          R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true})", false),
      false);
  if (const char* paths = std::getenv("BARQTRAIN_FUZZ_TOKENIZERS")) {
    std::string_view rest(paths);
    while (!rest.empty()) {
      const size_t colon = rest.find(':');
      const std::string path(rest.substr(0, colon));
      rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
      if (path.empty()) continue;
      fixtures.push_back({std::make_unique<tk::Tokenizer>(tk::Tokenizer::from_file(path)),
                          path.find("qwen") == std::string::npos && path.find("gpt2") == std::string::npos});
    }
  }
  return fixtures;
}

// Aborts unless each hand-written scanner splits text (valid UTF-8) as PCRE2 matches its
// regex.
void check_scanners(std::string_view text) {
  static const tk::Regex gpt2(tk::regex_of(tk::SplitPattern::kGpt2));
  static const tk::Regex llama3(tk::regex_of(tk::SplitPattern::kLlama3));
  static const tk::Regex qwen2(tk::regex_of(tk::SplitPattern::kQwen2));
  const std::pair<tk::SplitPattern, const tk::Regex*> scanners[] = {
      {tk::SplitPattern::kGpt2, &gpt2}, {tk::SplitPattern::kLlama3, &llama3}, {tk::SplitPattern::kQwen2, &qwen2}};
  for (const auto& [pattern, regex] : scanners) {
    std::vector<std::string_view> pieces;
    tk::split(pattern, text, pieces);
    std::vector<std::pair<size_t, size_t>> matches;
    regex->find_all(text, matches);
    if (matches.size() != pieces.size()) std::abort();
    for (size_t i = 0; i < pieces.size(); ++i) {
      const size_t start = pieces[i].data() - text.data();
      if (matches[i] != std::make_pair(start, start + pieces[i].size())) std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<Fixture> fixtures = make_fixtures();
  if (size == 0) return 0;
  const uint8_t control = data[0];
  const Fixture& fixture = fixtures[control % fixtures.size()];
  const tk::Tokenizer& tokenizer = *fixture.tokenizer;
  tk::EncodeOptions options;
  options.add_special_tokens = (control & 0x40) != 0;
  options.split_special_tokens = (control & 0x80) != 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);

  if (tk::unicode::find_invalid_utf8(text) != text.size()) {
    try {
      tokenizer.encode(text, options);
      std::abort();  // invalid UTF-8 must be rejected
    } catch (const tk::TokenizerError&) {
    }
  } else {
    check_scanners(text);
    const std::vector<tk::TokenId> ids = tokenizer.encode(text, options);
    for (const tk::TokenId id : ids) {
      if (id >= tokenizer.id_bound()) std::abort();
    }
    const tk::Tokenizer::Encoding encoding = tokenizer.encode_with_offsets(text, options);
    if (encoding.ids != ids || encoding.offsets.size() != ids.size()) std::abort();
    auto on_boundary = [&](uint32_t at) {
      return at == text.size() || (at < text.size() && (static_cast<uint8_t>(text[at]) & 0xC0) != 0x80);
    };
    for (const tk::Span& span : encoding.offsets) {
      if (span.start > span.end || span.end > text.size() || !on_boundary(span.start) || !on_boundary(span.end)) {
        std::abort();
      }
    }
    // Without the post-processor's BOS, decoding (special tokens kept) gives the text back.
    const std::string decoded = tokenizer.decode(ids, /*skip_special_tokens=*/false);
    if (fixture.round_trips && !options.add_special_tokens && decoded != text) std::abort();
    // The batch paths agree with encode on the text cut at a code point boundary.
    size_t cut = text.size() / 2;
    while (cut < text.size() && (static_cast<uint8_t>(text[cut]) & 0xC0) == 0x80) ++cut;
    const std::vector<std::string_view> halves{text.substr(0, cut), text.substr(cut)};
    const tk::Tokenizer::FlatIds flat = tokenizer.encode_batch_flat(halves, options, 2);
    std::vector<tk::TokenId> expected = tokenizer.encode(halves[0], options);
    const std::vector<tk::TokenId> second = tokenizer.encode(halves[1], options);
    expected.insert(expected.end(), second.begin(), second.end());
    if (flat.ids != expected || flat.offsets.size() != 3) std::abort();
  }

  // Decoding arbitrary ids: text or a TokenizerError.
  std::vector<tk::TokenId> ids;
  for (size_t i = 1; i + 1 < size && ids.size() < 64; i += 2) {
    ids.push_back(static_cast<tk::TokenId>((data[i] | (data[i + 1] << 8)) % (tokenizer.id_bound() + 2)));
  }
  try {
    (void)tokenizer.decode(ids, (control & 1) != 0);
  } catch (const tk::TokenizerError&) {
  }
  return 0;
}
