#include "data/tokenizer/pre_tokenizer.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "data/tokenizer/error.h"
#include "data/tokenizer/regex.h"
#include "data/tokenizer/unicode.h"

namespace barqtrain::tokenizer {
namespace {

std::vector<std::string> pieces_of(SplitPattern pattern, std::string_view text) {
  std::vector<std::string_view> views;
  split(pattern, text, views);
  return {views.begin(), views.end()};
}

using Pieces = std::vector<std::string>;

TEST(SplitPattern, RecognizesTheRegexStrings) {
  for (const SplitPattern pattern : {SplitPattern::kGpt2, SplitPattern::kLlama3, SplitPattern::kQwen2}) {
    EXPECT_EQ(split_pattern_from_regex(regex_of(pattern)), pattern);
  }
  EXPECT_EQ(split_pattern_from_regex(R"(\s+)"), std::nullopt);
}

TEST(Gpt2Split, WordsNumbersPunctuationAndContractions) {
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "Hello world, it's 2024!!"),
            (Pieces{"Hello", " world", ",", " it", "'s", " 2024", "!!"}));
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "they'RE we'll"), (Pieces{"they", "'", "RE", " we", "'ll"}));
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "12345 abc123"), (Pieces{"12345", " abc", "123"}));
}

TEST(Gpt2Split, WhiteSpaceRunsLeaveTheirLastSpaceToTheNextWord) {
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "a   b"), (Pieces{"a", "  ", " b"}));
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "a\n\nb"), (Pieces{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "a \t b  "), (Pieces{"a", " \t", " b", "  "}));
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "\t"), (Pieces{"\t"}));
}

TEST(Gpt2Split, UnicodeClasses) {
  // Letters with combining marks: the marks (Mn) are neither \p{L} nor \p{N}.
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "cafe\xCC\x81 \xE4\xB8\xAD\xE6\x96\x87"),
            (Pieces{"cafe", "\xCC\x81", " \xE4\xB8\xAD\xE6\x96\x87"}));
  // U+00A0 NO-BREAK SPACE is white space; U+00BD VULGAR FRACTION ONE HALF is a number.
  EXPECT_EQ(pieces_of(SplitPattern::kGpt2, "a\xC2\xA0\xC2\xBD"), (Pieces{"a", "\xC2\xA0", "\xC2\xBD"}));
}

TEST(Llama3Split, CaseInsensitiveContractionsAndThreeDigitNumbers) {
  EXPECT_EQ(pieces_of(SplitPattern::kLlama3, "I'M 1234567 they'Re"),
            (Pieces{"I", "'M", " ", "123", "456", "7", " they", "'Re"}));
  // U+017F LATIN SMALL LETTER LONG S case-folds to s.
  EXPECT_EQ(pieces_of(SplitPattern::kLlama3, "'\xC5\xBFx"), (Pieces{"'\xC5\xBF", "x"}));
}

TEST(Llama3Split, OnePunctuationCharacterJoinsTheWordAfterIt) {
  EXPECT_EQ(pieces_of(SplitPattern::kLlama3, "(hello) 'world"), (Pieces{"(hello", ")", " '", "world"}));
  EXPECT_EQ(pieces_of(SplitPattern::kLlama3, "\tfoo"), (Pieces{"\tfoo"}));
}

TEST(Llama3Split, LineBreaksEndWhiteSpaceAndPunctuationRuns) {
  EXPECT_EQ(pieces_of(SplitPattern::kLlama3, "x  \n\n  y"), (Pieces{"x", "  \n\n", " ", " y"}));
  EXPECT_EQ(pieces_of(SplitPattern::kLlama3, "end.\r\n\r\nNext"), (Pieces{"end", ".\r\n\r\n", "Next"}));
  EXPECT_EQ(pieces_of(SplitPattern::kLlama3, "a \n"), (Pieces{"a", " \n"}));
}

TEST(Qwen2Split, OneDigitPerPiece) {
  EXPECT_EQ(pieces_of(SplitPattern::kQwen2, "x 2024"), (Pieces{"x", " ", "2", "0", "2", "4"}));
}

// ---------------------------------------------------------------- the regex engine

