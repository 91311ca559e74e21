#include "data/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "data/tokenizer/unicode.h"
#include "data/utf8.h"

namespace barqtrain::tokenizer {
namespace {

// GPT-2's byte-level spelling of one byte, written out so the test does not depend on the
// implementation's table.
std::string byte_level_char(int byte) {
  const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
  int code_point = byte;
  if (!printable) {
    code_point = 256;
    for (int b = 0; b < byte; ++b) {
      if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) ++code_point;
    }
  }
  std::string out;
  barqtrain::utf8::append(out, static_cast<char32_t>(code_point));
  return out;
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// A tiny byte-level BPE: the 256 byte tokens (ids 0..255), then "Ġt" (256), "he" (257),
// "Ġthe" (258), "ll" (259); merges in that order; "<|eot|>" (300) is a special token.
std::string tiny_tokenizer_json(const std::string& extra_model_options = "",
                                const std::string& post_processor = "null",
                                const std::string& normalizer = "null") {
  std::string vocab;
  for (int b = 0; b < 256; ++b) vocab += json_string(byte_level_char(b)) + ": " + std::to_string(b) + ", ";
  vocab += R"("Ġt": 256, "he": 257, "Ġthe": 258, "ll": 259)";
  return R"({"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [{"id": 300, "content": "<|eot|>", "single_word": false, "lstrip": false,
                      "rstrip": false, "normalized": false, "special": true}],
    "normalizer": )" + normalizer + R"(,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": )" + post_processor + R"(,
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
              "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false)" + extra_model_options + R"(,
              "vocab": {)" + vocab + R"(}, "merges": ["Ġ t", "h e", "Ġt he", ["l", "l"]]}})";
}

Tokenizer tiny(const std::string& extra_model_options = "", const std::string& post_processor = "null",
               const std::string& normalizer = "null") {
  return Tokenizer(json::parse(tiny_tokenizer_json(extra_model_options, post_processor, normalizer)));
}

std::string error_of(const std::string& config) {
  try {
    Tokenizer{json::parse(config)};
  } catch (const TokenizerError& error) {
    return error.what();
  }
  return "";
}

using Ids = std::vector<TokenId>;
using Offsets = std::vector<std::pair<uint32_t, uint32_t>>;

// The ids of text and their offsets, as (start, end) pairs.
std::pair<Ids, Offsets> ids_and_offsets(const Tokenizer& tokenizer, std::string_view text) {
  const auto encoding = tokenizer.encode_with_offsets(text);
  Offsets offsets;
  for (const Span& span : encoding.offsets) offsets.emplace_back(span.start, span.end);
  return {encoding.ids, offsets};
}

TEST(Tokenizer, MergesByRank) {
  const Tokenizer tokenizer = tiny();
  // " the" -> Ġ t h e -> Ġt h e -> Ġt he -> Ġthe; "hello" -> h e l l o -> he l l o -> he ll o.
  EXPECT_EQ(tokenizer.encode(" the hello"), (Ids{258, ' ', 257, 259, 'o'}));
  EXPECT_EQ(tokenizer.encode(""), Ids{});
}

TEST(Tokenizer, MatchesSpecialTokensUnlessAskedNotTo) {
  const Tokenizer tokenizer = tiny();
  EXPECT_EQ(tokenizer.encode("a<|eot|>b"), (Ids{'a', 300, 'b'}));
  EncodeOptions as_text;
  as_text.split_special_tokens = true;
  EXPECT_EQ(tokenizer.encode("a<|eot|>", as_text), (Ids{'a', '<', '|', 'e', 'o', 't', '|', '>'}));
}

TEST(Tokenizer, TemplateProcessingAddsSpecialTokens) {
  const Tokenizer tokenizer = tiny("", R"({"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<|eot|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [], "special_tokens": {"<|eot|>": {"id": "<|eot|>", "ids": [300], "tokens": ["<|eot|>"]}}})");
  EXPECT_EQ(tokenizer.encode("a"), (Ids{300, 'a'}));
  EncodeOptions plain;
  plain.add_special_tokens = false;
  EXPECT_EQ(tokenizer.encode("a", plain), (Ids{'a'}));
}

TEST(Tokenizer, IgnoreMergesEmitsAVocabularyWordWhole) {
  // "Ġthe" is in the vocabulary; with ignore_merges it is found without merging, which
  // matters only when the merges would not reach it. Here both agree.
  EXPECT_EQ(tiny(R"(, "ignore_merges": true)").encode(" the"), (Ids{258}));
}

