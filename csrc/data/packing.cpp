#include "data/packing.h"

#include <algorithm>
#include <limits>

namespace barqtrain::data {
namespace {

// splitmix64: a small generator whose output is the same everywhere (std::shuffle and the
// std distributions are not specified bit for bit, so they would break determinism).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), without modulo bias (Lemire's method).
  uint64_t below(uint64_t bound) {
    __uint128_t m = static_cast<__uint128_t>(next()) * bound;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < bound) {
      const uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        m = static_cast<__uint128_t>(next()) * bound;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  uint64_t state_;
};

uint64_t mix(uint64_t a, uint64_t b) {
  Rng rng(a ^ (b * 0xD1B54A32D192ED03ull));
  return rng.next();
}

template <typename T>
void shuffle(std::vector<T>& values, Rng& rng) {
  for (size_t i = values.size(); i > 1; --i) std::swap(values[i - 1], values[rng.below(i)]);
}

// A set of capacities in [0, n) with "smallest member >= x" in a few word operations.
class CapacitySet {
 public:
  explicit CapacitySet(size_t n) : low_((n + 63) / 64, 0), high_((low_.size() + 63) / 64, 0) {}
  void insert(size_t c) {
    low_[c >> 6] |= 1ull << (c & 63);
    high_[c >> 12] |= 1ull << ((c >> 6) & 63);
  }
  void erase(size_t c) {
    uint64_t& word = low_[c >> 6];
    word &= ~(1ull << (c & 63));
    if (word == 0) high_[c >> 12] &= ~(1ull << ((c >> 6) & 63));
  }
  // The smallest member >= x, or SIZE_MAX.
  size_t find_at_least(size_t x) const {
    size_t w = x >> 6;
    if (w >= low_.size()) return SIZE_MAX;
    uint64_t m = low_[w] & (~0ull << (x & 63));
    if (m) return (w << 6) + __builtin_ctzll(m);
    ++w;  // the next non-empty word at or after w
    size_t h = w >> 6;
    if (h >= high_.size()) return SIZE_MAX;
    uint64_t hm = (w & 63) ? (high_[h] & (~0ull << (w & 63))) : high_[h];
    while (!hm) {
      if (++h >= high_.size()) return SIZE_MAX;
      hm = high_[h];
    }
    const size_t word = (h << 6) + __builtin_ctzll(hm);
    return (word << 6) + __builtin_ctzll(low_[word]);
  }

