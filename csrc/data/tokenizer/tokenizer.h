// A Hugging Face tokenizer.json tokenizer for BPE models, byte-level (GPT-2, Llama-3,
// Qwen2/2.5, SmolLM, Mistral's Tekken, DeepSeek-V3: any Split regex) or SentencePiece-style
// (Llama-2, Mistral, Gemma, Phi-3), whose output is identical to Hugging Face tokenizers'.
// docs/tokenizer.md lists what it reads.
//
//   auto tokenizer = barqtrain::tokenizer::Tokenizer::from_file("tokenizer.json");
//   std::vector<TokenId> ids = tokenizer.encode("Hello world");
//   std::string text = tokenizer.decode(ids);
//
// A Tokenizer is immutable after loading and safe to use from many threads at once.
// Anything in the file it does not implement is a TokenizerError naming the feature.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/json.h"
#include "data/tokenizer/bpe.h"
#include "data/tokenizer/decoder.h"
#include "data/tokenizer/error.h"
#include "data/tokenizer/normalizer.h"
#include "data/tokenizer/pre_tokenizer.h"

namespace barqtrain::tokenizer {

struct EncodeOptions {
  // Add the post-processor's special tokens (such as BOS) around the text.
  bool add_special_tokens = true;
  // Treat special tokens written in the text as plain text instead of matching them
  // (Hugging Face's encode_special_tokens); other added tokens are still matched.
  bool split_special_tokens = false;
};

class Tokenizer {
 public:
  static Tokenizer from_file(const std::string& path);
  explicit Tokenizer(const json::Value& config);

  // text must be valid UTF-8; otherwise a TokenizerError names the offset of the first bad byte.
  std::vector<TokenId> encode(std::string_view text, const EncodeOptions& options = {}) const;

  // encode(text), appended to out.
  void encode_into(std::string_view text, const EncodeOptions& options, std::vector<TokenId>& out) const;

  // The ids of text and, for each, the byte range of text it came from, as Hugging Face
  // reports offsets: tokens the post-processor adds have (0, 0); a token that covers part
  // of a character, or a character that normalization changed, has the whole character.
  struct Encoding {
    std::vector<TokenId> ids;
    std::vector<Span> offsets;
  };
  Encoding encode_with_offsets(std::string_view text, const EncodeOptions& options = {}) const;

  // Encodes texts on num_threads threads (0: one per hardware thread) of a persistent pool.
  std::vector<std::vector<TokenId>> encode_batch(const std::vector<std::string_view>& texts,
                                                 const EncodeOptions& options = {},
                                                 size_t num_threads = 0) const;

  // The ids of all texts in one buffer: text i's are ids[offsets[i], offsets[i + 1]).
  struct FlatIds {
    std::vector<TokenId> ids;
    std::vector<int64_t> offsets;  // texts.size() + 1 entries
  };
  // encode_with_offsets() of each text, on num_threads threads as encode_batch.
  std::vector<Encoding> encode_batch_with_offsets(const std::vector<std::string_view>& texts,
                                                  const EncodeOptions& options = {}, size_t num_threads = 0) const;

  FlatIds encode_batch_flat(const std::vector<std::string_view>& texts, const EncodeOptions& options = {},
                            size_t num_threads = 0) const;

  // The text of ids; byte sequences that are not valid UTF-8 become U+FFFD. An id that is
  // neither in the vocabulary nor an added token is a TokenizerError.
  std::string decode(const std::vector<TokenId>& ids, bool skip_special_tokens = false) const;

  // One more than the largest token id, added tokens included.
  size_t id_bound() const;

 private:
  struct AddedToken {
    std::string content;  // as matched: normalized when the token is
    TokenId id;
    bool special;
    bool single_word;  // matches only where no word character touches it
    bool lstrip;       // takes the white space before it
    bool rstrip;       // takes the white space after it
  };

  // Finds added tokens in text, leftmost first and longest among those starting there.
  class AddedTokenMatcher {
   public:
    void add(const AddedToken& token);
    void finish();
    bool empty() const { return tokens_.empty(); }
    // The first match at or after `from`, or nullptr; its offset goes to *at.
    const AddedToken* find(std::string_view text, size_t from, size_t* at) const;

   private:
    std::vector<AddedToken> tokens_;
    std::array<bool, 256> starts_token_{};
    int single_start_ = -1;  // the first byte of every token when they share one, else -1
  };

  template <typename Emit>
  void split_added_tokens(const AddedTokenMatcher& matcher, std::string_view text, bool skip_special,
                          Emit&& emit) const;
  // Encodes text, appending ids and, when offsets is not null, the offsets of each token.
  void encode_all(std::string_view text, const EncodeOptions& options, std::vector<TokenId>& ids,
                  std::vector<Span>* offsets) const;
  // One run of normalized text between added tokens; spans (one per byte) when tracking
  // offsets; at_input_start when it begins the input (Metaspace's prepend_scheme first).
  void encode_part(std::string_view text, const Span* spans, bool at_input_start, std::vector<TokenId>& ids,
                   std::vector<Span>* offsets) const;
  void encode_pieces(const std::vector<std::string_view>& pre_tokens, std::string_view text, const Span* spans,
                     std::vector<TokenId>& ids, std::vector<Span>* offsets) const;
  // Hugging Face's ByteLevel post-processor with trim_offsets, on the span of one token
  // whose text is value: the spaces at its ends ("Ġ" in a model token; "Ġ" or any white
  // space in an added token's matched text) leave the span, except the one space that
  // add_prefix_space put in front of the first token.
  Span trimmed(Span span, std::string_view value, bool added, bool first_token) const;

  std::shared_ptr<const BpeModel> model_;
  AddedTokenMatcher raw_added_tokens_;         // matched before normalization
  AddedTokenMatcher normalized_added_tokens_;  // matched in normalized text
  std::vector<std::optional<std::string>> added_token_content_;  // by id, as matched (normalized ones normalized)
  std::vector<bool> special_ids_;
  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  // Decoder: ByteLevel when the model is byte-level, else this chain (or none: join).
  std::optional<DecoderChain> decoder_;
  std::vector<TokenId> prefix_, suffix_;  // from TemplateProcessing
  // ByteLevel post-processor: trim the spaces at the ends of tokens from their offsets.
  bool trim_offsets_ = false;
  bool trim_keeps_prefix_space_ = false;
  uint64_t serial_;  // identifies this tokenizer to per-thread caches
};

}  // namespace barqtrain::tokenizer
