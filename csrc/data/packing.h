// Packing: tokenized sequences into rows of a fixed length, with no token able to see
// another sequence.
//
//   PackOptions options;  options.row_length = 4096;  options.seed = 1;  options.epoch = e;
//   Packer packer(tokens, labels, offsets, options);   // sequence i: tokens[offsets[i]..offsets[i+1])
//   packer.collate(first_row, last_row, out);           // rows [first_row, last_row) into out
//
// Each rank shuffles the sequence indices with the same (seed, epoch) permutation and takes
// every world_size-th of them starting at rank, so ranks hold disjoint shards. The shard is
// cut into windows of shuffle_window sequences; each window is packed by best-fit decreasing
// (longest first into the open row with the least room that still fits it), and its rows
// are shuffled. Everything is a pure function of (data, options): the same options give the
// same rows on any machine.
//
// A collated row has the format of Transformers' DataCollatorWithFlattening:
//   input_ids     the sequences one after another, then pad_id up to row_length
//   labels        the sequence's labels (its tokens when none are given), except the first
//                 token of every sequence, which is separator_id (-100): the model's shifted
//                 loss never asks the previous sequence's last token to predict it
//   position_ids  0, 1, ... restarting at every sequence; the padding is a segment of its own
//   cu_seqlens    segment boundaries over the flattened batch (padding included as a segment)
//   max_seqlen    the longest segment
#pragma once

#include <cstddef>
#include <cstdint>
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
  kTruncate,  // keep its first row_length tokens
  kSplit,     // cut it into row_length pieces, each packed as a sequence of its own
  kDrop,      // leave it out (counted in PackStats::dropped_sequences)
  kError,     // a PackingError naming the sequence
};

Overflow parse_overflow(const std::string& name);  // "truncate", "split", "drop", "error"

struct PackOptions {
  int64_t row_length = 2048;
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
};

struct PackStats {
  size_t sequences = 0;            // sequences in this rank's shard
  size_t empty_sequences = 0;      // of those, empty ones (left out)
  size_t truncated_sequences = 0;  // cut to row_length (Overflow::kTruncate)
  size_t truncated_tokens = 0;
  size_t split_sequences = 0;  // cut into pieces (Overflow::kSplit)
  size_t dropped_sequences = 0;  // left out (Overflow::kDrop)
  size_t pieces = 0;             // segments placed in rows
  size_t rows = 0;
  size_t tokens = 0;  // real (non-padding) tokens in the rows
  int64_t row_length = 0;
  double fill() const;  // tokens / (rows * row_length)
};

// One segment of a row: tokens [start, start + length) of sequence `sequence`.
struct Piece {
  uint64_t sequence;
  uint32_t start;
  uint32_t length;
};

// Where collate() writes; each buffer holds (last_row - first_row) * row_length values.
struct RowBuffers {
  int64_t* input_ids;
  int64_t* labels;
  int64_t* position_ids;
};

struct CollateInfo {
  std::vector<int32_t> cu_seqlens;  // over the flattened rows, from 0 to rows * row_length
  int64_t max_seqlen = 0;
  size_t sequences = 0;  // real (non-padding) segments
};

class Packer {
 public:
  // tokens and labels (nullptr: labels are the tokens) hold offsets[count] values; the data
  // is copied, so the arguments need not outlive the Packer.
  Packer(const int32_t* tokens, const int32_t* labels, const int64_t* offsets, size_t count,
         const PackOptions& options);

  size_t num_rows() const { return row_offsets_.size() - 1; }
  const PackStats& stats() const { return stats_; }
  const PackOptions& options() const { return options_; }

  // The segments of row r, in order.
  const Piece* row_begin(size_t r) const { return pieces_.data() + row_offsets_[r]; }
  const Piece* row_end(size_t r) const { return pieces_.data() + row_offsets_[r + 1]; }

  // Writes rows [first_row, last_row) into out and returns their cu_seqlens.
  CollateInfo collate(size_t first_row, size_t last_row, const RowBuffers& out) const;

 private:
  void plan(const int64_t* offsets, size_t count);

  PackOptions options_;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> labels_;  // empty: the tokens
  std::vector<int64_t> offsets_;
  std::vector<Piece> pieces_;        // rows one after another
  std::vector<size_t> row_offsets_;  // row r holds pieces_[row_offsets_[r], row_offsets_[r+1])
  PackStats stats_;
};

// The rank's shard: the sequence indices it packs, in order (exposed for tests).
std::vector<uint64_t> shard_indices(size_t count, const PackOptions& options);

}  // namespace barqtrain::data
