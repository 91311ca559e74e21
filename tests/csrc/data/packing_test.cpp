#include "data/packing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace barqtrain::data {
namespace {

// Sequences whose tokens name where they come from: token j of sequence s is s * 100000 + j.
struct Corpus {
  std::vector<int32_t> tokens, labels;
  std::vector<int64_t> offsets{0};
  explicit Corpus(const std::vector<size_t>& lengths) {
    for (size_t s = 0; s < lengths.size(); ++s) {
      for (size_t j = 0; j < lengths[s]; ++j) {
        tokens.push_back(static_cast<int32_t>(s * 100000 + j));
        labels.push_back(j % 3 == 0 ? -100 : static_cast<int32_t>(s * 100000 + j));
      }
      offsets.push_back(static_cast<int64_t>(tokens.size()));
    }
  }
  size_t size() const { return offsets.size() - 1; }
  Packer pack(const PackOptions& options, bool with_labels = true) const {
    return Packer(tokens.data(), with_labels ? labels.data() : nullptr, offsets.data(), size(), options);
  }
};

struct Rows {
  std::vector<int64_t> ids, labels, pos;
  CollateInfo info;
};

Rows collate_all(const Packer& packer) {
  Rows rows;
  const size_t n = packer.num_rows() * packer.options().seq_length;
  rows.ids.assign(n, -7);
  rows.labels.assign(n, -7);
  rows.pos.assign(n, -7);
  rows.info = packer.collate(0, packer.num_rows(), {rows.ids.data(), rows.labels.data(), rows.pos.data()});
  return rows;
}

std::vector<size_t> realistic_lengths(size_t n, uint64_t seed) {
  // Log-normal, median ~ 200 tokens, a long tail: instruction-tuning data looks like this.
  std::mt19937_64 gen(seed);
  std::lognormal_distribution<double> dist(5.3, 0.8);
  std::vector<size_t> lengths(n);
  for (auto& l : lengths) l = std::clamp<size_t>(static_cast<size_t>(dist(gen)), 1, 8000);
  return lengths;
}

TEST(Packing, BestFitDecreasingFillsRowsExactly) {
  PackOptions options;
  options.seq_length = 10;
  options.shuffle = false;
  const Corpus corpus({2, 6, 3, 5, 4});
  const Packer packer = corpus.pack(options);
  ASSERT_EQ(packer.num_rows(), 2u);
  // 6 opens row 0, 5 opens row 1, 4 fits row 0 exactly, 3 and 2 fill row 1.
  std::vector<std::vector<uint64_t>> rows;
  for (size_t r = 0; r < 2; ++r) {
    rows.emplace_back();
    for (const Piece* p = packer.row_begin(r); p != packer.row_end(r); ++p) rows.back().push_back(p->sequence);
  }
  EXPECT_EQ(rows[0], (std::vector<uint64_t>{1, 4}));
  EXPECT_EQ(rows[1], (std::vector<uint64_t>{3, 2, 0}));
  EXPECT_DOUBLE_EQ(packer.stats().fill(), 1.0);
}

TEST(Packing, RowsHaveTheFlatteningCollatorFormat) {
  PackOptions options;
  options.seq_length = 8;
  options.shuffle = false;
  options.pad_id = 5;
  const Corpus corpus({3, 2});
  const Packer packer = corpus.pack(options);
  const Rows rows = collate_all(packer);
  ASSERT_EQ(packer.num_rows(), 1u);
  EXPECT_EQ(rows.ids, (std::vector<int64_t>{0, 1, 2, 100000, 100001, 5, 5, 5}));
  // The first label of every sequence is -100; others are the given labels; padding -100.
  EXPECT_EQ(rows.labels, (std::vector<int64_t>{-100, 1, 2, -100, 100001, -100, -100, -100}));
  EXPECT_EQ(rows.pos, (std::vector<int64_t>{0, 1, 2, 0, 1, 0, 1, 2}));
  EXPECT_EQ(rows.info.cu_seqlens, (std::vector<int32_t>{0, 3, 5, 8}));
  EXPECT_EQ(rows.info.max_seqlen, 3);
  EXPECT_EQ(rows.info.sequences, 2u);
}

TEST(Packing, WithoutLabelsTheTokensAreTheLabels) {
  PackOptions options;
  options.seq_length = 4;
  options.shuffle = false;
  const Corpus corpus({4});
  const Rows rows = collate_all(corpus.pack(options, /*with_labels=*/false));
  EXPECT_EQ(rows.labels, (std::vector<int64_t>{-100, 1, 2, 3}));
}

TEST(Packing, EveryTokenLandsOnceWithPositionsAndBoundariesThatAgree) {
  const auto lengths = realistic_lengths(20000, 1);
  const Corpus corpus(lengths);
  PackOptions options;
  options.seq_length = 2048;
  options.seed = 3;
  options.shuffle_window = 4096;
  options.pad_id = -1;
  const Packer packer = corpus.pack(options);
  const Rows rows = collate_all(packer);
  std::vector<size_t> seen(corpus.size(), 0);
  std::set<int64_t> covered;
  size_t segment = 0;
  const auto& cu = rows.info.cu_seqlens;
  for (size_t k = 0; k + 1 < cu.size(); ++k) {
    const int32_t a = cu[k], b = cu[k + 1];
    ASSERT_LT(a, b);
    ASSERT_EQ(a / options.seq_length, (b - 1) / options.seq_length) << "a segment crosses a row";
    const bool padding = rows.ids[a] == -1;
    if (padding) ASSERT_EQ(b % options.seq_length, 0) << "padding only at the end of a row";
    const int64_t s = rows.ids[a] / 100000;
    for (int32_t t = a; t < b; ++t) {
      ASSERT_EQ(rows.pos[t], t - a);
      if (padding) {
        ASSERT_EQ(rows.ids[t], -1);
        ASSERT_EQ(rows.labels[t], -100);
        continue;
      }
      ASSERT_EQ(rows.ids[t] / 100000, s);
      ASSERT_TRUE(covered.insert(rows.ids[t]).second) << "token " << rows.ids[t] << " placed twice";
      const int64_t j = rows.ids[t] % 100000;
      if (t == a) {
        ASSERT_EQ(rows.labels[t], -100);
      } else {
        ASSERT_EQ(rows.labels[t], j % 3 == 0 ? -100 : rows.ids[t]);
      }
    }
    if (!padding) {
      seen[s] += b - a;  // each piece holds distinct tokens: together they must be all of them
      ++segment;
    }
  }
  for (size_t s = 0; s < corpus.size(); ++s) ASSERT_EQ(seen[s], lengths[s]) << "sequence " << s;
  EXPECT_EQ(segment, packer.stats().pieces);
  EXPECT_EQ(rows.info.sequences, packer.stats().pieces);
  EXPECT_GE(packer.stats().fill(), 0.99);
}

TEST(Packing, IsDeterministicAndChangesWithTheEpoch) {
  const Corpus corpus(realistic_lengths(3000, 2));
  PackOptions options;
  options.seq_length = 1024;
  options.seed = 11;
  const Rows a = collate_all(corpus.pack(options));
  const Rows b = collate_all(corpus.pack(options));
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(a.info.cu_seqlens, b.info.cu_seqlens);
  options.epoch = 1;
  EXPECT_NE(collate_all(corpus.pack(options)).ids, a.ids);
  options.epoch = 0;
  options.seed = 12;
  EXPECT_NE(collate_all(corpus.pack(options)).ids, a.ids);
}

TEST(Packing, RanksGetDisjointShardsCoveringTheData) {
  const Corpus corpus(realistic_lengths(1001, 3));
  PackOptions options;
  options.seq_length = 1024;
  options.seed = 5;
  options.epoch = 2;
  options.world_size = 4;
  std::multiset<uint64_t> all;
  for (int64_t rank = 0; rank < 4; ++rank) {
    options.rank = rank;
    const auto shard = shard_indices(corpus.size(), options);
    EXPECT_NEAR(static_cast<double>(shard.size()), 1001 / 4.0, 1.0);
    const Packer packer = corpus.pack(options);
    std::set<uint64_t> packed;
    for (size_t r = 0; r < packer.num_rows(); ++r) {
      for (const Piece* p = packer.row_begin(r); p != packer.row_end(r); ++p) packed.insert(p->sequence);
    }
    EXPECT_EQ(packed, std::set<uint64_t>(shard.begin(), shard.end()));
    all.insert(packed.begin(), packed.end());
  }
  ASSERT_EQ(all.size(), corpus.size());
  EXPECT_EQ(std::set<uint64_t>(all.begin(), all.end()).size(), corpus.size());
  options.rank = 4;
  EXPECT_THROW(shard_indices(10, options), PackingError);
}

TEST(Packing, LongSequencesAreTruncatedSplitDroppedOrRejected) {
  const Corpus corpus({10, 25, 4});
  PackOptions options;
  options.seq_length = 10;
  options.shuffle = false;

  options.overflow = Overflow::kSplit;
  Packer split = corpus.pack(options);
  EXPECT_EQ(split.stats().split_sequences, 1u);
  EXPECT_EQ(split.stats().pieces, 5u);  // 10, 10 + 10 + 5, 4
  EXPECT_EQ(split.stats().tokens, 39u);
  const Rows rows = collate_all(split);
  // Each piece of the split sequence starts at position 0 with label -100.
  std::vector<int64_t> starts;
  for (size_t k = 0; k + 1 < rows.info.cu_seqlens.size(); ++k) {
    const int32_t a = rows.info.cu_seqlens[k];
    EXPECT_EQ(rows.pos[a], 0);
    EXPECT_EQ(rows.labels[a], -100);
    if (rows.ids[a] / 100000 == 1) starts.push_back(rows.ids[a] % 100000);
  }
  std::sort(starts.begin(), starts.end());
  EXPECT_EQ(starts, (std::vector<int64_t>{0, 10, 20}));

  options.overflow = Overflow::kTruncate;
  Packer truncated = corpus.pack(options);
  EXPECT_EQ(truncated.stats().truncated_sequences, 1u);
  EXPECT_EQ(truncated.stats().truncated_tokens, 15u);
  EXPECT_EQ(truncated.stats().tokens, 24u);

  options.overflow = Overflow::kDrop;
  Packer dropped = corpus.pack(options);
  EXPECT_EQ(dropped.stats().dropped_sequences, 1u);
  EXPECT_EQ(dropped.stats().tokens, 14u);

  options.overflow = Overflow::kError;
  try {
    corpus.pack(options);
    FAIL() << "expected a PackingError";
  } catch (const PackingError& error) {
    EXPECT_NE(std::string(error.what()).find("sequence 1 has 25 tokens, more than seq_length 10"), std::string::npos);
  }
  EXPECT_EQ(parse_overflow("split"), Overflow::kSplit);
  EXPECT_THROW(parse_overflow("wrap"), PackingError);
}

TEST(Packing, EmptySequencesAndEmptyInputs) {
  PackOptions options;
  options.seq_length = 8;
  const Corpus corpus({0, 3, 0});
  const Packer packer = corpus.pack(options);
  EXPECT_EQ(packer.stats().empty_sequences, 2u);
  EXPECT_EQ(packer.num_rows(), 1u);
  const Corpus none({});
  EXPECT_EQ(none.pack(options).num_rows(), 0u);
  EXPECT_EQ(none.pack(options).stats().fill(), 0.0);
}

TEST(Packing, BadArgumentsAreErrors) {
  const Corpus corpus({3});
  PackOptions options;
  options.seq_length = 0;
  EXPECT_THROW(corpus.pack(options), PackingError);
  options.seq_length = 4;
  const std::vector<int64_t> bad{0, 3, 2};
  const std::vector<int32_t> tokens{1, 2, 3};
  EXPECT_THROW(Packer(tokens.data(), nullptr, bad.data(), 2, options), PackingError);
  const Packer packer = corpus.pack(options);
  std::vector<int64_t> buf(8);
  EXPECT_THROW(packer.collate(0, 2, {buf.data(), buf.data(), buf.data()}), PackingError);
}

TEST(Packing, ASubsetReadsTheChosenSequencesInItsOrder) {
  const Corpus corpus({4, 1, 6, 2});
  auto all = std::make_shared<InMemorySequences>(corpus.tokens.data(), corpus.labels.data(), corpus.offsets.data(),
                                                 corpus.size());
  const SubsetSequences subset(all, {3, 0, 2});
  ASSERT_EQ(subset.size(), 3u);
  EXPECT_EQ(subset.num_tokens(), 2u + 4u + 6u);
  const std::vector<size_t> chosen{3, 0, 2};
  for (size_t i = 0; i < chosen.size(); ++i) {
    const size_t n = subset.length(i);
    ASSERT_EQ(n, all->length(chosen[i]));
    std::vector<int64_t> ids(n), labels(n), want_ids(n), want_labels(n);
    subset.read(i, 0, n, ids.data(), labels.data());
    all->read(chosen[i], 0, n, want_ids.data(), want_labels.data());
    EXPECT_EQ(ids, want_ids);
    EXPECT_EQ(labels, want_labels);
  }
  EXPECT_THROW(SubsetSequences(all, {4}), PackingError);
  EXPECT_THROW(SubsetSequences(nullptr, {}), PackingError);
}

TEST(Packing, ARealisticDistributionFillsAtLeast99Percent) {
  const Corpus corpus(realistic_lengths(100000, 4));
  for (const int64_t seq_length : {2048, 4096, 8192}) {
    PackOptions options;
    options.seq_length = seq_length;
    options.shuffle_window = 16384;
    const Packer packer = corpus.pack(options);
    EXPECT_GE(packer.stats().fill(), 0.99) << "seq_length " << seq_length;
  }
}

}  // namespace
}  // namespace barqtrain::data
