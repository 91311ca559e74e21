// The orders in which the attention kernels take their tiles (tile_order.cuh), checked on the
// host (no GPU): the forwards' and dQ kernels' QueryTiles, the dK/dV grids' key_tile_of_cta
// and the rule that picks its order. A wrong order would skip a tile or run one twice (wrong
// gradients), or lose the balance and L2 sharing it was chosen for (slower, and nothing else
// would show it).
#include <gtest/gtest.h>

#include <ostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/attention/tile_order.cuh"

namespace barqtrain::testing {
namespace {

namespace attention = barqtrain::kernels::attention;

struct QueryTilesCase {
  int m_blocks, q_heads, kv_heads, batch;
};
void PrintTo(const QueryTilesCase& c, std::ostream* os) {
  *os << c.m_blocks << " query blocks, " << c.q_heads << "/" << c.kv_heads << " heads, batch " << c.batch;
}

class QueryTilesOrder : public ::testing::TestWithParam<QueryTilesCase> {};

// Every (query block, q head, batch) once; the CTAs of one GQA group's query block adjacent (they
// read the same K and V); within a group the query blocks from the last (the longest under a
// causal mask), and the groups one after another.
TEST_P(QueryTilesOrder, EachTileOnceAGroupAtATimeLongestFirst) {
  const QueryTilesCase c = GetParam();
  kernels::AttentionParams p;
  p.seqlen_q = c.m_blocks * 64 - 5;  // the last block partly filled
  p.q_heads = c.q_heads;
  p.kv_heads = c.kv_heads;
  p.batch = c.batch;
  const attention::QueryTiles tiles = attention::query_tiles(p, 64);
  ASSERT_EQ(tiles.m_blocks, c.m_blocks);
  ASSERT_EQ(tiles.count, c.m_blocks * c.q_heads * c.batch);
  std::vector<int> seen(tiles.count, 0);
  for (int index = 0; index < tiles.count; ++index) {
    const int m = tiles.m_block(index), head = tiles.head(index), b = tiles.batch(index);
    ASSERT_TRUE(m >= 0 && m < c.m_blocks && head >= 0 && head < c.q_heads && b >= 0 && b < c.batch) << index;
    ++seen[(b * c.q_heads + head) * c.m_blocks + m];
    const int group_of_index = index / (c.m_blocks * tiles.group);
    ASSERT_EQ(b * c.kv_heads + head / tiles.group, group_of_index) << "index " << index << " left its group";
    ASSERT_EQ(m, c.m_blocks - 1 - index / tiles.group % c.m_blocks) << index;
    ASSERT_EQ(head % tiles.group, index % tiles.group) << "the group's heads take turns, index " << index;
  }
  for (int tile = 0; tile < tiles.count; ++tile) ASSERT_EQ(seen[tile], 1) << "tile " << tile;
}

INSTANTIATE_TEST_SUITE_P(Cases, QueryTilesOrder,
                         ::testing::Values(QueryTilesCase{32, 32, 8, 4},    // GQA 4
                                           QueryTilesCase{7, 4, 4, 3},      // MHA
                                           QueryTilesCase{5, 6, 1, 2},      // MQA
                                           QueryTilesCase{1, 28, 4, 1},     // one block, GQA 7
                                           QueryTilesCase{128, 32, 8, 1}),  // S16384
                         [](const auto& info) {
                           const QueryTilesCase& c = info.param;
                           return "m" + std::to_string(c.m_blocks) + "_h" + std::to_string(c.q_heads) + "_kv" +
                                  std::to_string(c.kv_heads) + "_b" + std::to_string(c.batch);
                         });

// heads_together 0 stands for the grid's pair count (every (kv head, batch) pair together).
class KeyTileOrder : public ::testing::TestWithParam<std::tuple<dim3, int>> {};

// Every (key block, kv head, batch) once over the grid; in launch (linear) order, one pair at a
// time keeps a head's key blocks together; runs of pairs hold their pairs whole and take the key
// blocks in ascending order (the longest under a causal mask first) across the run's pairs.
TEST_P(KeyTileOrder, EachTileOnceInLaunchOrder) {
  const auto [grid, param] = GetParam();
  const int pairs = static_cast<int>(grid.y * grid.z), together = param == 0 ? pairs : param;
  std::vector<int> seen(grid.x * grid.y * grid.z, 0);
  int previous_block = -1, previous_run = -1;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {  // the hardware's linear order
        const attention::KeyTile tile = attention::key_tile_of_cta(dim3(x, y, z), grid, together);
        ASSERT_TRUE(tile.block >= 0 && tile.block < static_cast<int>(grid.x) && tile.head >= 0 &&
                    tile.head < static_cast<int>(grid.y) && tile.batch >= 0 && tile.batch < static_cast<int>(grid.z));
        ++seen[(tile.batch * grid.y + tile.head) * grid.x + tile.block];
        if (together == 1) {
          ASSERT_EQ(tile.block, static_cast<int>(x));
          ASSERT_EQ(tile.head, static_cast<int>(y));
          ASSERT_EQ(tile.batch, static_cast<int>(z));
          continue;
        }
        const int linear = static_cast<int>(x + grid.x * (y + grid.y * z)), run = linear / (together * grid.x);
        ASSERT_EQ((tile.batch * static_cast<int>(grid.y) + tile.head) / together, run)
            << "CTA (" << x << ", " << y << ", " << z << ") left its run of pairs";
        if (run != previous_run) previous_block = -1;
        ASSERT_GE(tile.block, previous_block) << "CTA (" << x << ", " << y << ", " << z << ")";
        previous_block = tile.block;
        previous_run = run;
      }
    }
  }
  for (size_t tile = 0; tile < seen.size(); ++tile) ASSERT_EQ(seen[tile], 1) << "tile " << tile;
}

