#include "data/tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "data/tokenizer/thread_pool.h"
#include "data/tokenizer/unicode.h"

namespace barqtrain::tokenizer {
namespace {

std::string type_of(const json::Value& component) {
  const json::Value* type = component.find("type");
  return type && type->is_string() ? type->as_string() : "(no type)";
}

bool flag(const json::Value& component, const char* name, bool fallback) {
  const json::Value* value = component.find(name);
  return value && !value->is_null() ? value->as_bool() : fallback;
}

[[noreturn]] void unsupported(const std::string& what) {
  throw TokenizerError("unsupported tokenizer.json feature: " + what);
}

// Pre-tokens already encoded by this thread, in an open-addressing table whose pieces and
// ids live in two arenas: a hit costs one hash over the piece's bytes, one probe or two and
// one memcmp, and allocates nothing. When half the slots are used the whole cache is
// dropped (English text refills it with its few thousand frequent words at once).
class PieceCache {
 public:
  static constexpr size_t kMaxPieceBytes = 64;

  // Clears the cache when it last served another tokenizer.
  void bind(uint64_t tokenizer_serial) {
    if (tokenizer_serial_ == tokenizer_serial) return;
    tokenizer_serial_ = tokenizer_serial;
    clear();
  }

  static uint64_t hash(std::string_view piece) {
    // Eight bytes at a time, with a multiply-xorshift mix (wyhash/splitmix style).
    const char* p = piece.data();
    const size_t n = piece.size();
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t word;
      std::memcpy(&word, p + i, 8);
      h = (h ^ word) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 31;
    }
    if (i < n) {
      uint64_t word = 0;
      std::memcpy(&word, p + i, n - i);
      h = (h ^ word) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 31;
    }
    h *= 0x94D049BB133111EBull;
    return h ^ (h >> 32);
  }

  // The cached ids of piece (hash(piece) == h), or nullptr; their number goes to *count.
  const TokenId* find(std::string_view piece, uint64_t h, size_t* count) const {
    const uint32_t tag = static_cast<uint32_t>(h >> 32);
    for (size_t i = h & kMask;; i = (i + 1) & kMask) {
      const Slot slot = slots_[i];
      if (slot.entry == 0) return nullptr;
      if (slot.tag != tag) continue;
      const Entry& entry = entries_[slot.entry - 1];
      if (entry.length == piece.size() &&
          std::memcmp(bytes_.data() + entry.bytes_offset, piece.data(), piece.size()) == 0) {
        *count = entry.count;
        return ids_.data() + entry.ids_offset;
      }
    }
  }

  // Stores the ids of piece, which is not in the cache yet (1 <= size <= kMaxPieceBytes).
  void store(std::string_view piece, uint64_t h, const TokenId* ids, size_t count) {
    if (entries_.size() >= kSlots / 2) clear();
    size_t i = h & kMask;
    while (slots_[i].entry != 0) i = (i + 1) & kMask;
    entries_.push_back(Entry{static_cast<uint32_t>(bytes_.size()), static_cast<uint32_t>(ids_.size()),
                             static_cast<uint8_t>(piece.size()), static_cast<uint8_t>(count)});
    slots_[i] = Slot{static_cast<uint32_t>(h >> 32), static_cast<uint32_t>(entries_.size())};
    bytes_.append(piece.data(), piece.size());
    ids_.insert(ids_.end(), ids, ids + count);
  }

 private:
  // 8-byte slots keep the probed table small (512 KiB); the entries they point to are in
  // insertion order, so the frequent pieces, seen first, share cache lines.
  static constexpr size_t kSlots = size_t{1} << 16;
  static constexpr size_t kMask = kSlots - 1;
  struct Slot {
    uint32_t tag;    // the hash's upper half
    uint32_t entry;  // 1 + index into entries_, 0 for a free slot
  };
  // A piece of n bytes has at most n tokens, so both counts fit a byte.
  struct Entry {
    uint32_t bytes_offset;
    uint32_t ids_offset;
    uint8_t length;
    uint8_t count;
  };
  static_assert(kMaxPieceBytes < 256, "piece lengths are stored in a byte");

  void clear() {
    slots_.assign(kSlots, Slot{0, 0});
    entries_.clear();
    bytes_.clear();
    ids_.clear();
  }

