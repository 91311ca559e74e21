// BPE: the model half of a tokenizer, in two flavours.
//
// Byte-level (GPT-2, Llama-3, Qwen2): tokens are handled as raw bytes: the vocabulary's
// byte-level strings ("Ġthe") are mapped back to the bytes they stand for (" the") once
// at load time, so encoding never builds the byte-level string of the input.
//
// SentencePiece-style (Llama-2, Mistral, Gemma): tokens are plain UTF-8 strings ("▁the");
// a pre-token starts as its characters, and a character missing from the vocabulary
// becomes its bytes' <0xNN> tokens (byte_fallback) or the unknown token (fused with
// neighbouring unknown characters when fuse_unk is set).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "data/json.h"

namespace barqtrain::tokenizer {

using TokenId = uint32_t;

// The bytes [start, end) of a piece that one token covers.
struct ByteRange {
  uint32_t start, end;
};

// The bytes a byte-level token string stands for (GPT-2's alphabet: "Ġ" is a space), or the
// token's own UTF-8 when it has a character outside that alphabet, as Hugging Face's
// ByteLevel decoder does.
std::string byte_level_decode(std::string_view token);

class BpeModel {
 public:
  // Reads a tokenizer.json "model" object; throws TokenizerError on anything unsupported.
  BpeModel(const json::Value& model, bool byte_level);

  // Appends the tokens of one pre-token (raw bytes, valid UTF-8 in the SentencePiece
  // flavour). With ranges, also appends the bytes of the piece each token covers, as Hugging
  // Face reports them: it lays the tokens end to end from the piece's start, so a character
  // without a token (no unknown token, no byte fallback) moves the tokens after it earlier.
  void encode_piece(std::string_view piece, std::vector<TokenId>& out, std::vector<ByteRange>* ranges = nullptr) const;

  bool byte_level() const { return byte_level_; }

  // SentencePiece-style text without a splitting pre-tokenizer reaches the model as one
  // piece per run of text. split_words cuts such a piece before each "▁" whose preceding
  // character never precedes "▁" inside a vocabulary token (and is itself a token): no
  // merge can cross such a cut, so encoding the parts one by one (and caching them) gives
  // exactly the tokens of the whole. Appends the parts to parts.
  void split_words(std::string_view piece, std::vector<std::string_view>& parts) const;
  bool can_split_words() const { return can_split_words_; }
  // One more than the largest token id.
  size_t id_bound() const { return token_bytes_.size(); }
  bool has_token(TokenId id) const { return id < has_token_.size() && has_token_[id]; }
  // The bytes token `id` decodes to (byte-level), or its string (SentencePiece-style);
  // requires has_token(id).
  const std::string& token_bytes(TokenId id) const { return token_bytes_[id]; }
  // The token whose bytes are exactly `bytes`, or kNoToken.
  TokenId find(std::string_view bytes) const;

  static constexpr TokenId kNoToken = UINT32_MAX;

 private:
  struct Merge {
    uint32_t rank;
    TokenId merged;
  };
  // Open-addressing table from a pair of token ids to their merge: the hot lookup of BPE.
  // A slot holds the pair and its merge together, so a lookup touches one cache line.
  class MergeTable {
   public:
    void reserve(size_t count);
    void insert(TokenId left, TokenId right, Merge merge);
    const Merge* find(TokenId left, TokenId right) const;

   private:
    static uint64_t key(TokenId left, TokenId right) { return (uint64_t{left} << 32) | right; }
    size_t slot(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> shift_; }
    static constexpr uint64_t kEmpty = ~uint64_t{0};
    struct Slot {
      uint64_t key;
      Merge merge;
    };
    std::vector<Slot> slots_;
    int shift_ = 64;
  };

  // Open-addressing index from a token's bytes to its id, over token_bytes_: a lookup hashes
  // the bytes once and compares them with one token's bytes, without building a string.
  class TokenIndex {
   public:
    void reserve(size_t count);
    // Indexes id under its bytes, tokens[id]; when another token has the same bytes, the
    // first one indexed keeps them.
    void insert(TokenId id, const std::vector<std::string>& tokens);
    TokenId find(std::string_view bytes, const std::vector<std::string>& tokens) const;

   private:
    struct Slot {
      uint32_t tag;  // the hash's upper half
      TokenId id;    // kNoToken: a free slot
    };
    std::vector<Slot> slots_;
    size_t mask_ = 0;
    size_t longest_ = 0;  // no token has more bytes: longer lookups fail at once
  };

  class RecentMerges;  // a thread's cache in front of merges_ (bpe.cpp)
  struct Scratch;       // a thread's buffers for encoding a piece (bpe.cpp)
  void read_vocab(const json::Value& model);
  void read_merges(const json::Value& model);
  // The initial symbols of a piece: its characters (its bytes, byte-level), byte
  // fallbacks and unknowns. With lengths, each symbol's length in bytes (for a byte-level
  // piece, of its character in the byte-level string).
  void split_characters(std::string_view piece, std::vector<TokenId>& parts, std::vector<uint32_t>* lengths) const;
  void merge(std::vector<TokenId>& parts, std::vector<uint32_t>* lengths, Scratch& scratch) const;
  // The ranges of tokens of those lengths (split_characters' units), laid end to end.
  void lay_out(std::string_view piece, const std::vector<uint32_t>& lengths, std::vector<ByteRange>& ranges) const;
  void merge_long(std::vector<TokenId>& parts, std::vector<uint32_t>* lengths, Scratch& scratch) const;

  bool byte_level_;
  uint64_t serial_;  // identifies this model to the threads' RecentMerges
  std::vector<std::string> token_bytes_;
  TokenIndex ids_by_bytes_;
  std::vector<bool> has_token_;
  TokenId byte_tokens_[256];  // byte-level: the token of each byte, or kNoToken
  bool every_byte_has_token_ = true;
  MergeTable merges_;
  // SentencePiece-style: the token of each one-character string (kNoToken for none),
  // by code point: a flat table for the Basic Multilingual Plane, where nearly all text
  // is, and a map for the rest; the <0xNN> tokens; the unknown token.
  TokenId character_token(char32_t code_point) const {
    if (code_point < kBmpSize) return bmp_character_tokens_[code_point];
    const auto it = supplementary_character_tokens_.find(code_point);
    return it == supplementary_character_tokens_.end() ? kNoToken : it->second;
  }
  static constexpr char32_t kBmpSize = 0x10000;
  std::vector<TokenId> bmp_character_tokens_;
  std::unordered_map<char32_t, TokenId> supplementary_character_tokens_;
  bool byte_fallback_ = false;
  TokenId byte_fallback_tokens_[256];
  TokenId unknown_token_ = kNoToken;
  bool fuse_unknown_ = false;
  bool can_split_words_ = false;
  std::unordered_set<char32_t> joins_word_boundary_;  // characters seen before "▁" in a token
  // Llama-3: a pre-token that is itself in the vocabulary is one token, without merging.
  bool ignore_merges_ = false;
};

}  // namespace barqtrain::tokenizer
