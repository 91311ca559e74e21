#include "data/tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "data/tokenizer/config.h"
#include "data/tokenizer/hash.h"
#include "data/tokenizer/regex.h"
#include "data/tokenizer/thread_pool.h"
#include "data/tokenizer/unicode.h"

namespace barqtrain::tokenizer {
namespace {

// Pre-tokens already encoded by this thread, in an open-addressing table whose pieces and
// ids live in two arenas: a hit costs one hash over the piece's bytes, one probe or two and
// one memcmp, and allocates nothing. When half the slots are used the whole cache is
// dropped (English text refills it with its few thousand frequent words at once).
// Pieces of up to 255 bytes are kept: a byte-level pre-token of Chinese or Japanese is a
// whole run of ideographs between punctuation, often 60-200 bytes, and merging it from its
// bytes costs far more than keeping it.
class PieceCache {
 public:
  static constexpr size_t kMaxPieceBytes = 255;

  // Clears the cache when it last served another tokenizer.
  void bind(uint64_t tokenizer_serial) {
    if (tokenizer_serial_ == tokenizer_serial) return;
    tokenizer_serial_ = tokenizer_serial;
    clear();
  }

  // The cached ids of piece (hash_bytes(piece) == h), or nullptr; their number goes to *count.
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
  // 8-byte slots keep the probed table small (1 MiB); the entries they point to are in
  // insertion order, so the frequent pieces, seen first, share cache lines.
  static constexpr size_t kSlots = size_t{1} << 17;
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
  static_assert(kMaxPieceBytes <= 255, "piece lengths are stored in a byte");

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

struct PostProcessor {
  std::vector<TokenId> prefix, suffix;
  bool trim_offsets = false;
  bool add_prefix_space = false;
};

void read_post_processor(const json::Value* processor, PostProcessor* out) {
  if (!processor || processor->is_null()) return;
  const std::string type = type_of(*processor);
  if (type == "ByteLevel") {
    // It only adjusts offsets: with trim_offsets, spaces at the ends of a token are not
    // part of its offsets.
    out->trim_offsets = flag(*processor, "trim_offsets", true);
    out->add_prefix_space = flag(*processor, "add_prefix_space", true);
    return;
  }
  if (type == "TemplateProcessing") return read_template(*processor, &out->prefix, &out->suffix);
  if (type == "Sequence") {
    const json::Value* processors = processor->find("processors");
    if (!processors) unsupported("post_processor Sequence without processors");
    for (const json::Value& each : processors->as_array()) read_post_processor(&each, out);
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
                                                                size_t* at) const {
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
    normalizer_ = Normalizer(config.find("normalizer"));
    pre_tokenizer_ = PreTokenizer::read(config.find("pre_tokenizer"));
    const bool byte_level = pre_tokenizer_.byte_level();
    model_ = std::make_shared<BpeModel>(*model, byte_level);
    PostProcessor post_processor;
    read_post_processor(config.find("post_processor"), &post_processor);
    prefix_ = std::move(post_processor.prefix);
    suffix_ = std::move(post_processor.suffix);
    trim_offsets_ = post_processor.trim_offsets;
    trim_keeps_prefix_space_ = post_processor.add_prefix_space;
    const json::Value* decoder = config.find("decoder");
    const bool has_decoder = decoder && !decoder->is_null();
    const bool byte_level_decoder = has_decoder && type_of(*decoder) == "ByteLevel";
    if (byte_level != byte_level_decoder) {
      unsupported(std::string("decoder ") + (has_decoder ? type_of(*decoder) : "null") + " with a " +
                  (byte_level ? "byte-level" : "SentencePiece-style (not byte-level)") +
                  " model (a byte-level model needs the ByteLevel decoder, and only it)");
    }
    if (has_decoder && !byte_level_decoder) decoder_.emplace(*decoder);
  } catch (const json::JsonError& error) {
    throw TokenizerError(std::string("malformed tokenizer.json: ") + error.what());
  }

  if (const json::Value* added = config.find("added_tokens")) {
    for (const json::Value& entry : added->as_array()) {
      const std::string& content = entry.find("content") ? entry.find("content")->as_string() : "";
      if (content.empty()) throw TokenizerError("added_tokens: a token without content");
      const int64_t id = entry.find("id") ? entry.find("id")->as_integer() : -1;
      if (id < 0 || id >= (int64_t{1} << 24)) throw TokenizerError("added_tokens: bad id for " + content);
      const bool special = flag(entry, "special", false);
      const bool normalized = flag(entry, "normalized", !special);
      // A normalized token is matched, and decodes, as its normalized form (Hugging Face's
      // normalized_cache): "hello world" is "▁hello▁world" under Prepend and Replace.
      AddedToken token{content,
                       static_cast<TokenId>(id),
                       special,
                       flag(entry, "single_word", false),
                       flag(entry, "lstrip", false),
                       flag(entry, "rstrip", false)};
      if (normalized && !normalizer_.empty()) {
        AlignedText text;
        text.assign(content, 0, false);
        normalizer_.normalize(text);
        if (text.text.empty()) throw TokenizerError("added_tokens: " + content + " normalizes to nothing");
        token.content = text.text;
      }
      (normalized ? normalized_added_tokens_ : raw_added_tokens_).add(token);
      if (added_token_content_.size() <= token.id) {
        added_token_content_.resize(token.id + 1);
        special_ids_.resize(token.id + 1);
      }
      added_token_content_[token.id] = token.content;
      special_ids_[token.id] = token.special;
    }
  }
  raw_added_tokens_.finish();
  normalized_added_tokens_.finish();
  std::vector<TokenId> template_ids = prefix_;
  template_ids.insert(template_ids.end(), suffix_.begin(), suffix_.end());
  for (const TokenId id : template_ids) {
    if (!model_->has_token(id) && !(id < added_token_content_.size() && added_token_content_[id])) {
      throw TokenizerError("post_processor adds token id " + std::to_string(id) + ", which is not in the vocabulary");
    }
  }
}

size_t Tokenizer::id_bound() const { return std::max(model_->id_bound(), added_token_content_.size()); }

namespace {

// The length of the white space (Unicode's White_Space) that text starts with.
size_t leading_white_space(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const auto [code_point, length] = unicode::decode_at(text, pos);
    if (unicode::classify(code_point) != unicode::CodePointClass::kWhiteSpace) break;
    pos += length;
  }
  return pos;
}

// Where the last character of text (valid UTF-8, not empty) starts.
size_t last_character_start(std::string_view text) {
  size_t start = text.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  return start;
}

// Where the white space that text ends with starts.
size_t trailing_white_space_start(std::string_view text) {
  size_t end = text.size();
  while (end > 0) {
    const size_t start = last_character_start(text.substr(0, end));
    if (unicode::classify(unicode::decode_at(text, start).code_point) != unicode::CodePointClass::kWhiteSpace) break;
    end = start;
  }
  return end;
}

}  // namespace

template <typename Emit>
void Tokenizer::split_added_tokens(const AddedTokenMatcher& matcher, std::string_view text, bool skip_special,
                                   Emit&& emit) const {
  // Hugging Face's AddedVocabulary::find_matches: the matcher moves on from the end of each
  // match, skipped or not; a token then takes the white space its lstrip and rstrip ask for,
  // the text between tokens being what is left.
  size_t done = 0, search_from = 0, at = 0;
  while (const AddedToken* token = matcher.find(text, search_from, &at)) {
    size_t start = at, stop = at + token->content.size();
    search_from = stop;
    if (skip_special && token->special) continue;
    if (token->single_word && ((start > 0 && is_word_character_at(text, last_character_start(text.substr(0, start)))) ||
                               (stop < text.size() && is_word_character_at(text, stop)))) {
      continue;
    }
    if (token->lstrip) start = std::max(trailing_white_space_start(text.substr(0, start)), done);
    if (token->rstrip) stop += leading_white_space(text.substr(stop));
    if (start > done) emit(text.substr(done, start - done), nullptr);
    emit(text.substr(start, stop - start), token);
    done = stop;
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
  encode_all(text, options, ids, nullptr);
}

Tokenizer::Encoding Tokenizer::encode_with_offsets(std::string_view text, const EncodeOptions& options) const {
  Encoding encoding;
  encode_all(text, options, encoding.ids, &encoding.offsets);
  return encoding;
}

void Tokenizer::encode_all(std::string_view text, const EncodeOptions& options, std::vector<TokenId>& ids,
                           std::vector<Span>* offsets) const {
  if (const size_t bad = unicode::find_invalid_utf8(text); bad != text.size()) {
    throw TokenizerError("input text is not valid UTF-8 (byte offset " + std::to_string(bad) + ")");
  }
  if (text.size() > UINT32_MAX && offsets) throw TokenizerError("offsets need a text shorter than 4 GiB");
  piece_cache.bind(serial_);
  auto add_template = [&](const std::vector<TokenId>& tokens) {
    if (!options.add_special_tokens) return;
    ids.insert(ids.end(), tokens.begin(), tokens.end());
    if (offsets) offsets->insert(offsets->end(), tokens.size(), Span{0, 0});
  };
  add_template(prefix_);
  const size_t first_text_token = ids.size();
  const bool tracked = offsets != nullptr;
  // With trim_offsets, an added token's offsets are trimmed as it is matched, where its
  // text (with the white space lstrip and rstrip took) is known; the model's tokens after.
  thread_local std::vector<size_t> added_positions;
  added_positions.clear();
  auto add_token = [&](const AddedToken& token, std::string_view value, Span span) {
    ids.push_back(token.id);
    if (!offsets) return;
    if (trim_offsets_) {
      span = trimmed(span, value, /*added=*/true, ids.size() - 1 == first_text_token);
      added_positions.push_back(ids.size() - 1);
    }
    offsets->push_back(span);
  };
  thread_local AlignedText normalized;
  split_added_tokens(raw_added_tokens_, text, options.split_special_tokens,
                     [&](std::string_view segment, const AddedToken* token) {
                       const size_t segment_start = segment.data() - text.data();
                       if (token) {
                         return add_token(*token, segment,
                                          {static_cast<uint32_t>(segment_start),
                                           static_cast<uint32_t>(segment_start + segment.size())});
                       }
                       std::string_view segment_text = segment;
                       const Span* spans = nullptr;
                       if (!normalizer_.empty() || tracked) {
                         normalized.assign(segment, segment_start, tracked);
                         normalizer_.normalize(normalized);
                         segment_text = normalized.text;
                         if (tracked) spans = normalized.spans.data();
                       }
                       split_added_tokens(
                           normalized_added_tokens_, segment_text, options.split_special_tokens,
                           [&](std::string_view part, const AddedToken* inner) {
                             const size_t part_start = part.data() - segment_text.data();
                             if (inner) {
                               return add_token(*inner, part,
                                                spans ? Span{spans[part_start].start,
                                                             spans[part_start + part.size() - 1].end}
                                                      : Span{0, 0});
                             }
                             encode_part(part, spans ? spans + part_start : nullptr,
                                         segment_start == 0 && part_start == 0, ids, offsets);
                           });
                     });
  if (offsets && trim_offsets_) {
    size_t next_added = 0;
    for (size_t i = first_text_token; i < ids.size(); ++i) {
      if (next_added < added_positions.size() && added_positions[next_added] == i) {
        ++next_added;
        continue;
      }
      (*offsets)[i] = trimmed((*offsets)[i], model_->token_bytes(ids[i]), /*added=*/false, i == first_text_token);
    }
  }
  add_template(suffix_);
}

void Tokenizer::encode_part(std::string_view text, const Span* spans, bool at_input_start, std::vector<TokenId>& ids,
                            std::vector<Span>* offsets) const {
  thread_local std::vector<std::string_view> pieces;
  thread_local AlignedText edited;
  thread_local std::string scratch;
  thread_local std::vector<Span> scratch_spans;
  pieces.clear();
  // Pre-tokenizers that edit the text work on a copy (with its spans when tracking).
  auto edit = [&] {
    edited.text.assign(text.data(), text.size());
    edited.tracked = spans != nullptr;
    if (spans) edited.spans.assign(spans, spans + text.size());
  };
  if (const std::optional<Metaspace>& metaspace = pre_tokenizer_.metaspace()) {
    edit();
    replace_all(edited, " ", metaspace->replacement, scratch, scratch_spans);
    const bool prepend_here = metaspace->prepend_scheme == Metaspace::PrependScheme::kAlways ||
                              (metaspace->prepend_scheme == Metaspace::PrependScheme::kFirst && at_input_start);
    if (prepend_here && edited.text.compare(0, metaspace->replacement.size(), metaspace->replacement) != 0) {
      prepend(edited, metaspace->replacement);
    }
    text = edited.text;
    if (spans) spans = edited.spans.data();
    if (metaspace->split) {
      split_before(metaspace->replacement, text, pieces);
    } else {
      pieces.push_back(text);
    }
    return encode_pieces(pieces, text, spans, ids, offsets);
  }
  if (pre_tokenizer_.add_prefix_space() && text[0] != ' ') {
    edit();
    prepend(edited, " ");
    text = edited.text;
    if (spans) spans = edited.spans.data();
  }
  pre_tokenizer_.split(text, pieces);
  encode_pieces(pieces, text, spans, ids, offsets);
}

void Tokenizer::encode_pieces(const std::vector<std::string_view>& pre_tokens, std::string_view text,
                              const Span* spans, std::vector<TokenId>& ids, std::vector<Span>* offsets) const {
  const std::vector<std::string_view>* split_pieces = &pre_tokens;
  if (model_->can_split_words()) {
    thread_local std::vector<std::string_view> words;
    words.clear();
    for (const std::string_view piece : pre_tokens) model_->split_words(piece, words);
    split_pieces = &words;
  }
  const std::vector<std::string_view>& pieces = *split_pieces;
  if (offsets) {
    // Offsets come from the model's token ranges; the cache, which keeps only ids, is bypassed.
    thread_local std::vector<ByteRange> ranges;
    for (const std::string_view piece : pieces) {
      ranges.clear();
      model_->encode_piece(piece, ids, &ranges);
      const size_t at = piece.data() - text.data();
      for (const ByteRange range : ranges) {
        offsets->push_back({spans[at + range.start].start, spans[at + range.end - 1].end});
      }
    }
    return;
  }
  PieceCache& cache = piece_cache;
  for (const std::string_view piece : pieces) {
    if (piece.size() > PieceCache::kMaxPieceBytes) {
      model_->encode_piece(piece, ids);
      continue;
    }
    const uint64_t h = hash_bytes(piece);
    size_t count;
    if (const TokenId* cached = cache.find(piece, h, &count)) {
      // Most pieces are one token: push_back is far cheaper than a range insert.
      if (count == 1) {
        ids.push_back(*cached);
      } else {
        ids.insert(ids.end(), cached, cached + count);
      }
      continue;
    }
    const size_t start = ids.size();
    model_->encode_piece(piece, ids);
    cache.store(piece, h, ids.data() + start, ids.size() - start);
  }
}

Span Tokenizer::trimmed(Span span, std::string_view value, bool added, bool first_token) const {
  // The bytes and the number of the space characters at the start and at the end of value.
  size_t leading = 0, leading_count = 0, trailing = 0, trailing_count = 0;
  if (added) {
    auto is_space = [&](size_t pos) {
      const char32_t cp = unicode::decode_at(value, pos).code_point;
      return cp == U'\u0120' || unicode::classify(cp) == unicode::CodePointClass::kWhiteSpace;
    };
    while (leading < value.size() && is_space(leading)) {
      leading += unicode::decode_at(value, leading).length;
      ++leading_count;
    }
    for (size_t end = value.size(); end > 0;) {
      const size_t start = last_character_start(value.substr(0, end));
      if (!is_space(start)) break;
      trailing += end - start;
      ++trailing_count;
      end = start;
    }
  } else {
    // A model token's bytes: its "Ġ" are spaces, and nothing else in the byte alphabet is.
    while (leading < value.size() && value[leading] == ' ') ++leading;
    while (trailing < value.size() && value[value.size() - 1 - trailing] == ' ') ++trailing;
    leading_count = leading;
    trailing_count = trailing;
  }
  if (leading_count > 0) {
    const bool is_first = first_token || span.start == 0;
    if (is_first && trim_keeps_prefix_space_ && leading_count == 1) leading = 0;
    span.start = std::min<uint32_t>(span.start + leading, span.end);
  }
  if (trailing_count > 0 && span.end >= trailing) span.end = std::max<uint32_t>(span.end - trailing, span.start);
  return span;
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

std::vector<Tokenizer::Encoding> Tokenizer::encode_batch_with_offsets(const std::vector<std::string_view>& texts,
                                                                      const EncodeOptions& options,
                                                                      size_t num_threads) const {
  std::vector<Encoding> results(texts.size());
  run_chunks(texts.size(), chunk_size(texts.size()), num_threads, [&](size_t first, size_t last) {
    for (size_t i = first; i < last; ++i) results[i] = encode_with_offsets(texts[i], options);
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
  auto check = [&](TokenId id) {
    if (!model_->has_token(id)) {
      throw TokenizerError("cannot decode token id " + std::to_string(id) + ": it is not in the vocabulary");
    }
  };
  if (model_->byte_level()) {
    std::string bytes;
    for (const TokenId id : ids) {
      if (id < added_token_content_.size() && added_token_content_[id]) {
        if (!(skip_special_tokens && special_ids_[id])) bytes += byte_level_decode(*added_token_content_[id]);
        continue;
      }
      check(id);
      bytes += model_->token_bytes(id);
    }
    return unicode::decode_utf8_lossy(bytes);
  }
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const TokenId id : ids) {
    if (id < added_token_content_.size() && added_token_content_[id]) {
      if (!(skip_special_tokens && special_ids_[id])) tokens.push_back(*added_token_content_[id]);
      continue;
    }
    check(id);
    tokens.push_back(model_->token_bytes(id));
  }
  if (decoder_) return decoder_->decode(std::move(tokens));
  // Without a decoder, Hugging Face joins the tokens with spaces.
  std::string text;
  for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
  return text;
}

}  // namespace barqtrain::tokenizer
