// The orders in which the attention kernels take their tiles. Under a causal mask tiles differ
// in length (query block m walks m + 1 key blocks, key block j the queries from its own on),
// and the hardware starts CTAs in linear order as SMs free up: an order that starts a long tile
// last leaves the other SMs idle at the end. Both the sm_80 kernels and the Hopper ones map
// their CTA (or persistent tile) index through these functions, the launchers decide with
// them, and tests/csrc/kernels/attention_tile_order_test.cu checks the host-side ones.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/attention/params.h"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels::attention {

// The tiles of the persistent Hopper kernels that own query blocks (the forward, the dQ role):
// (query block, q head, batch), numbered a GQA group after another: within a group, query
// blocks from the last (the longest under a causal mask), the group's q heads in turn at each,
// so that CTAs running together share the group's K and V in L2 and the last tiles to start
// are short ones. Taken a head after another, the last head's longest tile started when little
// else was left: the SMs idled 4% of the Hopper forward's and dQ kernel's cycles, against under
// 1% in this order (ncu, B4 S4096 H32/8 D128 causal). A persistent kernel runs tile i on CTA
// i first, then takes the next unstarted one from a counter.
struct QueryTiles {
  int m_blocks = 0;  // query blocks of the longest sequence
  int heads = 0;     // q heads
  int group = 1;     // q heads per kv head
  int count = 0;

  __host__ __device__ int m_block(int index) const { return m_blocks - 1 - index / group % m_blocks; }
  __host__ __device__ int head(int index) const { return index / (m_blocks * group) * group % heads + index % group; }
  __host__ __device__ int batch(int index) const { return index / (m_blocks * heads); }
};

// The query tiles of blocks of block_m queries.
inline QueryTiles query_tiles(const AttentionParams& p, int block_m) {
  QueryTiles tiles;
  tiles.m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  tiles.heads = p.q_heads;
  tiles.group = p.q_heads / p.kv_heads;
  const int64_t count = int64_t{tiles.m_blocks} * tiles.heads * p.batch;
  require(count < INT32_MAX / 2, "hopper attention: more than 2^30 query tiles");
  tiles.count = static_cast<int>(count);
  return tiles;
}

// The grid of the sm_80 kernels that own query blocks (the forward, the dQ kernel), one CTA per
// block of block_m queries: (q heads, query blocks, batch), so that the hardware starts a
// sequence's query blocks from the last (query_block_of_cta), every head's at each: the tiles
// that start last are short ones, and the CTAs running together read one sequence's K and V, a
// GQA group's heads adjacent. The mapping is blockIdx itself: QueryTiles' divisions made ptxas
// spill 84 bytes in the sm_80 forward (5-7% slower on an H100). On an H100 this order keeps
// the forward's SMs busy 99% of its cycles against 94% (ncu) and runs 3-7% faster under a causal
// mask than a head's blocks together.
inline dim3 query_block_grid(const AttentionParams& p, int block_m, const char* what) {
  const int m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  require(m_blocks <= 65535, std::string(what) + ": a sequence of " + std::to_string(p.seqlen_q) +
                                 " queries is longer than the " + std::to_string(65535 * block_m) +
                                 " this kernel's grid holds at head_dim " + std::to_string(p.head_dim));
  return dim3(p.q_heads, m_blocks, p.batch);
}

struct QueryBlock {
  int block, head, batch;
};
__device__ __forceinline__ QueryBlock query_block_of_cta() {
  return {static_cast<int>(gridDim.y - 1 - blockIdx.y), static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.z)};
}

// The dK/dV tile of CTA `cta` in a grid of (key blocks, kv heads, batch). The grid's (kv head,
// batch) pairs go in runs of `heads_together`; a run takes the key block first (each pair's
// block 0, then each pair's block 1, ...): under a causal mask key block j sees the queries from
// its own on, so a run's longest tiles start first. 1 takes a head's key blocks one after
// another (they share the head's queries in L2); the grid's pair count, every head's block 0
// first.
struct KeyTile {
  int block, head, batch;
};
__host__ __device__ inline KeyTile key_tile_of_cta(dim3 cta, dim3 grid, int heads_together) {
  if (heads_together <= 1) return {static_cast<int>(cta.x), static_cast<int>(cta.y), static_cast<int>(cta.z)};
  const int64_t linear = cta.x + int64_t{grid.x} * (cta.y + int64_t{grid.y} * cta.z);
  const int64_t run_ctas = int64_t{heads_together} * grid.x;
  const int first_pair = static_cast<int>(linear / run_ctas) * heads_together;
  const int pairs_left = static_cast<int>(grid.y * grid.z) - first_pair;
  const int run_pairs = heads_together < pairs_left ? heads_together : pairs_left;  // the last run may be short
  const int in_run = static_cast<int>(linear % run_ctas);
  const int pair = first_pair + in_run % run_pairs;
  return {in_run / run_pairs, pair % static_cast<int>(grid.y), pair / static_cast<int>(grid.y)};
}

// Whether a dK/dV grid of key_blocks per head, of which resident_ctas run at once, takes its
// longest tiles first. Taken head after head, the last heads' longest tiles start when most
// CTAs have finished: a long tail where a tile walks several q heads (GQA) and the resident
// CTAs hold the key blocks of two heads or more. There the longest tiles go first, at the
// price of the L2 sharing of a head's queries. Hopper, H100, B4 S4096 H32/8 causal: SMs busy
// 87% -> 98% of the D128 dK/dV kernel's cycles (ncu), backward -3% (docs/design/attention.md,
// section "Tile order and scheduling"); the seven-product sm_80 dK/dV kernel (two CTAs per SM
// on an H100): 91% -> 99%,
// backward 6.67-6.76 -> 6.37-6.40 ms (D64: 3.75-3.79 -> 3.53-3.55). Head after head measured
// better for H32/32 (tiles a quarter as long: 454 against 431 TFLOP/s forward+backward), B1
// S16384 (128 key blocks on 132 SMs: one head's fill them; by 0.5-1%) and full masks (tiles
// alike; by 3.5%). Head after head stays for windows too, whose tiles are alike (not
// measured). Those kernels then take every pair together (key_tile_of_cta).
inline bool key_tiles_longest_first(const AttentionParams& p, int key_blocks, int resident_ctas) {
  return p.causal && p.window_left < 0 && p.q_heads > p.kv_heads && 2 * key_blocks <= resident_ctas;
}

// The fixed-point gradients kernel's heads_together (key_tile_of_cta): under a causal mask
// without a window (tiles of different lengths), where a head's key blocks fill at most half the
// resident CTAs, as many pairs as the resident CTAs hold whole, so that the CTAs running at once
// read the queries of a few heads and a run's longest tiles still start first; else 1. Unlike
// key_tiles_longest_first, without GQA too. H100, B4 S4096 causal, 4 pairs a run:
// at H32/8, against every pair together, backward 2.5% faster at head_dim 128, 1-2.5% at 96, 1%
// at 64, the kernel's DRAM reads 2.3 GB against 3.9 (ncu), where Q, dO and the dQ sums take
// about 0.54 GB; at H32/32 D128, against head after head, 4.90-4.92 ms against 4.98-5.02.
inline int key_tile_heads_together(const AttentionParams& p, int key_blocks, int resident_ctas) {
  const bool tiles_differ = p.causal && p.window_left < 0;
  return tiles_differ && 2 * key_blocks <= resident_ctas ? resident_ctas / key_blocks : 1;
}

}  // namespace barqtrain::kernels::attention
