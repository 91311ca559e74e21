#include "data/tokenizer/bpe.h"

#include <algorithm>
#include <atomic>
#include <functional>

#include "data/tokenizer/error.h"
#include "data/tokenizer/hash.h"
#include "data/tokenizer/unicode.h"
#include "data/utf8.h"

namespace barqtrain::tokenizer {
namespace {

constexpr uint32_t kNoMerge = UINT32_MAX;
std::atomic<uint64_t> next_serial{1};
constexpr std::string_view kWordBoundary = "\xE2\x96\x81";  // "▁", U+2581
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

// The UTF-8 length of a byte's character in the byte-level string: printable ASCII stands
// for itself, every other byte for a character from U+00A1 on.
uint32_t byte_level_width(char byte) { return byte >= '!' && byte <= '~' ? 1 : 2; }

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
  slots_.assign(capacity, Slot{kEmpty, Merge{}});
}

void BpeModel::MergeTable::insert(TokenId left, TokenId right, Merge merge) {
  const uint64_t k = key(left, right);
  const size_t mask = slots_.size() - 1;
  for (size_t i = slot(k);; i = (i + 1) & mask) {
    if (slots_[i].key == kEmpty || slots_[i].key == k) {
      // A repeated merge takes its last rank, as in Hugging Face's loader.
      slots_[i] = Slot{k, merge};
      return;
    }
  }
}

const BpeModel::Merge* BpeModel::MergeTable::find(TokenId left, TokenId right) const {
  const uint64_t k = key(left, right);
  const size_t mask = slots_.size() - 1;
  for (size_t i = slot(k);; i = (i + 1) & mask) {
    if (slots_[i].key == k) return &slots_[i].merge;
    if (slots_[i].key == kEmpty) return nullptr;
  }
}

void BpeModel::TokenIndex::reserve(size_t count) {
  size_t capacity = 16;
  while (capacity < count * 2) capacity *= 2;
  slots_.assign(capacity, Slot{0, kNoToken});
  mask_ = capacity - 1;
}

void BpeModel::TokenIndex::insert(TokenId id, const std::vector<std::string>& tokens) {
  const std::string& bytes = tokens[id];
  const uint64_t h = hash_bytes(bytes);
  const auto tag = static_cast<uint32_t>(h >> 32);
  size_t i = h & mask_;
  for (; slots_[i].id != kNoToken; i = (i + 1) & mask_) {
    if (slots_[i].tag == tag && tokens[slots_[i].id] == bytes) return;
  }
  slots_[i] = Slot{tag, id};
  longest_ = std::max(longest_, bytes.size());
}

TokenId BpeModel::TokenIndex::find(std::string_view bytes, const std::vector<std::string>& tokens) const {
  if (bytes.size() > longest_) return kNoToken;
  const uint64_t h = hash_bytes(bytes);
  const auto tag = static_cast<uint32_t>(h >> 32);
  for (size_t i = h & mask_; slots_[i].id != kNoToken; i = (i + 1) & mask_) {
    if (slots_[i].tag == tag && tokens[slots_[i].id] == bytes) return slots_[i].id;
  }
  return kNoToken;
}

BpeModel::BpeModel(const json::Value& model, bool byte_level) : byte_level_(byte_level), serial_(next_serial++) {
  const json::Value* type = model.find("type");
  if (!type || !type->is_string() || type->as_string() != "BPE") {
    throw TokenizerError("unsupported model type " + (type && type->is_string() ? type->as_string() : std::string("(missing)")) +
                         " (only BPE is supported)");
  }
  if (const json::Value* dropout = model.find("dropout"); dropout && !dropout->is_null()) {
    throw TokenizerError("unsupported BPE option dropout");
  }
  require_empty_or_null(model, "continuing_subword_prefix");
  require_empty_or_null(model, "end_of_word_suffix");
  if (const json::Value* ignore = model.find("ignore_merges")) ignore_merges_ = ignore->as_bool();
  if (const json::Value* fallback = model.find("byte_fallback"); fallback && !fallback->is_null()) {
    byte_fallback_ = fallback->as_bool();
  }
  if (const json::Value* fuse = model.find("fuse_unk"); fuse && !fuse->is_null()) fuse_unknown_ = fuse->as_bool();
  read_vocab(model);
  if (const json::Value* unknown = model.find("unk_token"); unknown && !unknown->is_null()) {
    unknown_token_ = find(unknown->as_string());
    if (unknown_token_ == kNoToken) {
      throw TokenizerError("model.unk_token \"" + unknown->as_string() + "\" is not in model.vocab");
    }
  }
  read_merges(model);
}

void BpeModel::read_vocab(const json::Value& model) {
  const json::Value* vocab = model.find("vocab");
  if (!vocab || !vocab->is_object()) throw TokenizerError("model.vocab is missing or not an object");
  const auto& entries = vocab->as_object();
  ids_by_bytes_.reserve(entries.size());
  std::string bytes;
  // Tokens are indexed in the file's order (the first of two with the same bytes keeps them).
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
    if (has_token_[id]) {
      throw TokenizerError("model.vocab: token id " + std::to_string(id) + " is given to two tokens (\"" + token +
                           "\" is the second); each id must name one token");
    }
    has_token_[id] = true;
    if (!byte_level_) {
      token_bytes_[id] = token;
      ids_by_bytes_.insert(static_cast<TokenId>(id), token_bytes_);
    } else if (byte_level_to_bytes(token, bytes)) {
      token_bytes_[id] = bytes;
      ids_by_bytes_.insert(static_cast<TokenId>(id), token_bytes_);
    } else {
      // A token outside the byte alphabet is never produced by merging bytes.
      token_bytes_[id] = token;
    }
  }
  if (byte_level_) {
    // Some vocabularies lack bytes that UTF-8 text rarely or never holds (control
    // characters, 0xC0, 0xF5-0xFF): those become the unknown token or no token.
    for (int b = 0; b < 256; ++b) {
      byte_tokens_[b] = find(std::string_view(reinterpret_cast<const char*>(&b), 1));
      if (byte_tokens_[b] == kNoToken) every_byte_has_token_ = false;
    }
    return;
  }
  // The tokens the index holds: each string once, with the id it maps to.
  std::vector<TokenId> indexed;
  for (TokenId id = 0; id < token_bytes_.size(); ++id) {
    if (has_token_[id] && find(token_bytes_[id]) == id) indexed.push_back(id);
  }
  bmp_character_tokens_.assign(kBmpSize, kNoToken);
  for (const TokenId id : indexed) {
    const std::string& token = token_bytes_[id];
    if (!token.empty() && token.size() <= 4 && unicode::find_invalid_utf8(token) == token.size() &&
        unicode::decode_at(token, 0).length == token.size()) {
      const char32_t code_point = unicode::decode_at(token, 0).code_point;
      if (code_point < kBmpSize) {
        bmp_character_tokens_[code_point] = id;
      } else {
        supplementary_character_tokens_.emplace(code_point, id);
      }
    }
  }
  // The characters that precede "▁" inside some token: split_words must not cut after them.
  can_split_words_ = !ignore_merges_ && find(kWordBoundary) != kNoToken;
  for (const TokenId id : indexed) {
    const std::string& token = token_bytes_[id];
    for (size_t at = token.find(kWordBoundary, 1); at != std::string::npos; at = token.find(kWordBoundary, at + 1)) {
      size_t previous = at - 1;
      while (previous > 0 && (static_cast<unsigned char>(token[previous]) & 0xC0) == 0x80) --previous;
      joins_word_boundary_.insert(unicode::decode_at(token, previous).code_point);
    }
  }
  static const char* const kHex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    // Hugging Face spells them "<0x%02X>": "<0x0A>", "<0xE2>".
    const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
    byte_fallback_tokens_[b] = find(name);
  }
}

