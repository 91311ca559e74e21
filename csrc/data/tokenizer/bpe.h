// Byte-level BPE: the model half of a GPT-2 style tokenizer.
//
// Tokens are handled as raw bytes: the vocabulary's byte-level strings ("Ġthe") are mapped
// back to the bytes they stand for (" the") once at load time, so encoding never builds
// the byte-level string of the input.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/json.h"

namespace barqtrain::tokenizer {

using TokenId = uint32_t;

// The bytes a byte-level token string stands for (GPT-2's alphabet: "Ġ" is a space), or the
// token's own UTF-8 when it has a character outside that alphabet, as Hugging Face's
// ByteLevel decoder does.
std::string byte_level_decode(std::string_view token);

class BpeModel {
 public:
  // Reads a tokenizer.json "model" object; throws TokenizerError on anything unsupported.
  explicit BpeModel(const json::Value& model);

  // Appends the tokens of one pre-token (raw bytes).
  void encode_piece(std::string_view piece, std::vector<TokenId>& out) const;

  // One more than the largest token id.
  size_t id_bound() const { return token_bytes_.size(); }
  bool has_token(TokenId id) const { return id < has_token_.size() && has_token_[id]; }
  // The bytes token `id` decodes to; requires has_token(id).
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
  class MergeTable {
   public:
    void reserve(size_t count);
    void insert(TokenId left, TokenId right, Merge merge);
    const Merge* find(TokenId left, TokenId right) const;

   private:
    static uint64_t key(TokenId left, TokenId right) { return (uint64_t{left} << 32) | right; }
    size_t slot(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> shift_; }
    static constexpr uint64_t kEmpty = ~uint64_t{0};
    std::vector<uint64_t> keys_;
    std::vector<Merge> merges_;
    int shift_ = 64;
  };

  uint32_t rank_of(TokenId left, TokenId right) const;

  std::unordered_map<std::string, TokenId> ids_by_bytes_;
  std::vector<std::string> token_bytes_;
  std::vector<bool> has_token_;
  TokenId byte_tokens_[256];
  MergeTable merges_;
  // Llama-3: a pre-token that is itself in the vocabulary is one token, without merging.
  bool ignore_merges_ = false;
};

}  // namespace barqtrain::tokenizer