INSTANTIATE_TEST_SUITE_P(Cases, KeyTileOrder,
                         ::testing::Combine(::testing::Values(dim3(32, 8, 4), dim3(1, 1, 1), dim3(5, 3, 2),
                                                              dim3(64, 1, 7)),
                                            ::testing::Values(1, 4, 0)),
                         [](const auto& info) {
                           const dim3 grid = std::get<0>(info.param);
                           const int together = std::get<1>(info.param);
                           return std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" + std::to_string(grid.z) +
                                  (together == 1   ? "_head_after_head"
                                   : together == 0 ? "_all_pairs_together"
                                                   : "_runs_of_" + std::to_string(together));
                         });

// The sm_80 forward's and dQ kernel's grid: heads fastest, so that the hardware's linear order
// takes every head's query block in turn (query_block_of_cta counts the blocks from the last);
// a sequence longer than the grid's y extent holds is an error naming the length.
TEST(QueryBlockGrid, HeadsFastestAndTheLimitNamed) {
  kernels::AttentionParams p;
  p.seqlen_q = 4096 * 2 + 1;
  p.q_heads = 32;
  p.batch = 3;
  p.head_dim = 128;
  const dim3 grid = attention::query_block_grid(p, 128, "attention forward");
  EXPECT_EQ(grid.x, 32u);
  EXPECT_EQ(grid.y, 65u);
  EXPECT_EQ(grid.z, 3u);
  p.seqlen_q = 65535 * 64;
  EXPECT_EQ(attention::query_block_grid(p, 64, "attention dq").y, 65535u);
  p.seqlen_q += 1;
  try {
    attention::query_block_grid(p, 64, "attention dq");
    ADD_FAILURE() << "a sequence past the grid's limit was taken";
  } catch (const std::exception& error) {
    EXPECT_NE(std::string(error.what()).find("attention dq: a sequence of 4194241 queries"), std::string::npos)
        << error.what();
  }
}

// The dK/dV grid takes key blocks first only where head after head leaves a tail: causal
// without a window (tiles of different lengths), GQA (long tiles), and at most half as many key
// blocks per head as CTAs run at once (otherwise one head's blocks fill the GPU).
TEST(KeyTileOrder, LongestFirstOnlyWhereTheTilesDifferAndAHeadLeavesRoom) {
  kernels::AttentionParams p;
  p.causal = true;
  p.q_heads = 32;
  p.kv_heads = 8;
  EXPECT_TRUE(attention::key_tiles_longest_first(p, 64, 264));   // sm_80 kernels on an H100, S4096
  EXPECT_TRUE(attention::key_tiles_longest_first(p, 32, 64));    // exactly half
  EXPECT_FALSE(attention::key_tiles_longest_first(p, 33, 64));
  EXPECT_FALSE(attention::key_tiles_longest_first(p, 128, 132));  // Hopper, S16384
  p.kv_heads = 32;
  EXPECT_FALSE(attention::key_tiles_longest_first(p, 64, 264));  // no GQA
  p.kv_heads = 8;
  p.window_left = 4095;
  EXPECT_FALSE(attention::key_tiles_longest_first(p, 64, 264));  // sliding window
  p.window_left = -1;
  p.causal = false;
  EXPECT_FALSE(attention::key_tiles_longest_first(p, 64, 264));  // full mask
}

// The gradients kernel takes as many pairs together as the resident CTAs hold whole, under a
// causal mask without a window, GQA or not, where a head's key blocks leave room; else one at a
// time.
TEST(KeyTileOrder, GradientsKernelRunsFillTheResidentCtas) {
  kernels::AttentionParams p;
  p.causal = true;
  p.q_heads = 32;
  p.kv_heads = 8;
  EXPECT_EQ(attention::key_tile_heads_together(p, 32, 132), 4);  // H100, S4096, 128-key blocks
  EXPECT_EQ(attention::key_tile_heads_together(p, 66, 132), 2);
  EXPECT_EQ(attention::key_tile_heads_together(p, 67, 132), 1);
  p.kv_heads = 32;
  EXPECT_EQ(attention::key_tile_heads_together(p, 32, 132), 4);  // no GQA
  p.window_left = 4095;
  EXPECT_EQ(attention::key_tile_heads_together(p, 32, 132), 1);  // sliding window
  p.window_left = -1;
  p.causal = false;
  EXPECT_EQ(attention::key_tile_heads_together(p, 32, 132), 1);  // full mask
}

}  // namespace
}  // namespace barqtrain::testing