  uint64_t tokenizer_serial_ = 0;
  std::vector<Slot> slots_;
  std::vector<Entry> entries_;
  std::string bytes_;
  std::vector<TokenId> ids_;
};

thread_local PieceCache piece_cache;
std::atomic<uint64_t> next_serial{1};

void read_normalizer(const json::Value* normalizer, bool* nfc) {
  if (!normalizer || normalizer->is_null()) return;
  const std::string type = type_of(*normalizer);
  if (type != "NFC") unsupported("normalizer " + type);
  *nfc = true;
}

void read_pre_tokenizer(const json::Value* pre_tokenizer, std::optional<SplitPattern>* pattern,
                        bool* add_prefix_space) {
  if (!pre_tokenizer || pre_tokenizer->is_null()) {
    unsupported("a BPE model without a ByteLevel pre-tokenizer (SentencePiece-style BPE is not supported yet)");
  }
  const std::string type = type_of(*pre_tokenizer);
  if (type == "ByteLevel") {
    // ByteLevel alone splits with GPT-2's pattern when use_regex is set.
    if (flag(*pre_tokenizer, "use_regex", true)) *pattern = SplitPattern::kGpt2;
    *add_prefix_space = flag(*pre_tokenizer, "add_prefix_space", true);
    return;
  }
  // Sequence[Split(pattern, Isolated), ByteLevel(use_regex=false)]: Llama-3, Qwen2.
  const json::Value* steps = pre_tokenizer->find("pretokenizers");
  if (type != "Sequence" || !steps || !steps->is_array() || steps->as_array().size() != 2 ||
      type_of(steps->as_array()[0]) != "Split" || type_of(steps->as_array()[1]) != "ByteLevel") {
    unsupported("pre_tokenizer " + type +
                " (supported: ByteLevel, and Sequence of a regex Split then ByteLevel)");
  }
  const json::Value& split = steps->as_array()[0];
  const json::Value& byte_level = steps->as_array()[1];
  const json::Value* regex = split.find("pattern") ? split.find("pattern")->find("Regex") : nullptr;
  if (!regex || !regex->is_string()) unsupported("Split pre-tokenizer without a Regex pattern");
  *pattern = split_pattern_from_regex(regex->as_string());
  if (!*pattern) {
    unsupported("Split pre-tokenizer pattern " + regex->as_string() +
                " (supported: the patterns of GPT-2, Llama-3 and Qwen2)");
  }
  const json::Value* behavior = split.find("behavior");
  if (!behavior || !behavior->is_string() || behavior->as_string() != "Isolated" || flag(split, "invert", false)) {
    unsupported("Split pre-tokenizer options other than behavior Isolated, invert false");
  }
  if (flag(byte_level, "use_regex", true) || flag(byte_level, "add_prefix_space", true)) {
    unsupported("ByteLevel after Split with use_regex or add_prefix_space set");
  }
}

// TemplateProcessing for a single sequence: the special tokens before and after it.
void read_template(const json::Value& processor, std::vector<TokenId>* prefix, std::vector<TokenId>* suffix) {
  const json::Value* single = processor.find("single");
  const json::Value* special_tokens = processor.find("special_tokens");
  if (!single || !single->is_array() || !special_tokens) unsupported("TemplateProcessing without single/special_tokens");
  std::vector<TokenId> before, after;
  bool seen_sequence = false;
  for (const json::Value& piece : single->as_array()) {
    if (const json::Value* sequence = piece.find("Sequence")) {
      const json::Value* id = sequence->find("id");
      if (seen_sequence || !id || id->as_string() != "A") unsupported("TemplateProcessing single template other than one $A");
      seen_sequence = true;
      continue;
    }
    const json::Value* special = piece.find("SpecialToken");
    if (!special) unsupported("TemplateProcessing piece other than Sequence or SpecialToken");
    const std::string& name = special->find("id") ? special->find("id")->as_string() : "";
    const json::Value* entry = special_tokens->find(name);
    if (!entry || !entry->find("ids")) throw TokenizerError("TemplateProcessing: special token " + name + " is not in special_tokens");
    for (const json::Value& id : entry->find("ids")->as_array()) {
      (seen_sequence ? after : before).push_back(static_cast<TokenId>(id.as_integer()));
    }
  }
  prefix->insert(prefix->begin(), before.begin(), before.end());
  suffix->insert(suffix->end(), after.begin(), after.end());
}

void read_post_processor(const json::Value* processor, std::vector<TokenId>* prefix, std::vector<TokenId>* suffix) {
  if (!processor || processor->is_null()) return;
  const std::string type = type_of(*processor);
  if (type == "ByteLevel") return;  // it only adjusts offsets
  if (type == "TemplateProcessing") return read_template(*processor, prefix, suffix);
  if (type == "Sequence") {
    const json::Value* processors = processor->find("processors");
    if (!processors) unsupported("post_processor Sequence without processors");
    for (const json::Value& each : processors->as_array()) read_post_processor(&each, prefix, suffix);
    return;
  }
  unsupported("post_processor " + type);
}

}  // namespace