void BpeModel::read_merges(const json::Value& model) {
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
    if (!byte_level_) {
      left_id = find(left);
      right_id = find(right);
      merged_id = find(left + right);
    } else if (byte_level_to_bytes(left, left_bytes) && byte_level_to_bytes(right, right_bytes)) {
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

TokenId BpeModel::find(std::string_view bytes) const { return ids_by_bytes_.find(bytes, token_bytes_); }

// A thread's direct-mapped cache of the merge table's answers, a missing merge included.
// The table of a large vocabulary is many megabytes, so a lookup there is a cache miss;
// text reuses few pairs (its script's character bytes, its frequent syllables), and those
// answers stay here, in 256 KiB.
class BpeModel::RecentMerges {
 public:
  // Forgets the answers about another model.
  void bind(uint64_t model_serial) {
    if (model_serial_ == model_serial) return;
    model_serial_ = model_serial;
    slots_.assign(kSlots, Slot{kEmpty, Merge{}});
  }

  // The merge of (left, right), or one of rank kNoMerge.
  Merge find(const MergeTable& table, TokenId left, TokenId right) {
    const uint64_t key = (uint64_t{left} << 32) | right;
    Slot& slot = slots_[(key * 0x9E3779B97F4A7C15ull) >> (64 - kSlotBits)];
    if (slot.key != key) {
      const Merge* merge = table.find(left, right);
      slot = Slot{key, merge ? *merge : Merge{kNoMerge, kNoToken}};
    }
    return slot.merge;
  }

 private:
  static constexpr int kSlotBits = 14;
  static constexpr size_t kSlots = size_t{1} << kSlotBits;
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // no pair: token ids are below 2^24
  struct Slot {
    uint64_t key;
    Merge merge;
  };
  uint64_t model_serial_ = 0;
  std::vector<Slot> slots_;
};

// merge_long's symbols: a linked list, the merge of the pair starting at each symbol
// (kNoToken for none) and the heap of candidate merges.
struct LongMergeState {
  struct Candidate {
    uint64_t order;  // rank << 32 | position: the lowest rank first, the leftmost on ties
    TokenId merged;
    bool operator>(const Candidate& other) const { return order > other.order; }
  };
  std::vector<uint32_t> previous, next;
  std::vector<TokenId> pair_merges;
  std::vector<Candidate> heap;
};

// Reached once per piece and passed down: in a shared library every thread_local access
// is a call, which the compiler repeats inside loops.
struct BpeModel::Scratch {
  std::vector<TokenId> parts;
  std::vector<uint32_t> lengths;
  std::vector<uint32_t> ranks;  // merge's ranks of adjacent pairs
  LongMergeState long_merge;
  RecentMerges recent;
};

void BpeModel::encode_piece(std::string_view piece, std::vector<TokenId>& out, std::vector<ByteRange>* ranges) const {
  if (piece.empty()) return;
  if (ignore_merges_ && piece.size() > 1) {
    if (const TokenId whole = find(piece); whole != kNoToken) {
      out.push_back(whole);
      if (ranges) ranges->push_back({0, static_cast<uint32_t>(piece.size())});
      return;
    }
  }
  thread_local Scratch thread_scratch;
  Scratch& scratch = thread_scratch;
  scratch.recent.bind(serial_);
  std::vector<TokenId>& parts = scratch.parts;
  std::vector<uint32_t>& lengths = scratch.lengths;
  parts.clear();
  lengths.clear();
  std::vector<uint32_t>* tracked = ranges ? &lengths : nullptr;
  if (byte_level_ && every_byte_has_token_) {
    for (const char c : piece) parts.push_back(byte_tokens_[static_cast<uint8_t>(c)]);
    if (tracked) tracked->assign(parts.size(), 1);
  } else {
    split_characters(piece, parts, tracked);
  }
  merge(parts, tracked, scratch);
  out.insert(out.end(), parts.begin(), parts.end());
  if (ranges) lay_out(piece, lengths, *ranges);
}

void BpeModel::lay_out(std::string_view piece, const std::vector<uint32_t>& lengths,
                       std::vector<ByteRange>& ranges) const {
  if (!byte_level_ || every_byte_has_token_) {
    // The lengths are in the piece's bytes.
    uint32_t at = 0;
    for (const uint32_t length : lengths) {
      ranges.push_back({at, at + length});
      at += length;
    }
    return;
  }
  // The lengths are in the byte-level string, where a byte is one character of one or two
  // UTF-8 bytes: a token covers the bytes whose characters its span touches.
  size_t byte = 0;
  uint32_t byte_start = 0;  // where byte's character starts in the byte-level string
  auto byte_at = [&](uint32_t position) {
    while (byte + 1 < piece.size() && byte_start + byte_level_width(piece[byte]) <= position) {
      byte_start += byte_level_width(piece[byte]);
      ++byte;
    }
    return static_cast<uint32_t>(byte);
  };
  uint32_t at = 0;
  for (const uint32_t length : lengths) {
    const uint32_t start = byte_at(at);
    ranges.push_back({start, byte_at(at + length - 1) + 1});
    at += length;
  }
}

void BpeModel::split_words(std::string_view piece, std::vector<std::string_view>& parts) const {
  size_t start = 0;
  for (size_t at = piece.find(kWordBoundary, 1); at != std::string_view::npos;
       at = piece.find(kWordBoundary, at + kWordBoundary.size())) {
    size_t previous = at - 1;
    while (previous > 0 && (static_cast<unsigned char>(piece[previous]) & 0xC0) == 0x80) --previous;
    const char32_t before = unicode::decode_at(piece, previous).code_point;
    if (character_token(before) == kNoToken || joins_word_boundary_.count(before)) continue;
    parts.push_back(piece.substr(start, at - start));
    start = at;
  }
  parts.push_back(piece.substr(start));
}

void BpeModel::split_characters(std::string_view piece, std::vector<TokenId>& parts,
                                std::vector<uint32_t>* lengths) const {
  // As Hugging Face's BPE::merge_word: an unknown character is held back (and fused with
  // the next unknown ones under fuse_unk) until a known character or the end comes, so it
  // lands after byte fallbacks that follow it.
  TokenId pending_unknown = kNoToken;
  uint32_t pending_length = 0;
  auto add = [&](TokenId id, uint32_t length) {
    parts.push_back(id);
    if (lengths) lengths->push_back(length);
  };
  for (size_t pos = 0; pos < piece.size();) {
    const auto byte = static_cast<unsigned char>(piece[pos]);
    // A byte-level piece's characters are its bytes, each measured as Hugging Face does, by
    // its character in the byte-level string.
    TokenId id;
    uint32_t advance, length;
    if (byte_level_) {
      id = byte_tokens_[byte];
      advance = 1;
      length = byte_level_width(piece[pos]);
    } else {
      const auto [code_point, code_point_length] = unicode::decode_at(piece, pos);
      id = character_token(code_point);
      advance = length = code_point_length;
    }
    if (id != kNoToken) {
      if (pending_unknown != kNoToken) add(pending_unknown, pending_length);
      pending_unknown = kNoToken;
      add(id, length);
    } else if (byte_fallback_ && std::all_of(piece.begin() + pos, piece.begin() + pos + advance, [&](char c) {
                 return byte_fallback_tokens_[static_cast<uint8_t>(c)] != kNoToken;
               })) {
      for (uint32_t i = 0; i < advance; ++i) add(byte_fallback_tokens_[static_cast<uint8_t>(piece[pos + i])], 1);
    } else if (unknown_token_ != kNoToken) {
      if (pending_unknown != kNoToken && fuse_unknown_) {
        pending_length += length;
      } else {
        if (pending_unknown != kNoToken) add(pending_unknown, pending_length);
        pending_unknown = unknown_token_;
        pending_length = length;
      }
    }
    // Otherwise, as in Hugging Face, the character produces no token.
    pos += advance;
  }
  if (pending_unknown != kNoToken) add(pending_unknown, pending_length);
}

void BpeModel::merge(std::vector<TokenId>& parts, std::vector<uint32_t>* lengths, Scratch& scratch) const {
  // Long pieces (SentencePiece-style text without a splitting pre-tokenizer is one piece
  // per segment) use the heap, which is O(n log n).
  if (parts.size() > 64) return merge_long(parts, lengths, scratch);
  RecentMerges& recent = scratch.recent;
  auto rank_of = [&](TokenId left, TokenId right) { return recent.find(merges_, left, right).rank; };
  // Merge the adjacent pair of lowest rank (the leftmost on ties) until none merges. The
  // ranks of adjacent pairs are kept beside the parts, so each merge recomputes two.
  std::vector<uint32_t>& ranks = scratch.ranks;
  ranks.clear();
  for (size_t i = 0; i + 1 < parts.size(); ++i) ranks.push_back(rank_of(parts[i], parts[i + 1]));
  while (!ranks.empty()) {
    const auto lowest = std::min_element(ranks.begin(), ranks.end());
    if (*lowest == kNoMerge) break;
    const size_t i = lowest - ranks.begin();
    parts[i] = recent.find(merges_, parts[i], parts[i + 1]).merged;
    parts.erase(parts.begin() + i + 1);
    if (lengths) {
      (*lengths)[i] += (*lengths)[i + 1];
      lengths->erase(lengths->begin() + i + 1);
    }
    ranks.erase(ranks.begin() + i);
    if (i > 0) ranks[i - 1] = rank_of(parts[i - 1], parts[i]);
    if (i < ranks.size()) ranks[i] = rank_of(parts[i], parts[i + 1]);
  }
}

void BpeModel::merge_long(std::vector<TokenId>& parts, std::vector<uint32_t>* lengths, Scratch& scratch) const {
  // Hugging Face's Word::merge_all: a min-heap of (rank, position) over a linked list of
  // symbols. A popped candidate applies when the pair now at its position merges into the
  // candidate's token (Hugging Face's test). That pair's merge is kept per position,
  // refreshed whenever the pair changes, so the test is one compare.
  using Candidate = LongMergeState::Candidate;
  constexpr uint32_t kNone = UINT32_MAX;
  LongMergeState& s = scratch.long_merge;
  RecentMerges& recent = scratch.recent;
  const uint32_t n = static_cast<uint32_t>(parts.size());
  s.previous.resize(n);
  s.next.resize(n);
  s.pair_merges.assign(n, kNoToken);
  s.heap.clear();
  for (uint32_t i = 0; i < n; ++i) {
    s.previous[i] = i == 0 ? kNone : i - 1;
    s.next[i] = i + 1 < n ? i + 1 : kNone;
  }
  // Looks up the pair starting at symbol `left` and records it; true when it merges.
  auto refresh = [&](uint32_t left) {
    s.pair_merges[left] = kNoToken;
    if (s.next[left] == kNone) return false;
    const Merge merge = recent.find(merges_, parts[left], parts[s.next[left]]);
    if (merge.rank == kNoMerge) return false;
    s.pair_merges[left] = merge.merged;
    s.heap.push_back({uint64_t{merge.rank} << 32 | left, merge.merged});
    return true;
  };
  const std::greater<Candidate> later;
  for (uint32_t i = 0; i + 1 < n; ++i) refresh(i);
  std::make_heap(s.heap.begin(), s.heap.end(), later);
  while (!s.heap.empty()) {
    std::pop_heap(s.heap.begin(), s.heap.end(), later);
    const Candidate top = s.heap.back();
    s.heap.pop_back();
    const auto position = static_cast<uint32_t>(top.order);
    // A merged-away symbol's pair_merges is kNoToken, so its candidates fail here too.
    if (s.pair_merges[position] != top.merged) continue;
    const uint32_t right = s.next[position];
    parts[position] = top.merged;
    if (lengths) (*lengths)[position] += (*lengths)[right];
    s.next[position] = s.next[right];
    if (s.next[right] != kNone) s.previous[s.next[right]] = position;
    s.pair_merges[right] = kNoToken;
    parts[right] = kNoToken;
    for (const uint32_t changed : {s.previous[position], position}) {
      if (changed != kNone && refresh(changed)) std::push_heap(s.heap.begin(), s.heap.end(), later);
    }
  }
  uint32_t kept = 0;
  for (uint32_t i = 0; i < n; ++i) {
    if (parts[i] == kNoToken) continue;
    parts[kept] = parts[i];
    if (lengths) (*lengths)[kept] = (*lengths)[i];
    ++kept;
  }
  parts.resize(kept);
  if (lengths) lengths->resize(kept);
}

}  // namespace barqtrain::tokenizer