// Texts where the patterns' classes meet: scripts, marks, digits of several kinds, every
// kind of white space (NEL, the Mongolian vowel separator, which is not white space, line
// and paragraph separators), contractions in odd cases, line breaks, emoji and long runs.
std::vector<std::string> varied_texts() {
  std::vector<std::string> texts = {
      "Hello world, it's 2024!! they'RE we'LL I'M 'S 'ſx don't",
      "Привет, мир! Ünïcödé façade naïve résumé",
      "مرحبا بالعالم ١٢٣ שלום עולם",
      "नमस्ते दुनिया ५६७ தமிழ் ไทย ภาษา",
      "日本語のテキスト、カタカナ。한국어 텍스트 ㄱㄴ",
      "emoji 😀👍🏽👨‍👩‍👧‍👦 🇯🇵 ❤️ ✨",
      "Ελληνικά Ἀθῆναι ᾅ ǅ Ǆ ǆ ﬁ ﬆ Ⅻ ½ ² ①",
      "e\u0301 a\u0308\u0304 \u1100\u1161\u11a8 \u0301\u0301 marks",
      "  \n\n \t\t \r\n\r\n   x   y \u00a0\u3000z\u2028 \u2029 \u0085 \u180e \u200b end ",
      "1234567890 123 1.5 1,000,000 ٣٤٥٦ 12a34 ⅛⅜",
      "def f(x):\n\tif x >= 10_000:  # comment\n\t\treturn {\"a\": [1, 2.5e-3]}\r\n    return x**2 // 3\n",
      "!!!???...\n\n\n;;;   ---\r\r\n",
      std::string(3000, 'a') + " " + std::string(2000, ' ') + "b" + std::string(500, '\n'),
      "",
      " ",
      "'",
  };
  // Random mixtures of the characters above, seeded.
  std::vector<std::string> characters;
  for (const std::string& text : texts) {
    for (size_t pos = 0; pos < text.size() && pos < 200; pos += unicode::decode_at(text, pos).length) {
      characters.push_back(text.substr(pos, unicode::decode_at(text, pos).length));
    }
  }
  std::mt19937 rng(17);
  for (int i = 0; i < 300; ++i) {
    std::string mixture;
    const size_t length = 1 + rng() % 60;
    for (size_t k = 0; k < length; ++k) mixture += characters[rng() % characters.size()];
    texts.push_back(mixture);
  }
  return texts;
}

using Matches = std::vector<std::pair<size_t, size_t>>;

Matches regex_matches(const Regex& regex, std::string_view text) {
  Matches matches;
  regex.find_all(text, matches);
  return matches;
}

TEST(Regex, EachScannerSplitsAsThePcre2Pattern) {
  for (const SplitPattern pattern : {SplitPattern::kGpt2, SplitPattern::kLlama3, SplitPattern::kQwen2}) {
    const Regex regex(regex_of(pattern));
    EXPECT_TRUE(regex.jit_compiled());
    for (const std::string& text : varied_texts()) {
      std::vector<std::string_view> pieces;
      split(pattern, text, pieces);
      Matches scanned;
      for (const std::string_view piece : pieces) {
        scanned.emplace_back(piece.data() - text.data(), piece.data() - text.data() + piece.size());
      }
      EXPECT_EQ(scanned, regex_matches(regex, text)) << regex_of(pattern) << " on " << text.substr(0, 80);
    }
  }
}

TEST(Regex, OnigurumaClassesAreRewritten) {
  // Oniguruma's \s is White_Space (NEL yes, U+180E no); \w holds marks, all numbers and
  // connector punctuation; \h is a hex digit.
  EXPECT_EQ(regex_matches(Regex(R"(\s+)"), "a\u0085b\u180e c"), (Matches{{1, 3}, {7, 8}}));
  EXPECT_EQ(regex_matches(Regex(R"(\w+)"), "a_b\u0301\u00b2-\u203f"),
            (Matches{{0, 7}, {8, 11}}));
  EXPECT_EQ(regex_matches(Regex(R"(\h+)"), "cafe go"), (Matches{{0, 4}}));
  EXPECT_EQ(regex_matches(Regex(R"([^\s\w]+)"), "a, b"), (Matches{{1, 2}}));
  EXPECT_EQ(regex_matches(Regex(R"(\u00e9)"), "caf\u00e9"), (Matches{{3, 5}}));
  // A script is the Script property, not Script_Extensions: U+30FC (Common) is not Katakana.
  EXPECT_EQ(regex_matches(Regex(R"(\p{Katakana}+)"), "カナー"), (Matches{{0, 6}}));
  EXPECT_EQ(oniguruma_to_pcre2(R"(\p{Han}\P{L}\p{^Greek})"), R"(\p{sc:Han}\P{L}\P{sc:Greek})");
  EXPECT_EQ(oniguruma_to_pcre2(R"([\]\s](?i:ab)\\s)"),
            R"([\]\t\n\x0B\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}](?i:ab)\\s)");
}

