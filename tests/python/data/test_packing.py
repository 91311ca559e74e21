"""barqtrain.data.pack: rows in DataCollatorWithFlattening's format that a Hugging Face
model reads as separate sequences: the logits of every packed sequence equal its logits
run alone, and the loss of a packed batch equals the token-weighted loss of its sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from barqtrain.data import PackedLoader, PackingError, pack

transformers = pytest.importorskip("transformers")


def random_sequences(n: int, seed: int, max_len: int = 40, vocab: int = 128, masked_prompts: bool = True):
    rng = random.Random(seed)
    seqs, labels = [], []
    for _ in range(n):
        length = rng.randint(1, max_len)
        ids = [rng.randrange(vocab) for _ in range(length)]
        prompt = rng.randint(0, length - 1) if masked_prompts else 0
        seqs.append(ids)
        labels.append([-100] * prompt + ids[prompt:])
    return seqs, labels


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def model(request):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config._attn_implementation = request.param
    return transformers.LlamaForCausalLM(config).to(torch.float64).eval()


@torch.no_grad()
def test_no_token_sees_another_sequence(model):
    seqs, labels = random_sequences(24, seed=1)
    packed = pack(seqs, seq_length=64, labels=labels, seed=3, shuffle_window=8)
    assert packed.stats["pieces"] == 24
    batch = packed.batch()
    logits = model(**batch.model_inputs()).logits
    checked = 0
    for row in range(packed.num_rows):
        at = 0
        for sequence, start, length in packed.row_pieces(row):
            alone = model(input_ids=torch.tensor([seqs[sequence][start : start + length]])).logits[0]
            # float64 model; HF builds the RoPE tables in float32, which differ by an ulp with
            # the batch shape: 1e-6 is that noise, a sequence seeing another moves logits by ~0.4.
            torch.testing.assert_close(logits[row, at : at + length], alone, rtol=1e-6, atol=1e-6)
            at += length
            checked += 1
    assert checked == 24
    # The check can fail: positions that do not restart let the sequences see each other.
    plain = model(input_ids=batch.input_ids, position_ids=torch.arange(64).expand(packed.num_rows, 64), use_cache=False).logits
    assert not torch.allclose(plain, logits)


@torch.no_grad()
def test_packed_loss_is_the_token_weighted_loss_of_the_sequences(model):
    seqs, labels = random_sequences(30, seed=2)
    packed = pack(seqs, seq_length=80, labels=labels, seed=0)
    batch = packed.batch()
    loss = model(**batch.model_inputs()).loss
    total, count = 0.0, 0
    for ids, lab in zip(seqs, labels):
        n = sum(1 for x in lab[1:] if x != -100)  # HF shifts: the first label is never predicted
        if n == 0:
            continue
        one = model(input_ids=torch.tensor([ids]), labels=torch.tensor([lab])).loss
        total += one.item() * n
        count += n
    assert count == int((batch.labels != -100).sum())
    # HF computes the loss in float32 (logits.float()), whatever the model dtype.
    assert loss.item() == pytest.approx(total / count, rel=1e-6)


def test_rows_match_data_collator_with_flattening():
    seqs, labels = random_sequences(50, seed=4)
    packed = pack(seqs, seq_length=100, labels=labels, seed=9, pad_id=0)
    batch = packed.batch()
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    for row in range(packed.num_rows):
        features = [
            {"input_ids": seqs[s][a : a + n], "labels": labels[s][a : a + n]} for s, a, n in packed.row_pieces(row)
        ]
        hf = collator(features, return_tensors="pt")
        used = hf["input_ids"].shape[1]
        torch.testing.assert_close(batch.input_ids[row, :used], hf["input_ids"][0])
        torch.testing.assert_close(batch.labels[row, :used], hf["labels"][0])
        torch.testing.assert_close(batch.position_ids[row, :used], hf["position_ids"][0])
        assert (batch.labels[row, used:] == -100).all()
        assert (batch.input_ids[row, used:] == 0).all()
        assert batch.position_ids[row, used:].tolist() == list(range(100 - used))
    # cu_seq_lens: every segment of every row (padding included), flattened over the rows.
    expected = [0]
    for row in range(packed.num_rows):
        for _, _, n in packed.row_pieces(row):
            expected.append(expected[-1] + n)
        if expected[-1] != (row + 1) * 100:
            expected.append((row + 1) * 100)
    assert batch.cu_seq_lens.dtype == torch.int32
    assert batch.cu_seq_lens.tolist() == expected
    assert batch.max_length == max(b - a for a, b in zip(expected, expected[1:]))
    assert batch.num_sequences == 50


def test_hf_features_and_arrays_are_accepted():
    seqs, labels = random_sequences(10, seed=5)
    a = pack([{"input_ids": s, "labels": l} for s, l in zip(seqs, labels)], 64, seed=1).batch()
    b = pack([np.array(s) for s in seqs], 64, labels=[torch.tensor(l) for l in labels], seed=1).batch()
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    with pytest.raises(PackingError, match="same length"):
        pack(seqs, 64, labels=[l[:-1] for l in labels])


def test_deterministic_and_disjoint_across_ranks():
    seqs, _ = random_sequences(1000, seed=6, max_len=300)
    first = pack(seqs, 512, seed=7, epoch=3, rank=1, world_size=4).batch()
    again = pack(seqs, 512, seed=7, epoch=3, rank=1, world_size=4).batch()
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.cu_seq_lens, again.cu_seq_lens)
    other_epoch = pack(seqs, 512, seed=7, epoch=4, rank=1, world_size=4).batch()
    assert not torch.equal(first.input_ids[: len(other_epoch.input_ids)], other_epoch.input_ids[: len(first.input_ids)])
    owners: dict[int, int] = {}
    for rank in range(4):
        packing = pack(seqs, 512, seed=7, epoch=3, rank=rank, world_size=4, balance="none")
        for row in range(packing.num_rows):
            for s, start, _ in packing.row_pieces(row):
                if start == 0:
                    assert s not in owners, f"sequence {s} is on ranks {owners.get(s)} and {rank}"
                    owners[s] = rank
    assert sorted(owners) == list(range(1000))


def test_ranks_get_the_same_number_of_rows_repeated_or_dropped():
    seqs, _ = random_sequences(1000, seed=6, max_len=300)
    own = [pack(seqs, 512, seed=7, rank=r, world_size=4, balance="none").stats for r in range(4)]
    rows = [s["rows"] for s in own]
    assert len(set(rows)) > 1, "the test needs shards that pack into different row counts"
    for balance, target, counter in (("repeat", max(rows), "repeated_rows"), ("drop", min(rows), "dropped_rows")):
        for r in range(4):
            packing = pack(seqs, 512, seed=7, rank=r, world_size=4, balance=balance)
            assert packing.num_rows == target
            assert packing.stats[counter] == abs(target - rows[r])
            # The rows a rank keeps are its own rows, in order; repeats start again at its first row.
            for i in range(min(target, rows[r])):
                assert packing.row_pieces(i) == pack(seqs, 512, seed=7, rank=r, world_size=4, balance="none").row_pieces(i)
            if balance == "repeat" and target > rows[r]:
                assert packing.row_pieces(rows[r]) == packing.row_pieces(0)
    with pytest.raises(PackingError, match="unknown balance"):
        pack(seqs, 512, world_size=2, balance="pad")
    with pytest.raises(PackingError, match="fewer sequences than ranks"):
        pack([[1, 2]], 8, rank=1, world_size=2)


def test_overflow_modes_and_errors():
    seqs = [[1] * 10, [2] * 25, [3] * 4]
    assert pack(seqs, 10, overflow="split").stats["split_sequences"] == 1
    assert pack(seqs, 10, overflow="truncate").stats["truncated_tokens"] == 15
    assert pack(seqs, 10, overflow="drop").stats["dropped_sequences"] == 1
    with pytest.raises(PackingError, match="sequence 1 has 25 tokens, more than seq_length 10"):
        pack(seqs, 10, overflow="error")
    with pytest.raises(PackingError, match="unknown overflow"):
        pack(seqs, 10, overflow="wrap")
    with pytest.raises(PackingError, match="rank 2 is outside"):
        pack(seqs, 10, rank=2, world_size=2)


def test_loader_batches_epochs_and_resume():
    seqs, labels = random_sequences(400, seed=8, max_len=120)
    loader = PackedLoader(seqs, seq_length=256, batch_size=4, labels=labels, seed=1)
    epoch0 = [b.input_ids for b in loader]
    assert len(epoch0) == len(loader) and all(b.shape[1] == 256 for b in epoch0)
    assert sum(b.shape[0] for b in epoch0) == loader.packing.num_rows
    loader.set_epoch(1)
    it = iter(loader)
    head = [next(it).input_ids for _ in range(3)]
    state = loader.state_dict()
    rest = [b.input_ids for b in it]
    resumed = PackedLoader(seqs, seq_length=256, batch_size=4, labels=labels, seed=1)
    resumed.load_state_dict(state)
    assert [torch.equal(a, b) for a, b in zip(rest, [b.input_ids for b in resumed])] == [True] * len(rest)
    assert len(head) + len(rest) == len(loader)
    assert not torch.equal(head[0], epoch0[0])


def test_loader_reads_a_state_that_names_seq_length_row_length():
    seqs, labels = random_sequences(400, seed=8, max_len=120)
    state = PackedLoader(seqs, seq_length=256, batch_size=4, labels=labels, seed=1).state_dict()
    state["row_length"] = state.pop("seq_length")
    PackedLoader(seqs, seq_length=256, batch_size=4, labels=labels, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seq_length=256 \(this loader: 128\)"):
        PackedLoader(seqs, seq_length=128, batch_size=4, labels=labels, seed=1).load_state_dict(state)
