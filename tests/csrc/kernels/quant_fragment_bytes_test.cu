// The byte logic of the Hopper dequant-GEMM's forward (kernels/quant/fragment_bytes.cuh),
// checked on the host with the same functions the kernel runs (no GPU): the NF4 forward's
// gather and value selection deliver to every consumer thread the nibbles and scales of
// wgmma's A fragments, and the int8 conversion without I2F is exact for every value.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quant/fragment_bytes.cuh"

namespace barqtrain::testing {
namespace {

namespace q = barqtrain::kernels::quant;

uint32_t byte_at(uint32_t word, int j) { return (word >> (8 * j)) & 0xFFu; }

std::mt19937 fresh_rng() { return std::mt19937(::testing::UnitTest::GetInstance()->random_seed()); }

// ---------------------------------------------------------------- permutes

// Every selector of the default prmt mode (4 nibbles of 0..7): result byte n is byte
// selector_n of {b:a}.
TEST(FragmentBytes, BytePermSelectsEachByteOfBothWords) {
  const uint32_t a = 0xA3A2A1A0u, b = 0xB7B6B5B4u;
  const uint8_t source[8] = {0xA0, 0xA1, 0xA2, 0xA3, 0xB4, 0xB5, 0xB6, 0xB7};
  for (uint32_t selector = 0; selector < 0x8000u; ++selector) {
    if (selector & 0x8888u) continue;  // the sign-replicate bits: a mode the kernel never uses
    const uint32_t result = q::byte_perm(a, b, selector);
    for (int n = 0; n < 4; ++n) ASSERT_EQ(byte_at(result, n), source[(selector >> (4 * n)) & 7]) << std::hex << selector;
  }
}

TEST(FragmentBytes, NibbleOffsetsAreFourTimesEachNibble) {
  std::mt19937 rng = fresh_rng();
  for (int j = 0; j < 4; ++j) {
    for (uint32_t byte = 0; byte < 256; ++byte) {
      // The other bytes hold other values: the offsets of byte j must come from it alone.
      const uint32_t word = (rng() & ~(0xFFu << (8 * j))) | byte << (8 * j);
      const q::NibbleOffsets offsets = q::nibble_offsets(word);
      ASSERT_EQ(q::byte_of(offsets.high, j), 4 * (byte >> 4)) << "byte " << j;
      ASSERT_EQ(q::byte_of(offsets.low, j), 4 * (byte & 0xFu)) << "byte " << j;
    }
  }
}

// ---------------------------------------------------------------- NF4 forward fragments

constexpr int kConsumerThreads = 256;
constexpr int kTileOut = 128, kRowBytes = 32;  // a step's stored W tile: 128 rows x 64 depth

// Where a consumer thread's fragment value sits (wgmma's A fragment of a 64 x 16 k-block: the
// thread's rows g, g + 8 are output columns c, c + 1; register i's value e at depth 2q + e,
// + 8 for i >= 2), and the stored nibble of W that holds it (even depth: the high nibble).
struct FragmentElement {
  int out_col, depth;
};
FragmentElement fragment_element(int consumer, int kb, int i, int e) {
  const int warpgroup = consumer / 128, warp = consumer % 128 / 32, group = consumer % 32 / 4, quad = consumer % 4;
  return {64 * warpgroup + 16 * warp + 2 * group + (i & 1), 16 * kb + 2 * quad + 8 * (i >> 1) + e};
}
uint32_t stored_nibble(const std::vector<uint8_t>& stored, const FragmentElement& el) {
  const uint8_t byte = stored[el.out_col * kRowBytes + el.depth / 2];
  return el.depth % 2 == 0 ? byte >> 4 : byte & 0xFu;
}

// Every value of every consumer thread's fragments, as the kernel takes it (its two W rows
// loaded as 16 words, gathered into a word a k-block, each value's code offset and scale
// picked by ForwardFragmentValue), is the stored nibble wgmma's fragment layout puts there,
// scaled by its own W row's scale.
TEST(FragmentBytes, GatheredForwardWordsHoldEachThreadsFragmentNibbles) {
  std::mt19937 rng = fresh_rng();
  for (int trial = 0; trial < 8; ++trial) {
    std::vector<uint8_t> stored(kTileOut * kRowBytes);
    for (uint8_t& b : stored) b = static_cast<uint8_t>(rng());
    for (int t = 0; t < kConsumerThreads; ++t) {
      const int out_col = fragment_element(t, 0, 0, 0).out_col;
      uint32_t rows[16];
      std::memcpy(rows, stored.data() + out_col * kRowBytes, sizeof(rows));
      for (int kb = 0; kb < 4; ++kb) {
        const q::NibbleOffsets offsets = q::nibble_offsets(q::gather_forward_word(rows, kb, q::gather_selector(t % 4)));
        for (int i = 0; i < 4; ++i) {
          for (int e = 0; e < 2; ++e) {
            const FragmentElement el = fragment_element(t, kb, i, e);
            const uint32_t offset = q::ForwardFragmentValue::table_offset(offsets, i, e);
            ASSERT_EQ(offset % 4, 0u);
            ASSERT_EQ(offset / 4, stored_nibble(stored, el))
                << "thread " << t << " k-block " << kb << " register " << i << " value " << e;
            ASSERT_EQ(out_col + q::ForwardFragmentValue::scale(i), el.out_col) << "register " << i << "'s scale";
          }
        }
      }
    }
  }
}

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
