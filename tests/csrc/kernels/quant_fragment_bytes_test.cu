// The byte logic of the Hopper dequant-GEMM's candidate variants (kernels/quant/fragment_bytes.cuh),
// checked on the host with the same functions the kernel runs (no GPU): the producer's
// re-layout and the forward's gather deliver to every consumer thread the nibbles and scales
// of wgmma's A fragments, every shared-memory access meets each bank once, and the int8
// conversion without I2F is exact for all 256 values.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "kernels/quant/fragment_bytes.cuh"

namespace barqtrain::testing {
namespace {

namespace k = barqtrain::kernels;
namespace q = barqtrain::kernels::quant;
using k::QuantGemmOp;

uint32_t byte_at(uint32_t word, int j) { return (word >> (8 * j)) & 0xFFu; }

std::mt19937 fresh_rng() { return std::mt19937(::testing::UnitTest::GetInstance()->random_seed()); }

// ---------------------------------------------------------------- permutes

TEST(FragmentBytes, BytePermMatchesPtxSelection) {
  const uint32_t a = 0x03020100u, b = 0x07060504u;  // byte i of {b:a} is i
  EXPECT_EQ(q::byte_perm(a, b, 0x3210u), a);
  EXPECT_EQ(q::byte_perm(a, b, 0x7654u), b);
  EXPECT_EQ(q::byte_perm(a, b, 0x5140u), 0x05010400u);
  EXPECT_EQ(q::byte_perm(0xAABBCCDDu, 0u, 0x4442u), 0xBBu);
}

TEST(FragmentBytes, TransposeGivesByteJOfEachWord) {
  std::mt19937 rng = fresh_rng();
  for (int trial = 0; trial < 1000; ++trial) {
    uint32_t rows[4];
    for (uint32_t& r : rows) r = rng();
    for (const bool swapped : {false, true}) {
      // A swapped caller holds each pair's rows in the other order.
      const uint32_t in[4] = {rows[swapped ? 1 : 0], rows[swapped ? 0 : 1], rows[swapped ? 3 : 2], rows[swapped ? 2 : 3]};
      uint32_t out[4];
      q::transpose_bytes(in, q::pair_selectors(swapped), out);
      for (int j = 0; j < 4; ++j) {
        for (int r = 0; r < 4; ++r) ASSERT_EQ(byte_at(out[j], r), byte_at(rows[r], j)) << "swapped " << swapped;
      }
    }
  }
}

TEST(FragmentBytes, NibbleOffsetsAreFourTimesEachNibble) {
  std::mt19937 rng = fresh_rng();
  for (int trial = 0; trial < 1000; ++trial) {
    const uint32_t word = rng();
    const q::NibbleOffsets offsets = q::nibble_offsets(word);
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(q::byte_of(offsets.high, j), 4 * (byte_at(word, j) >> 4));
      EXPECT_EQ(q::byte_of(offsets.low, j), 4 * (byte_at(word, j) & 0xFu));
    }
  }
}

// ---------------------------------------------------------------- fragments

// Where a consumer thread's fragment value sits (wgmma's A fragment of a 64 x 16 k-block: the
// thread's rows g, g + 8 are output columns c, c + 1; register i's values e at depth
// 2q + e (+ 8 for i >= 2)), and the stored nibble of W that holds it.
struct FragmentElement {
  int out_col, depth;
};
FragmentElement fragment_element(int consumer, int kb, int i, int e) {
  const int warpgroup = consumer / 128, warp = consumer % 128 / 32, group = consumer % 32 / 4, quad = consumer % 4;
  return {64 * warpgroup + 16 * warp + 2 * group + (i & 1), 16 * kb + 2 * quad + 8 * (i >> 1) + e};
}
// Forward: stored rows are W rows (output columns), 32 bytes of depth; backward: stored rows
// are depth, 64 bytes of output columns. The even element is the high nibble.
uint32_t stored_nibble(const std::vector<uint8_t>& stored, QuantGemmOp op, const FragmentElement& el) {
  const int row = op == QuantGemmOp::kForward ? el.out_col : el.depth;
  const int col = op == QuantGemmOp::kForward ? el.depth : el.out_col;
  const uint8_t byte = stored[row * (op == QuantGemmOp::kForward ? 32 : 64) + col / 2];
  return col % 2 == 0 ? byte >> 4 : byte & 0xFu;
}

// The 4 fragment words of every consumer thread, as the kernel's kRelaidBytes producer
// writes them (its 128 threads' loads, transposes and stores) and its consumers read them.
template <QuantGemmOp kOp>
std::vector<std::vector<uint32_t>> relaid_words(const std::vector<uint8_t>& stored) {
  std::vector<uint8_t> relaid(q::kRelaidStageBytes, 0);
  std::vector<int> writes(q::kRelaidStageBytes, 0);
  for (int p = 0; p < q::kRelayProducerThreads; ++p) {
    const q::RelayTask<kOp> task(p);
    uint32_t out[2][4];
    for (int kbi = 0; kbi < 2; ++kbi) {
      uint32_t in[4];
      for (int k = 0; k < 4; ++k) std::memcpy(&in[k], stored.data() + task.load_offset(kbi, k), 4);
      q::transpose_bytes(in, q::pair_selectors(task.swapped), out[kbi]);
    }
    for (int j = 0; j < 4; ++j) {
      const int offset = task.store_offset(j);
      std::memcpy(relaid.data() + offset, &out[0][j], 4);
      std::memcpy(relaid.data() + offset + 4, &out[1][j], 4);
      for (int b = 0; b < 8; ++b) ++writes[offset + b];
    }
  }
  for (int b = 0; b < q::kRelaidStageBytes; ++b) EXPECT_EQ(writes[b], 1) << "re-laid byte " << b << " written once";
  std::vector<std::vector<uint32_t>> words(q::kRelayConsumerThreads, std::vector<uint32_t>(4));
  for (int t = 0; t < q::kRelayConsumerThreads; ++t) std::memcpy(words[t].data(), relaid.data() + q::relaid_offset(t), 16);
  return words;
}

// kGatheredBytes: the forward consumer's own two W rows (as load_raw reads them) gathered.
std::vector<std::vector<uint32_t>> gathered_words(const std::vector<uint8_t>& stored) {
  std::vector<std::vector<uint32_t>> words(q::kRelayConsumerThreads, std::vector<uint32_t>(4));
  for (int t = 0; t < q::kRelayConsumerThreads; ++t) {
    const int out_col = fragment_element(t, 0, 0, 0).out_col;
    uint32_t rows[16];
    std::memcpy(rows, stored.data() + out_col * 32, sizeof(rows));
    for (int kb = 0; kb < 4; ++kb) words[t][kb] = q::gather_forward_word(rows, kb, q::gather_selector(t % 4));
  }
  return words;
}

// Every value of every consumer thread's fragments, as the kernel's fragment() takes it from
// a word (FragmentValue), is the stored nibble wgmma's fragment layout puts there.
template <QuantGemmOp kOp>
void expect_fragment_nibbles(const std::vector<uint8_t>& stored, const std::vector<std::vector<uint32_t>>& words) {
  using Value = q::FragmentValue<kOp>;
  for (int t = 0; t < q::kRelayConsumerThreads; ++t) {
    for (int kb = 0; kb < 4; ++kb) {
      const q::NibbleOffsets offsets = q::nibble_offsets(words[t][kb]);
      for (int i = 0; i < 4; ++i) {
        for (int e = 0; e < 2; ++e) {
          const uint32_t offset = Value::table_offset(offsets, i, e);
          ASSERT_EQ(offset % 4, 0u);
          ASSERT_EQ(offset / 4, stored_nibble(stored, kOp, fragment_element(t, kb, i, e)))
              << "thread " << t << " k-block " << kb << " register " << i << " value " << e;
        }
      }
    }
  }
}

std::vector<uint8_t> random_stage(std::mt19937& rng) {
  std::vector<uint8_t> stored(q::kRelaidStageBytes);
  for (uint8_t& b : stored) b = static_cast<uint8_t>(rng());
  return stored;
}

TEST(FragmentBytes, RelaidForwardWordsHoldEachThreadsFragmentNibbles) {
  std::mt19937 rng = fresh_rng();
  const std::vector<uint8_t> stored = random_stage(rng);
  expect_fragment_nibbles<QuantGemmOp::kForward>(stored, relaid_words<QuantGemmOp::kForward>(stored));
}

TEST(FragmentBytes, RelaidBackwardWordsHoldEachThreadsFragmentNibbles) {
  std::mt19937 rng = fresh_rng();
  const std::vector<uint8_t> stored = random_stage(rng);
  expect_fragment_nibbles<QuantGemmOp::kBackward>(stored, relaid_words<QuantGemmOp::kBackward>(stored));
}

TEST(FragmentBytes, GatheredForwardWordsHoldEachThreadsFragmentNibbles) {
  std::mt19937 rng = fresh_rng();
  const std::vector<uint8_t> stored = random_stage(rng);
  expect_fragment_nibbles<QuantGemmOp::kForward>(stored, gathered_words(stored));
}

// The forward producer loads a row's 16 bytes at once: its k-block words are in[k] =
// (row k % 2 as loaded, word 2 kbi + k / 2) of those 16 bytes.
TEST(FragmentBytes, RelayForwardWordsComeFromTwo16ByteLoads) {
  for (int p = 0; p < q::kRelayProducerThreads; ++p) {
    const q::RelayTask<QuantGemmOp::kForward> task(p);
    for (int kbi = 0; kbi < 2; ++kbi) {
      for (int k = 0; k < 4; ++k) {
        ASSERT_EQ(task.load_offset(kbi, k), task.load_offset(0, k % 2) + 4 * (2 * kbi + k / 2)) << "producer " << p;
      }
    }
    ASSERT_EQ(task.load_offset(0, 0) % 16, 0);
    ASSERT_EQ(task.load_offset(0, 1) % 16, 0);
  }
}

// Backward scales: the producer's slot (half, depth row) lands where the consumer thread of
// that half reads the scale of each of its fragment values.
TEST(FragmentBytes, RelaidBackwardScalesMatchEachValuesDepthRow) {
  std::set<int> positions;
  for (int slot = 0; slot < 128; ++slot) positions.insert(q::relaid_scale_slot(slot));
  EXPECT_EQ(positions.size(), 128u);
  EXPECT_GE(*positions.begin(), 0);
  EXPECT_LT(*positions.rbegin(), q::kRelaidScaleFloats);
  for (int wg = 0; wg < 2; ++wg) {
    for (int quad = 0; quad < 4; ++quad) EXPECT_EQ(q::relaid_scales_of(wg, quad) % 4, 0) << "float4 aligned";
  }
  using Value = q::FragmentValue<QuantGemmOp::kBackward>;
  for (int t = 0; t < q::kRelayConsumerThreads; ++t) {
    const int warpgroup = t / 128, quad = t % 4;
    for (int kb = 0; kb < 4; ++kb) {
      for (int i = 0; i < 4; ++i) {
        for (int e = 0; e < 2; ++e) {
          const int depth = fragment_element(t, kb, i, e).depth;
          ASSERT_EQ(q::relaid_scale_slot(64 * warpgroup + depth), q::relaid_scales_of(warpgroup, quad) + 4 * kb + Value::scale(i, e))
              << "thread " << t << " k-block " << kb << " register " << i << " value " << e;
        }
      }
    }
  }
}

// ---------------------------------------------------------------- shared-memory banks

// Wavefronts of one warp-wide shared-memory access of `bytes` per lane: 8-byte accesses go
// in two phases of 16 lanes, 16-byte ones in four of 8; a phase costs as many wavefronts as
// the most distinct 4-byte words any bank serves.
int wavefronts(const std::vector<int>& lane_offsets, int bytes) {
  const int lanes_per_phase = 32 * 4 / (bytes < 4 ? 4 : bytes);
  int total = 0;
  for (int first = 0; first < 32; first += lanes_per_phase) {
    std::map<int, std::set<int>> words_of_bank;
    for (int lane = first; lane < first + lanes_per_phase; ++lane) {
      for (int b = 0; b < bytes; b += 4) {
        const int word = (lane_offsets[lane] + b) / 4;
        words_of_bank[word % 32].insert(word);
      }
    }
    int most = 1;
    for (const auto& [bank, words] : words_of_bank) most = std::max(most, static_cast<int>(words.size()));
    total += most;
  }
  return total;
}

template <QuantGemmOp kOp>
void expect_relay_accesses_conflict_free() {
  for (int warp = 0; warp < q::kRelayProducerThreads / 32; ++warp) {
    auto lanes = [&](auto offset_of) {
      std::vector<int> offsets;
      for (int lane = 0; lane < 32; ++lane) offsets.push_back(offset_of(q::RelayTask<kOp>(32 * warp + lane)));
      return offsets;
    };
    if (kOp == QuantGemmOp::kForward) {
      for (int k = 0; k < 2; ++k) {
        EXPECT_EQ(wavefronts(lanes([&](const auto& task) { return task.load_offset(0, k); }), 16), 4)
            << "forward producer load " << k << ", warp " << warp;
      }
    } else {
      for (int kbi = 0; kbi < 2; ++kbi) {
        for (int k = 0; k < 4; ++k) {
          EXPECT_EQ(wavefronts(lanes([&](const auto& task) { return task.load_offset(kbi, k); }), 4), 1)
              << "backward producer load " << kbi << ", " << k << ", warp " << warp;
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(wavefronts(lanes([&](const auto& task) { return task.store_offset(j); }), 8), 2)
          << "producer store " << j << ", warp " << warp;
    }
  }
  for (int warp = 0; warp < q::kRelayConsumerThreads / 32; ++warp) {
    std::vector<int> offsets;
    for (int lane = 0; lane < 32; ++lane) offsets.push_back(q::relaid_offset(32 * warp + lane));
    EXPECT_EQ(wavefronts(offsets, 16), 4) << "consumer load, warp " << warp;
  }
}

// The backward's scales: the producer's one store a step, the consumers' 4 float4 loads.
TEST(FragmentBytes, RelaidBackwardScaleAccessesMeetEachBankOnce) {
  for (int warp = 0; warp < q::kRelayProducerThreads / 32; ++warp) {
    std::vector<int> offsets;
    for (int lane = 0; lane < 32; ++lane) offsets.push_back(4 * q::relaid_scale_slot(32 * warp + lane));
    EXPECT_EQ(wavefronts(offsets, 4), 1) << "producer scale store, warp " << warp;
  }
  for (int warp = 0; warp < q::kRelayConsumerThreads / 32; ++warp) {
    for (int kb = 0; kb < 4; ++kb) {
      std::vector<int> offsets;
      for (int lane = 0; lane < 32; ++lane) offsets.push_back(4 * (q::relaid_scales_of(warp / 4, lane % 4) + 4 * kb));
      EXPECT_EQ(wavefronts(offsets, 16), 4) << "consumer scale load " << kb << ", warp " << warp;
    }
  }
}

TEST(FragmentBytes, RelayForwardAccessesMeetEachBankOnce) { expect_relay_accesses_conflict_free<QuantGemmOp::kForward>(); }
TEST(FragmentBytes, RelayBackwardAccessesMeetEachBankOnce) { expect_relay_accesses_conflict_free<QuantGemmOp::kBackward>(); }

// ---------------------------------------------------------------- int8 without I2F

TEST(FragmentBytes, MagicInt8ToFloatIsExactForAllValues) {
  for (int value = -128; value < 128; ++value) {
    const uint32_t byte = static_cast<uint8_t>(static_cast<int8_t>(value));
    for (int j = 0; j < 4; ++j) {
      // The other bytes hold other values: the permute must take byte j alone.
      const uint32_t word = (0x5A3C7F81u & ~(0xFFu << (8 * j))) | byte << (8 * j);
      ASSERT_EQ(q::biased_int8_to_float(q::bias_int8_bytes(word), j), static_cast<float>(value)) << "byte " << j;
    }
  }
}

TEST(FragmentBytes, MagicInt8PairToHalf2IsExactForAllValues) {
  for (int lo = -128; lo < 128; ++lo) {
    for (int hi = -128; hi < 128; ++hi) {
      const uint32_t lo_byte = static_cast<uint8_t>(static_cast<int8_t>(lo)), hi_byte = static_cast<uint8_t>(static_cast<int8_t>(hi));
      for (const int first : {0, 2}) {  // the forward's pair starts at byte 0 or 2
        const uint32_t word = (lo_byte | hi_byte << 8) << (8 * first) | (first == 0 ? 0x81C30000u : 0x000081C3u);
        const __half2 pair = q::biased_int8_pair_to_half2(q::bias_int8_bytes(word), first, first + 1);
        ASSERT_EQ(__half2float(pair.x), static_cast<float>(lo)) << lo << ", " << hi;
        ASSERT_EQ(__half2float(pair.y), static_cast<float>(hi)) << lo << ", " << hi;
      }
    }
  }
}

}  // namespace
}  // namespace barqtrain::testing