TEST(Regex, LinesAreOnigurumas) {
  // Expected: Hugging Face tokenizers' matches (Oniguruma's Ruby syntax): ^ and $ at every
  // \n, . stops at \n only, \R is any line break.
  EXPECT_EQ(regex_matches(Regex("^a|b$"), "a\nab\nb"), (Matches{{0, 1}, {2, 3}, {3, 4}, {5, 6}}));
  EXPECT_EQ(regex_matches(Regex(".+"), "ab\ncd\r\nef"), (Matches{{0, 2}, {3, 6}, {7, 9}}));
  EXPECT_EQ(regex_matches(Regex(R"(\R)"), "x\r\ny\u2028z\u0085w"), (Matches{{1, 3}, {4, 7}, {8, 10}}));
}

TEST(Regex, EmptyMatchesFollowOnigurumasIteration) {
  // After a match ending at e, an empty match at e is dropped and the search moves on one
  // character: `b` at 1 is never matched, as in Hugging Face tokenizers.
  EXPECT_EQ(regex_matches(Regex("a*|b"), "xbaab"),
            (Matches{{0, 0}, {1, 1}, {2, 4}, {5, 5}}));
  EXPECT_EQ(regex_matches(Regex("(?=é)"), "éé"), (Matches{{0, 0}, {2, 2}}));
}

TEST(Regex, WhatMeansSomethingElseInPcre2IsRefusedByName) {
  auto error_of = [](const char* pattern) -> std::string {
    try {
      Regex{pattern};
    } catch (const TokenizerError& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_NE(error_of(R"(\bword\b)").find("word boundaries"), std::string::npos);
  EXPECT_NE(error_of("(?m:.+)").find("inline flag m"), std::string::npos);
  EXPECT_NE(error_of("[a[b]]").find("nested character classes"), std::string::npos);
  EXPECT_NE(error_of("[a-z&&[^aeiou]]").find("class intersection"), std::string::npos);
  EXPECT_NE(error_of("[[:punct:]]").find("POSIX bracket classes"), std::string::npos);
  EXPECT_NE(error_of(R"([^\S])").find("\\S inside [...]"), std::string::npos);
  EXPECT_NE(error_of("(unclosed").find("Split regex (unclosed: missing closing parenthesis"), std::string::npos);
  // One line, whatever the pattern holds.
  EXPECT_EQ(error_of("[\r\n]\\b").find('\n'), std::string::npos);
  EXPECT_NE(error_of("[\r\n]\\b").find(R"(Split regex [\r\n]\b: word boundaries)"), std::string::npos);
}

TEST(Regex, WordCharactersAreTheRustRegexCratesWordClass) {
  EXPECT_TRUE(is_word_character_at("a", 0));
  EXPECT_TRUE(is_word_character_at("x\u0301", 1));  // a mark
  EXPECT_TRUE(is_word_character_at("\u0663", 0));   // ARABIC-INDIC DIGIT THREE
  EXPECT_TRUE(is_word_character_at("\u24b6", 0));   // CIRCLED LATIN CAPITAL LETTER A: Alphabetic
  EXPECT_FALSE(is_word_character_at("\u00b2", 0));  // SUPERSCRIPT TWO: No, not Nd
  EXPECT_FALSE(is_word_character_at(" ", 0));
  EXPECT_FALSE(is_word_character_at("<", 0));
}

// ---------------------------------------------------------------- Split steps

Pieces split_with(const std::string& split_config, std::string_view text) {
  const SplitStep step = SplitStep::read_split(json::parse(split_config));
  std::vector<std::string_view> views;
  step.split(text, views);
  return {views.begin(), views.end()};
}

std::string split_json(const std::string& pattern, const std::string& behavior, bool invert) {
  return R"({"type": "Split", "pattern": )" + pattern + R"(, "behavior": ")" + behavior +
         R"(", "invert": )" + (invert ? "true" : "false") + "}";
}