void Tokenizer::AddedTokenMatcher::add(const AddedToken& token) {
  tokens_.push_back(token);
  starts_token_[static_cast<uint8_t>(token.content[0])] = true;
}

void Tokenizer::AddedTokenMatcher::finish() {
  single_start_ = -1;
  for (int byte = 0; byte < 256; ++byte) {
    if (!starts_token_[byte]) continue;
    if (single_start_ >= 0) {
      single_start_ = -1;
      break;
    }
    single_start_ = byte;
  }
  // Longest first, so the first token that matches at an offset is the longest there.
  std::stable_sort(tokens_.begin(), tokens_.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
}

const Tokenizer::AddedToken* Tokenizer::AddedTokenMatcher::find(std::string_view text, size_t from,
                                                                bool skip_special, size_t* at) const {
  if (tokens_.empty()) return nullptr;
  for (size_t pos = from; pos < text.size(); ++pos) {
    if (single_start_ >= 0) {
      // Every token starts with the same byte ("<" of "<|endoftext|>"): memchr skips to it.
      const void* hit = std::memchr(text.data() + pos, single_start_, text.size() - pos);
      if (!hit) return nullptr;
      pos = static_cast<const char*>(hit) - text.data();
    } else if (!starts_token_[static_cast<uint8_t>(text[pos])]) {
      continue;
    }
    for (const AddedToken& token : tokens_) {
      if (skip_special && token.special) continue;
      if (text.compare(pos, token.content.size(), token.content) == 0) {
        *at = pos;
        return &token;
      }
    }
  }
  return nullptr;
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  try {
    return Tokenizer(json::parse_file(path));
  } catch (const json::JsonError& error) {
    throw TokenizerError(error.what());
  } catch (const TokenizerError& error) {
    throw TokenizerError(path + ": " + error.what());
  }
}

Tokenizer::Tokenizer(const json::Value& config) : serial_(next_serial++) {
  if (!config.is_object()) throw TokenizerError("tokenizer.json is not a JSON object");
  for (const char* option : {"truncation", "padding"}) {
    if (const json::Value* value = config.find(option); value && !value->is_null()) {
      unsupported(std::string(option) + " (set it in the data pipeline instead)");
    }
  }
  const json::Value* model = config.find("model");
  if (!model) throw TokenizerError("tokenizer.json has no model");
  try {
    read_normalizer(config.find("normalizer"), &nfc_);
    model_ = std::make_shared<BpeModel>(*model);
    read_pre_tokenizer(config.find("pre_tokenizer"), &split_pattern_, &add_prefix_space_);
    read_post_processor(config.find("post_processor"), &prefix_, &suffix_);
    const json::Value* decoder = config.find("decoder");
    if (!decoder || decoder->is_null() || type_of(*decoder) != "ByteLevel") {
      unsupported("decoder " + (decoder && !decoder->is_null() ? type_of(*decoder) : std::string("null")) +
                  " (only ByteLevel is supported)");
    }
  } catch (const json::JsonError& error) {
    throw TokenizerError(std::string("malformed tokenizer.json: ") + error.what());
  }

  if (const json::Value* added = config.find("added_tokens")) {
    for (const json::Value& entry : added->as_array()) {
      const std::string& content = entry.find("content") ? entry.find("content")->as_string() : "";
      if (content.empty()) throw TokenizerError("added_tokens: a token without content");
      for (const char* option : {"single_word", "lstrip", "rstrip"}) {
        if (flag(entry, option, false)) unsupported(std::string("added token option ") + option + " (on " + content + ")");
      }
      const int64_t id = entry.find("id") ? entry.find("id")->as_integer() : -1;
      if (id < 0 || id >= (int64_t{1} << 24)) throw TokenizerError("added_tokens: bad id for " + content);
      const AddedToken token{content, static_cast<TokenId>(id), flag(entry, "special", false)};
      (flag(entry, "normalized", !token.special) ? normalized_added_tokens_ : raw_added_tokens_).add(token);
      if (added_token_bytes_.size() <= token.id) {
        added_token_bytes_.resize(token.id + 1);
        special_ids_.resize(token.id + 1);
      }
      added_token_bytes_[token.id] = byte_level_decode(content);
      special_ids_[token.id] = token.special;
    }
  }
  raw_added_tokens_.finish();
  normalized_added_tokens_.finish();
  for (const TokenId id : prefix_) {
    if (!model_->has_token(id) && !(id < added_token_bytes_.size() && added_token_bytes_[id])) {
      throw TokenizerError("post_processor adds token id " + std::to_string(id) + ", which is not in the vocabulary");
    }
  }
}

size_t Tokenizer::id_bound() const { return std::max(model_->id_bound(), added_token_bytes_.size()); }

template <typename Emit>
void Tokenizer::split_added_tokens(const AddedTokenMatcher& matcher, std::string_view text, bool skip_special,
                                   Emit&& emit) const {
  size_t done = 0, at = 0;
  while (const AddedToken* token = matcher.find(text, done, skip_special, &at)) {
    if (at > done) emit(text.substr(done, at - done), nullptr);
    emit(std::string_view(), token);
    done = at + token->content.size();
  }
  if (done < text.size()) emit(text.substr(done), nullptr);
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<TokenId> ids;
  ids.reserve(text.size() / 3 + prefix_.size() + suffix_.size());
  encode_into(text, options, ids);
  return ids;
}

void Tokenizer::encode_into(std::string_view text, const EncodeOptions& options, std::vector<TokenId>& ids) const {
  if (const size_t bad = unicode::find_invalid_utf8(text); bad != text.size()) {
    throw TokenizerError("input text is not valid UTF-8 (byte offset " + std::to_string(bad) + ")");
  }
  piece_cache.bind(serial_);
  if (options.add_special_tokens) ids.insert(ids.end(), prefix_.begin(), prefix_.end());
  thread_local std::string normalized;
  split_added_tokens(raw_added_tokens_, text, options.split_special_tokens,
                     [&](std::string_view segment, const AddedToken* token) {
                       if (token) return ids.push_back(token->id);
                       std::string_view segment_text = segment;
                       if (nfc_) {
                         normalized.clear();
                         unicode::append_nfc(segment, normalized);
                         segment_text = normalized;
                       }
                       split_added_tokens(normalized_added_tokens_, segment_text, options.split_special_tokens,
                                          [&](std::string_view part, const AddedToken* inner) {
                                            if (inner) return ids.push_back(inner->id);
                                            encode_text(part, ids);
                                          });
                     });
  if (options.add_special_tokens) ids.insert(ids.end(), suffix_.begin(), suffix_.end());
}

void Tokenizer::encode_text(std::string_view text, std::vector<TokenId>& out) const {
  if (add_prefix_space_ && text[0] != ' ') {
    thread_local std::string prefixed;
    prefixed.assign(1, ' ');
    prefixed.append(text);
    return encode_pieces(prefixed, out);
  }
  encode_pieces(text, out);
}

void Tokenizer::encode_pieces(std::string_view text, std::vector<TokenId>& out) const {
  thread_local std::vector<std::string_view> pieces;
  pieces.clear();
  if (split_pattern_) {
    split(*split_pattern_, text, pieces);
  } else {
    pieces.push_back(text);
  }
  PieceCache& cache = piece_cache;
  for (const std::string_view piece : pieces) {
    if (piece.size() > PieceCache::kMaxPieceBytes) {
      model_->encode_piece(piece, out);
      continue;
    }
    const uint64_t h = PieceCache::hash(piece);
    size_t count;
    if (const TokenId* cached = cache.find(piece, h, &count)) {
      // Most pieces are one token: push_back is far cheaper than a range insert.
      if (count == 1) {
        out.push_back(*cached);
      } else {
        out.insert(out.end(), cached, cached + count);
      }
      continue;
    }
    const size_t start = out.size();
    model_->encode_piece(piece, out);
    cache.store(piece, h, out.data() + start, out.size() - start);
  }
}

namespace {

// Runs encode_chunk(first, last) over [0, count) in chunks on a pool of threads, which take
// the next chunk from a shared counter (balancing uneven lengths); rethrows the first error.
template <typename EncodeChunk>
void run_chunks(size_t count, size_t chunk, size_t num_threads, EncodeChunk&& encode_chunk) {
  const size_t chunks = (count + chunk - 1) / chunk;
  if (num_threads == 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  num_threads = std::min(num_threads, chunks);
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  parallel_run(num_threads, [&] {
    try {
      for (size_t c; (c = next.fetch_add(1)) < chunks;) encode_chunk(c * chunk, std::min(count, (c + 1) * chunk));
    } catch (...) {
      const std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next = chunks;
    }
  });
  if (failure) std::rethrow_exception(failure);
}

// Enough chunks per thread to balance the load, few enough to keep the counter cold.
size_t chunk_size(size_t count) { return std::clamp<size_t>(count / 256, 1, 64); }

}  // namespace

std::vector<std::vector<TokenId>> Tokenizer::encode_batch(const std::vector<std::string_view>& texts,
                                                          const EncodeOptions& options, size_t num_threads) const {
  std::vector<std::vector<TokenId>> results(texts.size());
  run_chunks(texts.size(), chunk_size(texts.size()), num_threads, [&](size_t first, size_t last) {
    for (size_t i = first; i < last; ++i) results[i] = encode(texts[i], options);
  });
  return results;
}

Tokenizer::FlatIds Tokenizer::encode_batch_flat(const std::vector<std::string_view>& texts,
                                                const EncodeOptions& options, size_t num_threads) const {
  // Each chunk of texts is encoded into its own buffer, then the buffers are joined.
  const size_t chunk = chunk_size(texts.size());
  const size_t chunks = (texts.size() + chunk - 1) / chunk;
  std::vector<std::vector<TokenId>> chunk_ids(chunks);
  FlatIds flat;
  flat.offsets.assign(texts.size() + 1, 0);
  run_chunks(texts.size(), chunk, num_threads, [&](size_t first, size_t last) {
    std::vector<TokenId>& ids = chunk_ids[first / chunk];
    size_t bytes = 0;
    for (size_t i = first; i < last; ++i) bytes += texts[i].size();
    ids.reserve(bytes / 3 + 16);
    for (size_t i = first; i < last; ++i) {
      encode_into(texts[i], options, ids);
      flat.offsets[i + 1] = static_cast<int64_t>(ids.size());  // relative to the chunk for now
    }
  });
  size_t total = 0;
  for (const auto& ids : chunk_ids) total += ids.size();
  flat.ids.resize(total);
  int64_t base = 0;
  for (size_t c = 0; c < chunks; ++c) {
    std::copy(chunk_ids[c].begin(), chunk_ids[c].end(), flat.ids.begin() + base);
    for (size_t i = c * chunk; i < std::min(texts.size(), (c + 1) * chunk); ++i) flat.offsets[i + 1] += base;
    base += static_cast<int64_t>(chunk_ids[c].size());
    std::vector<TokenId>().swap(chunk_ids[c]);
  }
  return flat;
}

std::string Tokenizer::decode(const std::vector<TokenId>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const TokenId id : ids) {
    if (id < added_token_bytes_.size() && added_token_bytes_[id]) {
      if (!(skip_special_tokens && special_ids_[id])) bytes += *added_token_bytes_[id];
    } else if (model_->has_token(id)) {
      bytes += model_->token_bytes(id);
    } else {
      throw TokenizerError("cannot decode token id " + std::to_string(id) + ": it is not in the vocabulary");
    }
  }
  return unicode::decode_utf8_lossy(bytes);
}

}  // namespace barqtrain::tokenizer
