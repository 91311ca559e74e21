#include "data/tokenizer/pre_tokenizer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

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

}  // namespace
}  // namespace barqtrain::tokenizer
