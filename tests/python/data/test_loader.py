"""PackedLoader with the C++ prefetcher: the same batches as on-demand collation, exact
resume, equal batch counts across ranks, and clean stops (exceptions, Ctrl-C, fork)."""

from __future__ import annotations

import os
import pickle
import signal

import numpy as np
import pytest
import torch

from barqtrain.data import PackedLoader, Prefetch, PrefetchError, pack


def sequences(n: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    seqs, labels = [], []
    for _ in range(n):
        ids = rng.integers(0, 1000, int(rng.integers(1, 300)))
        prompt = int(rng.integers(0, len(ids)))
        seqs.append(ids)
        labels.append(np.concatenate([np.full(prompt, -100), ids[prompt:]]))
    return seqs, labels


SEQS, LABELS = sequences(2000, seed=1)


def loader(**options) -> PackedLoader:
    return PackedLoader(SEQS, 512, 4, labels=LABELS, seed=3, **options)


def as_lists(batches) -> list[tuple[torch.Tensor, ...]]:
    return [(b.input_ids, b.labels, b.position_ids, b.cu_seq_lens) for b in batches]


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


def test_prefetched_batches_equal_on_demand_batches():
    expected = as_lists(loader(prefetch=0))
    assert len(expected) == len(loader())
    for depth, workers in ((1, 1), (3, 2), (8, 4)):
        assert_same(as_lists(loader(prefetch=depth, num_workers=workers)), expected)


def test_resume_mid_epoch_yields_exactly_the_next_batches():
    full = loader()
    full.set_epoch(2)
    reference = as_lists(full)
    first = loader()
    first.set_epoch(2)
    it = iter(first)
    head = as_lists(next(it) for _ in range(5))
    state = pickle.loads(pickle.dumps(first.state_dict()))  # what a checkpoint stores
    del it
    resumed = loader(prefetch=3, num_workers=2)
    resumed.load_state_dict(state)
    assert_same(head + as_lists(resumed), reference)
    # The next epoch after a resumed one is the same as without the interruption.
    resumed.set_epoch(3)
    full.set_epoch(3)
    assert_same(as_lists(resumed), as_lists(full))


def test_a_state_from_other_settings_is_refused():
    state = loader().state_dict()
    with pytest.raises(ValueError, match=r"seed=3 \(this loader: 4\)"):
        PackedLoader(SEQS, 512, 4, labels=LABELS, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=4 .*sequences=2000 .this loader: 1999."):
        PackedLoader(SEQS[:-1], 512, 8, labels=LABELS[:-1], seed=3).load_state_dict(state)


def test_every_rank_yields_the_same_number_of_batches():
    for balance in ("repeat", "drop"):
        counts = {len(PackedLoader(SEQS, 512, 3, world_size=3, rank=r, balance=balance)) for r in range(3)}
        assert len(counts) == 1, balance
    unbalanced = {PackedLoader(SEQS, 512, 1, world_size=3, rank=r, balance="none").packing.num_rows for r in range(3)}
    assert len(unbalanced) > 1, "the data should pack into different row counts per rank"


def test_an_exception_in_the_loop_stops_and_joins_the_workers():
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    it = iter(loader(prefetch=4, num_workers=3))
    next(it)
    assert threads() == before + 3
    with pytest.raises(KeyboardInterrupt):
        for _ in it:
            raise KeyboardInterrupt  # as Ctrl-C in the training step
    it.close()
    assert threads() == before


def test_ctrl_c_while_waiting_for_a_batch_raises_keyboard_interrupt():
    # A batch that takes far longer to collate than the 1 ms alarm: 8 rows of 1M tokens.
    big = pack([np.arange(1 << 20) % 1000] * 8, 1 << 20, shuffle=False)
    prefetch = Prefetch(big, 8, depth=1)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.001)
        with pytest.raises(KeyboardInterrupt):
            next(prefetch)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(PrefetchError, match="closed"):
        next(prefetch)


def test_a_forked_child_restarts_its_own_workers_and_continues():
    expected = as_lists(loader(prefetch=0))
    it = iter(loader(prefetch=3, num_workers=2))
    head = as_lists([next(it), next(it)])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: continue where the parent stands
        try:
            rest = as_lists(it)
            ok = all(all(torch.equal(p, q) for p, q in zip(x, y)) for x, y in zip(head + rest, expected))
            os.write(write_end, b"1" if ok and len(head) + len(rest) == len(expected) else b"0")
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    assert os.read(read_end, 1) == b"1", "the child did not get the batches that came next"
    os.close(read_end)
    assert_same(head + as_lists(it), expected)  # the parent is unaffected