TEST(Tokenizer, DecodeInvertsEncodeAndReplacesInvalidUtf8) {
  const Tokenizer tokenizer = tiny();
  const std::string text = " the hello, \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80<|eot|>";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(text)), text);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(text), /*skip_special_tokens=*/true),
            text.substr(0, text.size() - 7));
  EXPECT_EQ(tokenizer.decode(Ids{0xE4, 'a'}), "\xEF\xBF\xBD" "a");
  EXPECT_THROW(tokenizer.decode(Ids{299}), TokenizerError);
}

TEST(Tokenizer, NfcNormalizerComposes) {
  const Tokenizer tokenizer = tiny("", "null", R"({"type": "NFC"})");
  // e + COMBINING ACUTE ACCENT -> U+00E9; HANGUL L + V -> one syllable.
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("e\xCC\x81")), "\xC3\xA9");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xE1\x84\x80\xE1\x85\xA1")), "\xEA\xB0\x80");
}

TEST(Tokenizer, RejectsInvalidUtf8Input) {
  try {
    tiny().encode("ab\xFF");
    FAIL() << "expected a TokenizerError";
  } catch (const TokenizerError& error) {
    EXPECT_STREQ(error.what(), "input text is not valid UTF-8 (byte offset 2)");
  }
}

TEST(Tokenizer, BatchEqualsOneByOne) {
  const Tokenizer tokenizer = tiny();
  std::vector<std::string> texts;
  for (int i = 0; i < 100; ++i) texts.push_back(std::string(i, 'x') + " the hello " + std::to_string(i));
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  const auto batch = tokenizer.encode_batch(views, {}, 4);
  ASSERT_EQ(batch.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(batch[i], tokenizer.encode(texts[i]));
}

TEST(Tokenizer, FlatBatchEqualsOneByOneOnAnyThreadCount) {
  const Tokenizer tokenizer = tiny();
  std::vector<std::string> texts;
  for (int i = 0; i < 1000; ++i) texts.push_back(i % 7 == 0 ? "" : std::string(i % 50, 'x') + " the " + std::to_string(i));
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  for (const size_t threads : {1, 2, 3, 8}) {
    const Tokenizer::FlatIds flat = tokenizer.encode_batch_flat(views, {}, threads);
    ASSERT_EQ(flat.offsets.size(), texts.size() + 1);
    EXPECT_EQ(flat.offsets.front(), 0);
    EXPECT_EQ(static_cast<size_t>(flat.offsets.back()), flat.ids.size());
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::vector<TokenId> ids(flat.ids.begin() + flat.offsets[i], flat.ids.begin() + flat.offsets[i + 1]);
      ASSERT_EQ(ids, tokenizer.encode(texts[i])) << "text " << i << ", " << threads << " threads";
    }
  }
  EXPECT_EQ(tokenizer.encode_batch_flat({}, {}, 2).offsets, std::vector<int64_t>{0});
}

TEST(Tokenizer, BatchRethrowsAnEncodingError) {
  const Tokenizer tokenizer = tiny();
  std::vector<std::string_view> views(500, "the hello");
  views[321] = "bad \xFF";
  EXPECT_THROW(tokenizer.encode_batch_flat(views, {}, 2), TokenizerError);
  EXPECT_THROW(tokenizer.encode_batch(views, {}, 2), TokenizerError);
  views[321] = "fine";
  EXPECT_EQ(tokenizer.encode_batch(views, {}, 2).size(), views.size());  // the pool still works
}

TEST(Tokenizer, UnsupportedFeaturesAreNamed) {
  std::string config = tiny_tokenizer_json();
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string copy = config;
    copy.replace(copy.find(from), from.size(), to);
    return copy;
  };
  EXPECT_NE(error_of(replaced(R"("normalizer": null)", R"("normalizer": {"type": "NFKC"})")).find("normalizer NFKC"),
            std::string::npos);
  EXPECT_NE(error_of(replaced(R"("normalizer": null)",
                              R"("normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": "_"})"))
                .find("normalizer Replace with a Regex pattern"),
            std::string::npos);
  EXPECT_NE(error_of(replaced(R"("type": "BPE")", R"("type": "WordPiece")")).find("model type WordPiece"),
            std::string::npos);
  EXPECT_NE(error_of(replaced(R"("decoder": {"type": "ByteLevel")", R"("decoder": {"type": "Metaspace")"))
                .find("decoder Metaspace"),
            std::string::npos);
  EXPECT_NE(error_of(replaced(R"("pre_tokenizer": {"type": "ByteLevel")", R"("pre_tokenizer": {"type": "Whitespace")"))
                .find("pre_tokenizer Whitespace"),
            std::string::npos);
  // A SentencePiece-style pre-tokenizer with the byte-level decoder is refused, not mixed.
  EXPECT_NE(error_of(replaced(R"("pre_tokenizer": {"type": "ByteLevel")",
                              R"("pre_tokenizer": {"type": "Metaspace", "replacement": "▁")"))
                .find("decoder ByteLevel with a SentencePiece-style"),
            std::string::npos);
  EXPECT_NE(error_of(replaced(R"("post_processor": null)", R"("post_processor": {"type": "BertProcessing"})"))
                .find("post_processor BertProcessing"),
            std::string::npos);
  EXPECT_NE(error_of(replaced(R"("Ġt he")", R"("Ġt hx")")).find("merges[2]"), std::string::npos);
  EXPECT_NE(error_of(replaced(R"("ll": 259)", R"("ll": 258)")).find("token id 258 is given to two tokens"),
            std::string::npos);
}