 private:
  std::vector<uint64_t> low_, high_;
};

}  // namespace

Overflow parse_overflow(const std::string& name) {
  if (name == "truncate") return Overflow::kTruncate;
  if (name == "split") return Overflow::kSplit;
  if (name == "drop") return Overflow::kDrop;
  if (name == "error") return Overflow::kError;
  throw PackingError("unknown overflow '" + name + "': expected truncate, split, drop or error");
}

double PackStats::fill() const {
  return rows == 0 ? 0.0 : static_cast<double>(tokens) / (static_cast<double>(rows) * static_cast<double>(seq_length));
}

std::vector<uint64_t> shard_indices(size_t count, const PackOptions& options) {
  if (options.world_size < 1) throw PackingError("world_size must be at least 1");
  if (options.rank < 0 || options.rank >= options.world_size) {
    throw PackingError("rank " + std::to_string(options.rank) + " is outside [0, world_size=" +
                       std::to_string(options.world_size) + ")");
  }
  std::vector<uint64_t> all(count);
  for (size_t i = 0; i < count; ++i) all[i] = i;
  if (options.shuffle) {
    // The same permutation on every rank: it depends on (seed, epoch) only.
    Rng rng(mix(options.seed, options.epoch));
    shuffle(all, rng);
  }
  const size_t ws = static_cast<size_t>(options.world_size);
  std::vector<uint64_t> shard;
  shard.reserve(count / ws + 1);
  for (size_t i = static_cast<size_t>(options.rank); i < count; i += ws) shard.push_back(all[i]);
  return shard;
}

Balance parse_balance(const std::string& name) {
  if (name == "repeat") return Balance::kRepeat;
  if (name == "drop") return Balance::kDrop;
  if (name == "none") return Balance::kNone;
  throw PackingError("unknown balance '" + name + "': expected repeat, drop or none");
}

InMemorySequences::InMemorySequences(const int32_t* tokens, const int32_t* labels, const int64_t* offsets,
                                     size_t count) {
  if (offsets == nullptr && count > 0) throw PackingError("offsets is null");
  if (count > 0 && offsets[0] != 0) throw PackingError("offsets[0] must be 0");
  for (size_t i = 0; i < count; ++i) {
    if (offsets[i + 1] < offsets[i]) {
      throw PackingError("offsets must not decrease: offsets[" + std::to_string(i + 1) + "] = " +
                         std::to_string(offsets[i + 1]) + " < offsets[" + std::to_string(i) +
                         "] = " + std::to_string(offsets[i]));
    }
  }
  const size_t total = count > 0 ? static_cast<size_t>(offsets[count]) : 0;
  tokens_.assign(tokens, tokens + total);
  if (labels != nullptr) labels_.assign(labels, labels + total);
  if (count == 0) {
    offsets_.assign(1, 0);
  } else {
    offsets_.assign(offsets, offsets + count + 1);
  }
}

void InMemorySequences::read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const {
  const size_t at = static_cast<size_t>(offsets_[sequence]) + start;
  const int32_t* t = tokens_.data() + at;
  const int32_t* l = (labels_.empty() ? tokens_.data() : labels_.data()) + at;
  for (size_t j = 0; j < count; ++j) {
    ids[j] = t[j];
    labels[j] = l[j];
  }
}

SubsetSequences::SubsetSequences(std::shared_ptr<const SequenceSource> source, std::vector<uint64_t> indices)
    : source_(std::move(source)), indices_(std::move(indices)) {
  if (!source_) throw PackingError("the sequence source is null");
  const size_t count = source_->size();
  for (const uint64_t i : indices_) {
    if (i >= count) {
      throw PackingError("subset index " + std::to_string(i) + " is out of range for a source of " +
                         std::to_string(count) + " sequences");
    }
    tokens_ += source_->length(i);
  }
}

Packer::Packer(const int32_t* tokens, const int32_t* labels, const int64_t* offsets, size_t count,
               const PackOptions& options)
    : Packer(std::make_shared<InMemorySequences>(tokens, labels, offsets, count), options) {}

Packer::Packer(std::shared_ptr<const SequenceSource> source, const PackOptions& options)
    : source_(std::move(source)), options_(options) {
  if (!source_) throw PackingError("the sequence source is null");
  if (options.seq_length < 1 || options.seq_length > std::numeric_limits<int32_t>::max()) {
    throw PackingError("seq_length must be in [1, 2^31), got " + std::to_string(options.seq_length));
  }
  Plan own = plan(*source_, options_);
  pieces_ = std::move(own.pieces);
  row_offsets_ = std::move(own.row_offsets);
  stats_ = own.stats;
  if (options_.world_size > 1 && options_.balance != Balance::kNone) balance_ranks();
}

void Packer::balance_ranks() {
  // Every rank plans every shard, so all agree on the counts without talking to each other.
  size_t target = num_rows();
  for (int64_t r = 0; r < options_.world_size; ++r) {
    if (r == options_.rank) continue;
    PackOptions other = options_;
    other.rank = r;
    const size_t rows = plan(*source_, other).stats.rows;
    target = options_.balance == Balance::kRepeat ? std::max(target, rows) : std::min(target, rows);
  }
  const size_t own = num_rows();
  auto row_tokens = [&](size_t r) {
    size_t n = 0;
    for (const Piece* p = row_begin(r); p != row_end(r); ++p) n += p->length;
    return n;
  };
  if (target < own) {
    for (size_t r = target; r < own; ++r) stats_.tokens -= row_tokens(r);
    pieces_.resize(row_offsets_[target]);
    row_offsets_.resize(target + 1);
    stats_.dropped_rows = own - target;
  } else if (target > own) {
    if (own == 0) {
      throw PackingError("rank " + std::to_string(options_.rank) + " has no rows to repeat while another rank has " +
                         std::to_string(target) + ": the dataset has fewer sequences than ranks (balance='drop' "
                         "gives every rank the shortest count)");
    }
    for (size_t k = 0; own + k < target; ++k) {
      const size_t r = k % own;
      stats_.tokens += row_tokens(r);
      for (size_t i = row_offsets_[r]; i < row_offsets_[r + 1]; ++i) pieces_.push_back(pieces_[i]);
      row_offsets_.push_back(pieces_.size());
    }
    stats_.repeated_rows = target - own;
  }
  stats_.rows = num_rows();
}

Packer::Plan Packer::plan(const SequenceSource& source, const PackOptions& options) {
  const size_t L = static_cast<size_t>(options.seq_length);
  const std::vector<uint64_t> shard = shard_indices(source.size(), options);
  Plan out;
  PackStats& stats = out.stats;
  std::vector<Piece>& pieces = out.pieces;
  std::vector<size_t>& row_offsets = out.row_offsets;
  stats.seq_length = options.seq_length;
  stats.sequences = shard.size();
  row_offsets.assign(1, 0);

  const size_t window = options.shuffle_window == 0 ? std::max<size_t>(shard.size(), 1) : options.shuffle_window;
  std::vector<Piece> items;
  std::vector<uint32_t> bucket(L + 2);
  std::vector<uint32_t> order;        // items by decreasing length
  std::vector<uint32_t> bin_of;       // item -> bin
  std::vector<uint32_t> remaining;    // bin -> free tokens
  std::vector<uint32_t> next_in_set;  // bin -> next bin with the same remaining room
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  std::vector<uint32_t> head(L + 1, kNone);  // remaining room -> last bin put there (kNone: none)
  CapacitySet open(L + 1);

  for (size_t w0 = 0, window_index = 0; w0 < shard.size(); w0 += window, ++window_index) {
    const size_t w1 = std::min(shard.size(), w0 + window);
    items.clear();
    for (size_t k = w0; k < w1; ++k) {
      const uint64_t s = shard[k];
      const size_t len = source.length(s);
      if (len == 0) {
        ++stats.empty_sequences;
        continue;
      }
      if (len <= L) {
        items.push_back({s, 0, static_cast<uint32_t>(len)});
        continue;
      }
      switch (options.overflow) {
        case Overflow::kTruncate:
          ++stats.truncated_sequences;
          stats.truncated_tokens += len - L;
          items.push_back({s, 0, static_cast<uint32_t>(L)});
          break;
        case Overflow::kSplit:
          ++stats.split_sequences;
          for (size_t start = 0; start < len; start += L) {
            items.push_back({s, static_cast<uint32_t>(start), static_cast<uint32_t>(std::min(L, len - start))});
          }
          break;
        case Overflow::kDrop:
          ++stats.dropped_sequences;
          break;
        case Overflow::kError:
          throw PackingError("sequence " + std::to_string(s) + " has " + std::to_string(len) +
                             " tokens, more than seq_length " + std::to_string(L) +
                             " (overflow='error'; use 'truncate', 'split' or 'drop')");
      }
    }
    if (items.empty()) continue;
    if (items.size() >= kNone) throw PackingError("shuffle_window holds too many pieces");

    // Counting sort by decreasing length; equal lengths keep their window order.
    std::fill(bucket.begin(), bucket.end(), 0);
    for (const Piece& p : items) ++bucket[L - p.length];
    uint32_t sum = 0;
    for (size_t i = 0; i <= L; ++i) {
      const uint32_t c = bucket[i];
      bucket[i] = sum;
      sum += c;
    }
    order.resize(items.size());
    for (uint32_t i = 0; i < items.size(); ++i) order[bucket[L - items[i].length]++] = i;

    // Best fit: each piece goes to the open row with the least room that still fits it.
    remaining.clear();
    next_in_set.clear();
    bin_of.resize(items.size());
    for (const uint32_t i : order) {
      const size_t len = items[i].length;
      const size_t c = open.find_at_least(len);
      uint32_t bin;
      if (c == SIZE_MAX) {
        bin = static_cast<uint32_t>(remaining.size());
        remaining.push_back(static_cast<uint32_t>(L));
        next_in_set.push_back(kNone);
      } else {
        bin = head[c];
        head[c] = next_in_set[bin];
        if (head[c] == kNone) open.erase(c);
      }
      bin_of[i] = bin;
      const uint32_t room = remaining[bin] - static_cast<uint32_t>(len);
      remaining[bin] = room;
      if (room > 0) {
        if (head[room] == kNone) open.insert(room);
        next_in_set[bin] = head[room];
        head[room] = bin;
      }
    }
    // Close every row the window left open.
    for (size_t c = open.find_at_least(1); c != SIZE_MAX; c = open.find_at_least(c + 1)) {
      open.erase(c);
      head[c] = kNone;
    }

    // Rows in a random order (a pure function of seed, epoch, rank and window).
    const size_t bins = remaining.size();
    std::vector<uint32_t> row_of_bin(bins);
    for (uint32_t b = 0; b < bins; ++b) row_of_bin[b] = b;
    if (options.shuffle) {
      Rng rng(mix(mix(mix(options.seed, options.epoch), static_cast<uint64_t>(options.rank)), window_index + 1));
      shuffle(row_of_bin, rng);
    }
    std::vector<uint32_t> bin_rank(bins);
    for (uint32_t r = 0; r < bins; ++r) bin_rank[row_of_bin[r]] = r;

    // Pieces grouped by row, in the order they were placed.
    std::vector<size_t> start(bins + 1, 0);
    for (uint32_t i = 0; i < items.size(); ++i) ++start[bin_rank[bin_of[i]] + 1];
    for (size_t r = 0; r < bins; ++r) start[r + 1] += start[r];
    const size_t base = pieces.size();
    pieces.resize(base + items.size());
    for (const uint32_t i : order) pieces[base + start[bin_rank[bin_of[i]]]++] = items[i];
    for (size_t r = 0; r < bins; ++r) row_offsets.push_back(base + start[r]);
    for (const Piece& p : items) stats.tokens += p.length;
    stats.pieces += items.size();
  }
  stats.rows = row_offsets.size() - 1;
  return out;
}

CollateInfo Packer::collate(size_t first_row, size_t last_row, const RowBuffers& out) const {
  if (first_row > last_row || last_row > num_rows()) {
    throw PackingError("rows [" + std::to_string(first_row) + ", " + std::to_string(last_row) +
                       ") are outside [0, " + std::to_string(num_rows()) + ")");
  }
  const int64_t L = options_.seq_length;
  if (static_cast<uint64_t>(last_row - first_row) * static_cast<uint64_t>(L) >
      static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    throw PackingError("a batch of more than 2^31 tokens does not fit int32 cu_seqlens");
  }
  CollateInfo info;
  info.cu_seqlens.reserve((last_row - first_row) * 8 + 1);
  info.cu_seqlens.push_back(0);
  int64_t* ids = out.input_ids;
  int64_t* labels = out.labels;
  int64_t* pos = out.position_ids;
  int32_t at = 0;
  for (size_t r = first_row; r < last_row; ++r) {
    int64_t used = 0;
    for (const Piece* p = row_begin(r); p != row_end(r); ++p) {
      const uint32_t n = p->length;
      source_->read(p->sequence, p->start, n, ids, labels);
      for (uint32_t j = 0; j < n; ++j) pos[j] = j;
      labels[0] = options_.separator_id;
      ids += n;
      labels += n;
      pos += n;
      used += n;
      at += static_cast<int32_t>(n);
      info.cu_seqlens.push_back(at);
      info.max_seqlen = std::max<int64_t>(info.max_seqlen, n);
      ++info.sequences;
    }
    const int64_t pad = L - used;
    for (int64_t j = 0; j < pad; ++j) {
      ids[j] = options_.pad_id;
      labels[j] = options_.ignore_index;
      pos[j] = j;
    }
    if (pad > 0) {
      ids += pad;
      labels += pad;
      pos += pad;
      at += static_cast<int32_t>(pad);
      info.cu_seqlens.push_back(at);
      info.max_seqlen = std::max<int64_t>(info.max_seqlen, pad);
    }
  }
  return info;
}

}  // namespace barqtrain::data
