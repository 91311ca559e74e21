// Packing: tokenized sequences into rows of a fixed length, with no token able to see
// another sequence.
//
//   PackOptions options;  options.seq_length = 4096;  options.seed = 1;  options.epoch = e;
//   auto source = std::make_shared<InMemorySequences>(tokens, labels, offsets, count);
//   Packer packer(source, options);                     // or a ShardSet (data/shards.h)
//   packer.collate(first_row, last_row, out);           // rows [first_row, last_row) into out
//
// The Packer reads its sequences through a SequenceSource and keeps only the plan (a
// 16-byte Piece per segment), so a memory-mapped source larger than RAM packs in place.
//
// Each rank shuffles the sequence indices with the same (seed, epoch) permutation and takes
// every world_size-th of them starting at rank, so ranks hold disjoint shards. The shard is
// cut into windows of shuffle_window sequences; each window is packed by best-fit decreasing
// (longest first into the open row with the least room that still fits it), and its rows
// are shuffled. Everything is a pure function of (data, options): the same options give the
// same rows on any machine.
//
// Ranks must take the same number of steps (a collective waits for every rank), but their
// shards pack into slightly different row counts. PackOptions::balance says what happens:
// kRepeat (default) appends the rank's first rows again up to the longest rank's count, as
// torch's DistributedSampler pads; kDrop cuts every rank to the shortest rank's count; both
// are counted in PackStats. Either way each rank plans every rank's shard to learn the counts.
//
// A collated row has the format of Transformers' DataCollatorWithFlattening:
//   input_ids     the sequences one after another, then pad_id up to seq_length
//   labels        the sequence's labels (its tokens when none are given), except the first
//                 token of every sequence, which is separator_id (-100): the model's shifted
//                 loss never asks the previous sequence's last token to predict it
//   position_ids  0, 1, ... restarting at every sequence; the padding is a segment of its own
//   cu_seqlens    segment boundaries over the flattened batch (padding included as a segment)
//   max_seqlen    the longest segment
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace barqtrain::data {

class PackingError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What happens to a sequence longer than a row.
enum class Overflow {
  kTruncate,  // keep its first seq_length tokens
  kSplit,     // cut it into seq_length pieces, each packed as a sequence of its own
  kDrop,      // leave it out (counted in PackStats::dropped_sequences)
  kError,     // a PackingError naming the sequence
};

Overflow parse_overflow(const std::string& name);  // "truncate", "split", "drop", "error"

// How ranks are brought to the same number of rows (see the file comment).
enum class Balance {
  kRepeat,  // repeat a rank's first rows up to the longest rank's count
  kDrop,    // leave out the rows past the shortest rank's count
  kNone,    // keep each rank's own count (only for loops without collectives across ranks)
};

Balance parse_balance(const std::string& name);  // "repeat", "drop", "none"

struct PackOptions {
  int64_t seq_length = 2048;
  Overflow overflow = Overflow::kSplit;
  size_t shuffle_window = 16384;  // sequences packed together; 0: the whole shard
  bool shuffle = true;            // false: shard and window in input order, rows in packing order
  uint64_t seed = 0;
  uint64_t epoch = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t pad_id = 0;
  int64_t separator_id = -100;  // label of the first token of every sequence
  int64_t ignore_index = -100;  // label of the padding
  Balance balance = Balance::kRepeat;  // with world_size > 1
};

struct PackStats {
  size_t sequences = 0;            // sequences in this rank's shard
  size_t empty_sequences = 0;      // of those, empty ones (left out)
  size_t truncated_sequences = 0;  // cut to seq_length (Overflow::kTruncate)
  size_t truncated_tokens = 0;
  size_t split_sequences = 0;  // cut into pieces (Overflow::kSplit)
  size_t dropped_sequences = 0;  // left out (Overflow::kDrop)
  size_t pieces = 0;             // segments placed in rows
  size_t rows = 0;
  size_t tokens = 0;  // real (non-padding) tokens in the rows
  size_t repeated_rows = 0;  // appended to match the longest rank (Balance::kRepeat)
  size_t dropped_rows = 0;   // left out to match the shortest rank (Balance::kDrop)
  int64_t seq_length = 0;
  double fill() const;  // tokens / (rows * seq_length)
};

// One segment of a row: tokens [start, start + length) of sequence `sequence`.
struct Piece {
  uint64_t sequence;
  uint32_t start;
  uint32_t length;
};

// Where collate() writes; each buffer holds (last_row - first_row) * seq_length values.
struct RowBuffers {
  int64_t* input_ids;
  int64_t* labels;
  int64_t* position_ids;
};

struct CollateInfo {
  std::vector<int32_t> cu_seqlens;  // over the flattened rows, from 0 to rows * seq_length
  int64_t max_seqlen = 0;
  size_t sequences = 0;  // real (non-padding) segments
};

// Where the Packer reads sequences from. Implementations are immutable once built and
// read() may be called from several threads at once (the prefetch workers).
class SequenceSource {
 public:
  virtual ~SequenceSource() = default;
  virtual size_t size() const = 0;  // sequences
  virtual size_t num_tokens() const = 0;
  virtual size_t length(size_t sequence) const = 0;
  // Tokens [start, start + count) of a sequence as ids, and their labels (-100: not learned).
  virtual void read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const = 0;
};

// Sequences held in memory: sequence i is tokens[offsets[i], offsets[i + 1]).
class InMemorySequences final : public SequenceSource {
 public:
  // tokens and labels (nullptr: labels are the tokens) hold offsets[count] values; they are
  // copied, so the arguments need not outlive this object. Bad offsets are a PackingError.
  InMemorySequences(const int32_t* tokens, const int32_t* labels, const int64_t* offsets, size_t count);

  size_t size() const override { return offsets_.size() - 1; }
  size_t num_tokens() const override { return tokens_.size(); }
  size_t length(size_t s) const override { return static_cast<size_t>(offsets_[s + 1] - offsets_[s]); }
  void read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const override;

 private:
  std::vector<int32_t> tokens_;
  std::vector<int32_t> labels_;  // empty: the tokens
  std::vector<int64_t> offsets_;
};

// A view of some sequences of another source, in the order given: sequence i is the
// source's sequence indices[i]. Nothing is copied but the indices, so a held-out split of
// memory-mapped shards costs 8 bytes a sequence. An index out of range is a PackingError.
class SubsetSequences final : public SequenceSource {
 public:
  SubsetSequences(std::shared_ptr<const SequenceSource> source, std::vector<uint64_t> indices);

  size_t size() const override { return indices_.size(); }
  size_t num_tokens() const override { return tokens_; }
  size_t length(size_t s) const override { return source_->length(indices_[s]); }
  void read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const override {
    source_->read(indices_[sequence], start, count, ids, labels);
  }

 private:
  std::shared_ptr<const SequenceSource> source_;
  std::vector<uint64_t> indices_;
  size_t tokens_ = 0;
};

class Packer {
 public:
  Packer(std::shared_ptr<const SequenceSource> source, const PackOptions& options);
  // The same over an InMemorySequences copy of (tokens, labels, offsets).
  Packer(const int32_t* tokens, const int32_t* labels, const int64_t* offsets, size_t count,
         const PackOptions& options);

  size_t num_rows() const { return row_offsets_.size() - 1; }
  const PackStats& stats() const { return stats_; }
  const PackOptions& options() const { return options_; }

  // The segments of row r, in order.
  const Piece* row_begin(size_t r) const { return pieces_.data() + row_offsets_[r]; }
  const Piece* row_end(size_t r) const { return pieces_.data() + row_offsets_[r + 1]; }

  const SequenceSource& source() const { return *source_; }

  // Writes rows [first_row, last_row) into out and returns their cu_seqlens. Safe to call
  // from several threads at once for different buffers.
  CollateInfo collate(size_t first_row, size_t last_row, const RowBuffers& out) const;

 private:
  struct Plan {
    std::vector<Piece> pieces;        // rows one after another
    std::vector<size_t> row_offsets;  // row r holds pieces[row_offsets[r], row_offsets[r+1])
    PackStats stats;
  };
  static Plan plan(const SequenceSource& source, const PackOptions& options);
  void balance_ranks();

  std::shared_ptr<const SequenceSource> source_;
  PackOptions options_;
  std::vector<Piece> pieces_;
  std::vector<size_t> row_offsets_;
  PackStats stats_;
};

// The rank's shard: the sequence indices it packs, in order (exposed for tests).
std::vector<uint64_t> shard_indices(size_t count, const PackOptions& options);

}  // namespace barqtrain::data