TEST(Tokenizer, AddedTokensTakeWhiteSpaceAndMatchSingleWords) {
  // <|eot|> with lstrip and rstrip; "ab" with single_word. The expected ids and offsets are
  // Hugging Face tokenizers' on the same file (its offsets turned into bytes).
  std::string config = tiny_tokenizer_json();
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {R"("lstrip": false)", R"("lstrip": true)"},
           {R"("rstrip": false)", R"("rstrip": true)"},
           {R"("added_tokens": [)", R"("added_tokens": [{"id": 301, "content": "ab", "single_word": true,
                                      "special": false, "normalized": false}, )"}}) {
    config.replace(config.find(from), from.size(), to);
  }
  const Tokenizer tokenizer{json::parse(config)};
  EXPECT_EQ(ids_and_offsets(tokenizer, "a  <|eot|>\n b"),
            std::make_pair(Ids{97, 300, 98}, Offsets{{0, 1}, {1, 12}, {12, 13}}));
  EXPECT_EQ(ids_and_offsets(tokenizer, "  <|eot|><|eot|> "), std::make_pair(Ids{300, 300}, Offsets{{0, 9}, {9, 17}}));
  EXPECT_EQ(ids_and_offsets(tokenizer, "ab cab ab_ (ab)\xC3\xA9 ab").first,
            (Ids{301, 32, 99, 97, 98, 32, 97, 98, 95, 32, 40, 301, 41, 195, 169, 32, 301}));
}

TEST(Tokenizer, BytesWithoutATokenAreDroppedAsHuggingFaceDoes) {
  // A byte-level vocabulary without byte 0x04 (SmolLM's lacks a few bytes): the byte gives no
  // token, and the tokens after it in its piece are laid out from the piece's start in the
  // byte-level string, as Hugging Face's offsets are (expected values: tokenizers' own).
  std::string config = tiny_tokenizer_json();
  const std::string byte_4 = json_string(byte_level_char(4)) + ": 4, ";
  config.erase(config.find(byte_4), byte_4.size());
  const Tokenizer tokenizer{json::parse(config)};
  EXPECT_EQ(ids_and_offsets(tokenizer, "a\x04" "b"), std::make_pair(Ids{97, 98}, Offsets{{0, 1}, {2, 3}}));
  EXPECT_EQ(ids_and_offsets(tokenizer, "x \x04<|"),
            std::make_pair(Ids{120, 32, 60, 124}, Offsets{{0, 1}, {1, 2}, {2, 3}, {2, 3}}));
  EXPECT_EQ(ids_and_offsets(tokenizer, "hell\x04o"),
            std::make_pair(Ids{257, 259, 111}, Offsets{{0, 2}, {2, 4}, {5, 6}}));
  EXPECT_EQ(tokenizer.encode("\x04\x04"), Ids{});
}

TEST(Tokenizer, OffsetsAreByteRangesOfTheInput) {
  const Tokenizer tokenizer = tiny("", R"({"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<|eot|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [], "special_tokens": {"<|eot|>": {"id": "<|eot|>", "ids": [300], "tokens": ["<|eot|>"]}}})");
  // "é" is two bytes; its two byte tokens both cover the whole character.
  EXPECT_EQ(ids_and_offsets(tokenizer, " the<|eot|>\xC3\xA9"),
            std::make_pair(Ids{300, 258, 300, 0xC3, 0xA9}, Offsets{{0, 0}, {0, 4}, {4, 11}, {11, 13}, {11, 13}}));
}

