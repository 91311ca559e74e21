#include "data/tokenizer/bpe.h"

#include <algorithm>

#include "data/tokenizer/error.h"
#include "data/tokenizer/unicode.h"
#include "data/utf8.h"

namespace barqtrain::tokenizer {
namespace {

constexpr uint32_t kNoMerge = UINT32_MAX;
// Token ids index dense tables; real vocabularies stay far below this.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

// GPT-2's bytes_to_unicode(): printable bytes stand for themselves, the others are
// shifted past U+00FF in byte order.
const std::vector<char32_t>& byte_alphabet() {
  static const std::vector<char32_t> alphabet = [] {
    std::vector<char32_t> chars(256);
    char32_t next_unprintable = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      chars[b] = printable ? static_cast<char32_t>(b) : next_unprintable++;
    }
    return chars;
  }();
  return alphabet;
}

// The bytes a byte-level token string stands for; false when it has a character outside
// the alphabet (such a token can only come from the added vocabulary).
bool byte_level_to_bytes(std::string_view token, std::string& bytes) {
  static const std::unordered_map<char32_t, uint8_t> byte_of = [] {
    std::unordered_map<char32_t, uint8_t> map;
    for (int b = 0; b < 256; ++b) map[byte_alphabet()[b]] = static_cast<uint8_t>(b);
    return map;
  }();
  bytes.clear();
  for (size_t pos = 0; pos < token.size();) {
    const auto [cp, length] = unicode::decode_at(token, pos);
    const auto it = byte_of.find(cp);
    if (it == byte_of.end()) return false;
    bytes += static_cast<char>(it->second);
    pos += length;
  }
  return true;
}

std::string byte_level_string(uint8_t byte) {
  std::string out;
  utf8::append(out, byte_alphabet()[byte]);
  return out;
}

void require_empty_or_null(const json::Value& model, const char* field) {
  const json::Value* value = model.find(field);
  if (value && !value->is_null() && !(value->is_string() && value->as_string().empty())) {
    throw TokenizerError(std::string("unsupported BPE option ") + field + " (only empty or null is supported)");
  }
}

}  // namespace

std::string byte_level_decode(std::string_view token) {
  std::string bytes;
  return byte_level_to_bytes(token, bytes) ? bytes : std::string(token);
}

void BpeModel::MergeTable::reserve(size_t count) {
  size_t capacity = 16;
  shift_ = 60;
  while (capacity < count * 2) {
    capacity *= 2;
    --shift_;
  }
  keys_.assign(capacity, kEmpty);
  merges_.assign(capacity, Merge{});
}

void BpeModel::MergeTable::insert(TokenId left, TokenId right, Merge merge) {
  const uint64_t k = key(left, right);
  const size_t mask = keys_.size() - 1;
  for (size_t i = slot(k);; i = (i + 1) & mask) {
    if (keys_[i] == kEmpty || keys_[i] == k) {
      // A repeated merge takes its last rank, as in Hugging Face's loader.
      keys_[i] = k;
      merges_[i] = merge;
      return;
    }
  }
}

const BpeModel::Merge* BpeModel::MergeTable::find(TokenId left, TokenId right) const {
  const uint64_t k = key(left, right);
  const size_t mask = keys_.size() - 1;
  for (size_t i = slot(k);; i = (i + 1) & mask) {
    if (keys_[i] == k) return &merges_[i];
    if (keys_[i] == kEmpty) return nullptr;
  }
}