TEST(SplitStep, BehaviorsAndInvertAsHuggingFace) {
  // Expected pieces: Hugging Face tokenizers' Split(Regex("[,; ]"), behavior, invert) on "a, b;; c".
  const std::string pattern = R"({"Regex": "[,; ]"})";
  const std::string text = "a, b;; c";
  const std::vector<std::tuple<std::string, bool, Pieces>> cases = {
      {"Removed", false, {"a", "b", "c"}},
      {"Removed", true, {",", " ", ";", ";", " "}},
      {"Isolated", false, {"a", ",", " ", "b", ";", ";", " ", "c"}},
      {"Isolated", true, {"a", ",", " ", "b", ";", ";", " ", "c"}},
      {"MergedWithPrevious", false, {"a,", " ", "b;", ";", " ", "c"}},
      {"MergedWithPrevious", true, {"a", ",", " b", ";", ";", " c"}},
      {"MergedWithNext", false, {"a", ",", " b", ";", ";", " c"}},
      {"MergedWithNext", true, {"a,", " ", "b;", ";", " ", "c"}},
      {"Contiguous", false, {"a", ", ", "b", ";; ", "c"}},
      {"Contiguous", true, {"a", ", ", "b", ";; ", "c"}},
  };
  for (const auto& [behavior, invert, expected] : cases) {
    EXPECT_EQ(split_with(split_json(pattern, behavior, invert), text), expected) << behavior << " invert " << invert;
  }
}

TEST(SplitStep, LiteralStringPatterns) {
  const std::string pattern = R"({"String": "ab"})";
  EXPECT_EQ(split_with(split_json(pattern, "Removed", false), "xabab yab"), (Pieces{"x", " y"}));
  EXPECT_EQ(split_with(split_json(pattern, "MergedWithPrevious", false), "xabab yab"), (Pieces{"xab", "ab", " yab"}));
  EXPECT_EQ(split_with(split_json(pattern, "MergedWithNext", false), "xabab yab"), (Pieces{"x", "ab", "ab y", "ab"}));
  EXPECT_EQ(split_with(split_json(pattern, "Contiguous", false), "xabab yab"), (Pieces{"x", "abab", " y", "ab"}));
}

TEST(SplitStep, DigitsIsolatedOrContiguous) {
  auto digits = [](bool individual, std::string_view text) {
    std::vector<std::string_view> views;
    SplitStep::digits(individual).split(text, views);
    return Pieces(views.begin(), views.end());
  };
  // Every \p{N} character counts, Arabic-Indic digits included.
  EXPECT_EQ(digits(true, "a12b345 ٣٤"), (Pieces{"a", "1", "2", "b", "3", "4", "5", " ", "٣", "٤"}));
  EXPECT_EQ(digits(false, "a12b345 ٣٤"), (Pieces{"a", "12", "b", "345", " ", "٣٤"}));
}

TEST(SplitStep, MalformedSplitsAreNamed) {
  auto error_of = [](const std::string& config) -> std::string {
    try {
      SplitStep::read_split(json::parse(config));
    } catch (const TokenizerError& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_NE(error_of(split_json(R"({"String": ""})", "Isolated", false)).find("non-empty"), std::string::npos);
  EXPECT_NE(error_of(split_json(R"({"Regex": "x"})", "Sideways", false)).find("unknown behavior Sideways"),
            std::string::npos);
}

TEST(PreTokenizer, StepsRunInOrderAndByteLevelComesLast) {
  const json::Value config = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
      {"type": "Split", "pattern": {"Regex": "[一-龥]+"}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]})");
  const PreTokenizer deepseek_like = PreTokenizer::read(&config);
  EXPECT_TRUE(deepseek_like.byte_level());
  std::vector<std::string_view> views;
  deepseek_like.split("ab12345中文 x", views);
  EXPECT_EQ(Pieces(views.begin(), views.end()), (Pieces{"ab", "123", "45", "中文", " x"}));
  auto error_of = [](const char* config) -> std::string {
    try {
      const json::Value value = json::parse(config);
      PreTokenizer::read(&value);
    } catch (const TokenizerError& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_NE(error_of(R"({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "Digits"}]})")
                .find("ByteLevel before another pre-tokenizer"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"type": "Sequence", "pretokenizers": [{"type": "Digits"},
                         {"type": "ByteLevel", "add_prefix_space": true}]})")
                .find("ByteLevel with add_prefix_space after a Split or Digits"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"type": "Whitespace"})").find("pre_tokenizer Whitespace"), std::string::npos);
}

}  // namespace
}  // namespace barqtrain::tokenizer