// A SentencePiece-style BPE: characters "▁", "a", "b", "▁a", "ab", the <0xNN> tokens for
// the bytes of "é" only, Llama-2's legacy normalizer and decoder.
std::string sentencepiece_json(const std::string& model_options, const std::string& normalizer,
                               const std::string& pre_tokenizer, const std::string& decoder) {
  return R"({"added_tokens": [{"id": 0, "content": "<unk>", "special": true, "normalized": false},
                              {"id": 1, "content": "<s>", "special": true, "normalized": false}],
    "normalizer": )" + normalizer + R"(, "pre_tokenizer": )" + pre_tokenizer + R"(, "post_processor": null,
    "decoder": )" + decoder + R"(,
    "model": {"type": "BPE", "unk_token": "<unk>", )" + model_options + R"(,
              "vocab": {"<unk>": 0, "<s>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁": 4, "a": 5, "b": 6, "▁a": 7, "ab": 8,
                        "▁ab": 9},
              "merges": ["▁ a", "a b", "▁a b"]}})";
}

const char* const kLegacyNormalizer = R"({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})";
const char* const kLegacyDecoder = R"({"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})";

TEST(SentencePieceTokenizer, ByteFallbackAndUnknownCharacters) {
  const Tokenizer fallback(json::parse(
      sentencepiece_json(R"("byte_fallback": true, "fuse_unk": true)", kLegacyNormalizer, "null", kLegacyDecoder)));
  // "ab é" -> "▁ab▁é": "é" is not in the vocabulary but both its bytes are; "ü" is unknown.
  EXPECT_EQ(fallback.encode("ab \xC3\xA9"), (Ids{9, 4, 2, 3}));
  EXPECT_EQ(fallback.encode("a\xC3\xBC\xC3\xBC" "b"), (Ids{7, 0, 6}));
  EXPECT_EQ(fallback.decode(fallback.encode("ab \xC3\xA9 a")), "ab \xC3\xA9 a");
  EXPECT_EQ(fallback.decode(Ids{2, 5}), "\xEF\xBF\xBD" "a");  // a lone byte is U+FFFD
  const Tokenizer unfused(json::parse(
      sentencepiece_json(R"("byte_fallback": false, "fuse_unk": false)", kLegacyNormalizer, "null", kLegacyDecoder)));
  EXPECT_EQ(unfused.encode("a\xC3\xBC\xC3\xBC" "b"), (Ids{7, 0, 0, 6}));
  EXPECT_EQ(unfused.encode("\xC3\xA9"), (Ids{4, 0}));
}

TEST(SentencePieceTokenizer, MetaspacePrependSchemes) {
  auto with = [](const std::string& scheme, bool split) {
    const std::string metaspace = R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": ")" + scheme +
                                  R"(", "split": )" + (split ? "true" : "false") + "}";
    return Tokenizer(json::parse(sentencepiece_json(R"("byte_fallback": true)", "null", metaspace, metaspace)));
  };
  // "first" prepends only at the start of the input, not after an added token.
  EXPECT_EQ(with("first", false).encode("ab<s>ab"), (Ids{9, 1, 8}));
  EXPECT_EQ(with("always", false).encode("ab<s>ab"), (Ids{9, 1, 9}));
  EXPECT_EQ(with("never", false).encode("ab<s>ab"), (Ids{8, 1, 8}));
  // split cuts before each "▁": "▁a" "▁" "▁b" instead of one piece.
  EXPECT_EQ(with("always", true).encode("a  b"), (Ids{7, 4, 4, 6}));
  // The Metaspace decoder drops the first token's "▁".
  EXPECT_EQ(with("always", true).decode(Ids{7, 4, 4, 6}), "a  b");
}

TEST(SentencePieceTokenizer, OffsetsFollowTheNormalizer) {
  const Tokenizer tokenizer(json::parse(
      sentencepiece_json(R"("byte_fallback": true)", kLegacyNormalizer, "null", kLegacyDecoder)));
  // "▁ab▁▁a": the prepended "▁" belongs to the first character, a replaced space to itself.
  const auto encoding = tokenizer.encode_with_offsets("ab  a");
  EXPECT_EQ(encoding.ids, (Ids{9, 4, 7}));
  std::vector<std::pair<uint32_t, uint32_t>> offsets;
  for (const Span& span : encoding.offsets) offsets.emplace_back(span.start, span.end);
  EXPECT_EQ(offsets, (std::vector<std::pair<uint32_t, uint32_t>>{{0, 2}, {2, 3}, {3, 5}}));
}