BpeModel::BpeModel(const json::Value& model) {
  const json::Value* type = model.find("type");
  if (!type || !type->is_string() || type->as_string() != "BPE") {
    throw TokenizerError("unsupported model type " + (type && type->is_string() ? type->as_string() : std::string("(missing)")) +
                         " (only BPE is supported)");
  }
  if (const json::Value* fallback = model.find("byte_fallback"); fallback && fallback->as_bool()) {
    throw TokenizerError("unsupported BPE option byte_fallback (SentencePiece-style BPE is not supported yet)");
  }
  if (const json::Value* dropout = model.find("dropout"); dropout && !dropout->is_null()) {
    throw TokenizerError("unsupported BPE option dropout");
  }
  require_empty_or_null(model, "continuing_subword_prefix");
  require_empty_or_null(model, "end_of_word_suffix");
  if (const json::Value* ignore = model.find("ignore_merges")) ignore_merges_ = ignore->as_bool();

  const json::Value* vocab = model.find("vocab");
  if (!vocab || !vocab->is_object()) throw TokenizerError("model.vocab is missing or not an object");
  const auto& entries = vocab->as_object();
  ids_by_bytes_.reserve(entries.size());
  std::string bytes;
  for (const auto& [token, id_value] : entries) {
    const int64_t id = id_value.as_integer();
    if (id < 0 || id >= kMaxTokenId) {
      throw TokenizerError("model.vocab: token id " + std::to_string(id) + " of \"" + token +
                           "\" is out of range [0, " + std::to_string(kMaxTokenId) + ")");
    }
    if (static_cast<size_t>(id) >= token_bytes_.size()) {
      token_bytes_.resize(id + 1);
      has_token_.resize(id + 1);
    }
    has_token_[id] = true;
    // A token outside the byte alphabet is never produced by merging bytes.
    if (byte_level_to_bytes(token, bytes)) {
      ids_by_bytes_.emplace(bytes, static_cast<TokenId>(id));
      token_bytes_[id] = bytes;
    } else {
      token_bytes_[id] = token;
    }
  }
  for (int b = 0; b < 256; ++b) {
    byte_tokens_[b] = find(std::string_view(reinterpret_cast<const char*>(&b), 1));
    if (byte_tokens_[b] == kNoToken) {
      throw TokenizerError("model.vocab has no token for byte " + std::to_string(b) + " (\"" +
                           byte_level_string(static_cast<uint8_t>(b)) + "\"): not a byte-level BPE vocabulary");
    }
  }

  const json::Value* merges = model.find("merges");
  if (!merges || !merges->is_array()) throw TokenizerError("model.merges is missing or not an array");
  merges_.reserve(merges->as_array().size());
  uint32_t rank = 0;
  std::string left_bytes, right_bytes;
  for (const json::Value& merge : merges->as_array()) {
    // Two spellings: "left right" (older files) or ["left", "right"].
    std::string left, right;
    if (merge.is_string()) {
      const std::string& text = merge.as_string();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
        throw TokenizerError("model.merges[" + std::to_string(rank) + "] \"" + text + "\" is not two tokens");
      }
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else {
      const auto& pair = merge.as_array();
      if (pair.size() != 2) throw TokenizerError("model.merges[" + std::to_string(rank) + "] is not a pair");
      left = pair[0].as_string();
      right = pair[1].as_string();
    }
    TokenId left_id = kNoToken, right_id = kNoToken, merged_id = kNoToken;
    if (byte_level_to_bytes(left, left_bytes) && byte_level_to_bytes(right, right_bytes)) {
      left_id = find(left_bytes);
      right_id = find(right_bytes);
      merged_id = find(left_bytes + right_bytes);
    }
    if (left_id == kNoToken || right_id == kNoToken || merged_id == kNoToken) {
      throw TokenizerError("model.merges[" + std::to_string(rank) + "] (\"" + left + "\", \"" + right +
                           "\") uses a token missing from model.vocab");
    }
    merges_.insert(left_id, right_id, Merge{rank, merged_id});
    ++rank;
  }
}

TokenId BpeModel::find(std::string_view bytes) const {
  // C++17 unordered_map has no heterogeneous lookup; this runs only at load time and
  // once per pre-token that misses the encoder's cache.
  const auto it = ids_by_bytes_.find(std::string(bytes));
  return it == ids_by_bytes_.end() ? kNoToken : it->second;
}

uint32_t BpeModel::rank_of(TokenId left, TokenId right) const {
  const Merge* merge = merges_.find(left, right);
  return merge ? merge->rank : kNoMerge;
}

void BpeModel::encode_piece(std::string_view piece, std::vector<TokenId>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_ && piece.size() > 1) {
    if (const TokenId whole = find(piece); whole != kNoToken) {
      out.push_back(whole);
      return;
    }
  }
  // Merge the adjacent pair of lowest rank (the leftmost on ties) until none merges. The
  // ranks of adjacent pairs are kept beside the parts, so each merge recomputes two.
  thread_local std::vector<TokenId> parts;
  thread_local std::vector<uint32_t> ranks;
  parts.clear();
  ranks.clear();
  for (const char c : piece) parts.push_back(byte_tokens_[static_cast<uint8_t>(c)]);
  for (size_t i = 0; i + 1 < parts.size(); ++i) ranks.push_back(rank_of(parts[i], parts[i + 1]));
  while (!ranks.empty()) {
    const auto lowest = std::min_element(ranks.begin(), ranks.end());
    if (*lowest == kNoMerge) break;
    const size_t i = lowest - ranks.begin();
    parts[i] = merges_.find(parts[i], parts[i + 1])->merged;
    parts.erase(parts.begin() + i + 1);
    ranks.erase(ranks.begin() + i);
    if (i > 0) ranks[i - 1] = rank_of(parts[i - 1], parts[i]);
    if (i < ranks.size()) ranks[i] = rank_of(parts[i], parts[i + 1]);
  }
  out.insert(out.end(), parts.begin(), parts.end());
}

}  // namespace barqtrain::tokenizer
