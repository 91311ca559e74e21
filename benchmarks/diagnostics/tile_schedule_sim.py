"""How busy the SMs stay under the attention kernels' tile orders, by a greedy model.

The hardware (or a persistent kernel's counter) hands the next tile, in launch order, to
whichever of the resident CTA slots frees up first. A tile's cost is its streamed steps of 64
rows plus a fixed cost per tile. Under a causal mask a key block of K keys starting at key j*K
walks (S - j*K)/64 x group query steps, and a query block m of M queries walks (m + 1) M/64 key
steps. The busy fraction is the mean slot time over the makespan.

Two kernel families (--kernels):
  hopper: one CTA per SM (132 slots), 128-row owned blocks: the dK/dV grid, and the persistent
          forward's and dQ kernel's QueryTiles: 88% busy for the dK/dV grid head after head at
          B4 S4096 H32/8 causal (ncu measured 87%; docs/design/attention.md, "Tile order").
  sm80:   two CTAs per SM (264 slots on an H100): the dK/dV grid (64 keys), the dQ grid (64
          queries) and the forward grid (128 queries), whose "heads inner" order is the grid
          (q heads, query blocks, batch).

    python benchmarks/diagnostics/tile_schedule_sim.py [--kernels hopper|sm80] [--sms 132]
"""

import argparse
import heapq

STEP = 64  # rows per streamed step in every kernel


def busy_fraction(costs: list[float], slots: int) -> float:
    finish = [0.0] * slots
    for cost in costs:
        heapq.heappush(finish, heapq.heappop(finish) + cost)
    return sum(costs) / slots / max(finish)


def key_tiles(seq: int, batch: int, kv_heads: int, group: int, longest_first: bool, block: int,
              fixed: float = 4) -> list[float]:
    """The dK/dV grid, causal: (key block, kv head, batch), head after head or key block first."""

    def cost(j: int) -> float:
        return (seq - j * block) // STEP * group + fixed

    blocks = seq // block
    if longest_first:
        return [cost(j) for j in range(blocks) for _ in range(batch * kv_heads)]
    return [cost(j) for _ in range(batch * kv_heads) for j in range(blocks)]


def query_tiles(seq: int, batch: int, kv_heads: int, group: int, order: str, block: int,
                fixed: float = 2) -> list[float]:
    """Query tiles, causal, from the last block of a head: 'head' (a head's blocks, then the next
    head), 'grouped' (QueryTiles: a GQA group at a time, its heads in turn at each block),
    'heads inner' (a sequence's blocks, every head's at each) or 'longest' (across everything)."""
    blocks = seq // block

    def cost(m: int) -> float:
        return (m + 1) * block // STEP + fixed

    descending = range(blocks - 1, -1, -1)
    heads = kv_heads * group
    if order == "head":
        return [cost(m) for _ in range(batch * heads) for m in descending]
    if order == "grouped":
        return [cost(m) for _ in range(batch * kv_heads) for m in descending for _ in range(group)]
    if order == "heads inner":
        return [cost(m) for _ in range(batch) for m in descending for _ in range(heads)]
    return [cost(m) for m in descending for _ in range(batch * heads)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("hopper", "sm80"), default="hopper")
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    if args.kernels == "hopper":
        slots, columns = args.sms, [
            ("dK/dV head", lambda s: key_tiles(*s, longest_first=False, block=128)),
            ("key first", lambda s: key_tiles(*s, longest_first=True, block=128)),
            ("Q head", lambda s: query_tiles(*s, order="head", block=128)),
            ("Q grouped", lambda s: query_tiles(*s, order="grouped", block=128)),
            ("Q longest", lambda s: query_tiles(*s, order="longest", block=128)),
        ]
    else:
        slots, columns = 2 * args.sms, [
            ("dK/dV head", lambda s: key_tiles(*s, longest_first=False, block=64)),
            ("key first", lambda s: key_tiles(*s, longest_first=True, block=64)),
            ("dQ head", lambda s: query_tiles(*s, order="head", block=64)),
            ("dQ grouped", lambda s: query_tiles(*s, order="grouped", block=64)),
            ("fwd head", lambda s: query_tiles(*s, order="head", block=128)),
            ("fwd h-inner", lambda s: query_tiles(*s, order="heads inner", block=128)),
        ]
    print(f"{args.kernels} kernels, causal, {slots} resident CTAs; busy fraction of the slots")
    print(f"{'case':18} " + " ".join(f"{name:>11}" for name, _ in columns))
    for seq, batch in ((1024, 16), (2048, 8), (4096, 4), (8192, 2), (16384, 1)):
        for kv_heads, group in ((8, 4), (32, 1)):
            shape = (seq, batch, kv_heads, group)
            label = f"B{batch} S{seq} H32/{kv_heads}"
            print(f"{label:18} " + " ".join(f"{busy_fraction(tiles(shape), slots):>11.3f}" for _, tiles in columns))


if __name__ == "__main__":
    main()