TEST(SentencePieceTokenizer, SplitsWordsOnlyWhereNoMergeCrosses) {
  // "b▁" is a token, so no cut may follow a "b"; after "a" one may.
  const BpeModel model(json::parse(R"({"type": "BPE", "byte_fallback": false,
      "vocab": {"▁": 0, "a": 1, "b": 2, "b▁": 3}, "merges": ["b ▁"]})"),
                       /*byte_level=*/false);
  std::vector<std::string_view> parts;
  model.split_words("▁a▁b▁a▁", parts);
  EXPECT_EQ(parts, (std::vector<std::string_view>{"▁a", "▁b▁a", "▁"}));
}

// BPE by its definition: merge the adjacent pair of lowest rank, the leftmost on ties,
// until none merges. The test's merges never make one token in two ways, so Hugging Face's
// heap gives exactly this.
std::vector<std::string> reference_bpe(const std::string& piece,
                                       const std::vector<std::pair<std::string, std::string>>& merges) {
  std::vector<std::string> parts;
  for (const char c : piece) parts.emplace_back(1, c);
  for (;;) {
    size_t best_rank = merges.size(), best_at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      for (size_t rank = 0; rank < best_rank; ++rank) {
        if (merges[rank].first == parts[i] && merges[rank].second == parts[i + 1]) {
          best_rank = rank;
          best_at = i;
          break;
        }
      }
    }
    if (best_rank == merges.size()) return parts;
    parts[best_at] += parts[best_at + 1];
    parts.erase(parts.begin() + best_at + 1);
  }
}

TEST(BpeModel, ShortAndLongPiecesMergeAsBpeDefines) {
  // Pieces of up to 64 symbols take the simple merge, longer ones the heap: both must be BPE.
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"a", "b"}, {"c", "c"}, {"b", "c"}, {"ab", "ab"}, {"bc", "a"}, {"abab", "cc"}, {"a", "a"}, {"aa", "bca"}};
  std::string vocab = R"("a": 0, "b": 1, "c": 2)", merge_list;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    vocab += ", \"" + left + right + "\": " + std::to_string(3 + rank);
    merge_list += std::string(rank ? ", " : "") + "\"" + left + " " + right + "\"";
  }
  const BpeModel bpe(json::parse(R"({"type": "BPE", "vocab": {)" + vocab + "}, \"merges\": [" + merge_list + "]}"),
                     /*byte_level=*/false);
  std::mt19937 random(7);
  for (const size_t length : {1, 2, 17, 64, 65, 66, 200, 1000}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::string piece;
      for (size_t i = 0; i < length; ++i) piece += "abc"[random() % 3];
      std::vector<TokenId> ids;
      bpe.encode_piece(piece, ids);
      std::vector<std::string> tokens;
      for (const TokenId id : ids) tokens.push_back(bpe.token_bytes(id));
      ASSERT_EQ(tokens, reference_bpe(piece, merges)) << piece;
    }
  }
}

TEST(BpeModel, WithoutMergesEachCharacterIsItsToken) {
  const BpeModel model(json::parse(R"({"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []})"),
                       /*byte_level=*/false);
  std::vector<TokenId> ids;
  model.encode_piece("abba", ids);
  EXPECT_EQ(ids, (std::vector<TokenId>{0, 1, 1, 0}));
}

TEST(Tokenizer, CachedPiecesOfAnyLengthGiveTheirTokens) {
  // encode() keeps pieces of up to 255 bytes in the thread's cache; encode_with_offsets()
  // bypasses it. A word repeated reads the cache (from the second time on) on both sides of
  // that limit, and must give what merging it gives.
  const Tokenizer tokenizer = tiny();
  std::mt19937 random(11);
  for (const size_t length : {63, 64, 65, 200, 254, 255, 256, 400}) {
    std::string word;
    while (word.size() < length) word += random() % 2 ? "the" : "ll";
    word.resize(length);
    const std::string text = word + " " + word + " " + word;
    const Ids cached = tokenizer.encode(text);
    EXPECT_EQ(cached, tokenizer.encode_with_offsets(text).ids) << length;
    EXPECT_EQ(tokenizer.encode(text), cached) << length;
  }
}

TEST(Tokenizer, MissingFileIsNamed) {
  try {
    Tokenizer::from_file("/nonexistent/tokenizer.json");
    FAIL() << "expected a TokenizerError";
  } catch (const TokenizerError& error) {
    EXPECT_STREQ(error.what(), "cannot open /nonexistent/tokenizer.json");
  }
}

}  // namespace
}  // namespace barqtrain::tokenizer
