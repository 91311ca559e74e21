"""How busy the SMs stay under the Hopper attention kernels' tile orders, by a greedy model.

The hardware (or a persistent kernel's counter) hands the next tile, in launch order, to
whichever SM frees up first. A tile's cost is its streamed steps plus a fixed cost per tile.
Under a causal mask, key block j (128 keys) walks (S/64 - 2j) x group query steps, and query
block m (128 queries) walks 2m + 2 key steps. The busy fraction is the mean SM time over the
makespan. csrc/kernels/attention/NOTES.md (session 13) quotes it: 88% for the dK/dV grid head
after head at B4 S4096 H32/8 causal (ncu measured 87%).

    python scripts/diagnostics/tile_schedule_sim.py [--sms 132]
"""

import argparse
import heapq


def busy_fraction(costs: list[float], sms: int) -> float:
    finish = [0.0] * sms
    for cost in costs:
        heapq.heappush(finish, heapq.heappop(finish) + cost)
    return sum(costs) / sms / max(finish)


def key_tiles(seq: int, batch: int, kv_heads: int, group: int, causal: bool, longest_first: bool,
              fixed: float = 4) -> list[float]:
    """The dK/dV grid: (key block, kv head, batch), head after head or key block first."""
    blocks, query_blocks = seq // 128, seq // 64

    def cost(j: int) -> float:
        return (query_blocks - 2 * j if causal else query_blocks) * group + fixed

    if longest_first:
        return [cost(j) for j in range(blocks) for _ in range(batch * kv_heads)]
    return [cost(j) for _ in range(batch * kv_heads) for j in range(blocks)]


def query_tiles(seq: int, batch: int, kv_heads: int, group: int, causal: bool, order: str,
                fixed: float = 2) -> list[float]:
    """QueryTiles: 'head' (a head's blocks from the last, then the next head), 'grouped' (a GQA
    group at a time, its heads in turn at each block) or 'longest' (the longest across heads)."""
    blocks = seq // 128

    def cost(m: int) -> float:
        return (2 * m + 2 if causal else 2 * blocks) + fixed

    descending = range(blocks - 1, -1, -1)
    if order == "head":
        return [cost(m) for _ in range(batch * kv_heads * group) for m in descending]
    if order == "grouped":
        return [cost(m) for _ in range(batch * kv_heads) for m in descending for _ in range(group)]
    return [cost(m) for m in descending for _ in range(batch * kv_heads * group)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    print("causal, H32/8 (group 4) and H32/32; busy fraction of the SMs")
    print(f"{'case':18} {'dK/dV head':>10} {'key first':>10} {'Q head':>8} {'Q grouped':>10} {'Q longest':>10}")
    for seq, batch in ((1024, 16), (2048, 8), (4096, 4), (8192, 2), (16384, 1)):
        for kv_heads, group in ((8, 4), (32, 1)):
            shape = (seq, batch, kv_heads, group, True)
            row = [busy_fraction(key_tiles(*shape, longest_first=f), args.sms) for f in (False, True)]
            row += [busy_fraction(query_tiles(*shape, order=o), args.sms) for o in ("head", "grouped", "longest")]
            label = f"B{batch} S{seq} H32/{kv_heads}"
            print(f"{label:18} " + " ".join(f"{value:>10.3f}" for value in row))


if __name__ == "__main__":
    main()
