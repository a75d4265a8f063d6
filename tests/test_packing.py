"""Sequence packing: block layout invariants, no cross-document attention or loss, Ray Data packing."""

import numpy as np
import pytest
import torch

from mlplat.data.packing import first_fit_decreasing, pack_dataset, pack_examples, packing_efficiency
from mlplat.train.batch import IGNORE_INDEX, packed_model_inputs


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference: summed next-token cross-entropy from full logits over unmasked labels, and their count."""
    targets = labels[:, 1:].reshape(-1)
    flat = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    loss = torch.nn.functional.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (targets != IGNORE_INDEX).sum()

PAD = 0
VOCAB = 97


def random_examples(lengths, seed=0) -> list[tuple[list[int], list[int]]]:
    """Token ids in 1..VOCAB-1 (never PAD), labels masked over a 'prompt' span.

    The first token keeps its label, so packing itself must mask it at a boundary.
    """
    rng = np.random.default_rng(seed)
    examples = []
    for n in lengths:
        ids = rng.integers(1, VOCAB, size=n).tolist()
        labels = [IGNORE_INDEX if 0 < t < n // 3 else tok for t, tok in enumerate(ids)]
        examples.append((ids, labels))
    return examples


def unpack(block: dict[str, np.ndarray]) -> list[tuple[list[int], list[int], list[int]]]:
    """(input_ids, labels, position_ids) of each document in one packed row, by seq id."""
    seq = block["seq_ids"]
    docs = []
    for d in range(seq.max() + 1):
        where = np.flatnonzero(seq == d)
        assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous
        docs.append(tuple(block[k][where].tolist() for k in ("input_ids", "labels", "position_ids")))
    return docs


def test_blocks_hold_every_example_once_in_order():
    max_len = 32
    lengths = [5, 17, 3, 32, 9, 40, 1, 12, 20, 7]  # 40 > max_len: truncated
    examples = random_examples(lengths)
    packed = pack_examples(examples, max_len, PAD)

    assert all(v.shape == (len(packed["seq_ids"]), max_len) for v in packed.values())
    found = []
    for row in range(len(packed["seq_ids"])):
        block = {k: v[row] for k, v in packed.items()}
        for ids, labels, positions in unpack(block):
            assert positions == list(range(len(ids)))  # restart at 0 per document
            assert labels[0] == IGNORE_INDEX  # never predicted from the previous document
            found.append((ids, labels[1:]))
        pad = block["seq_ids"] == -1
        assert (block["input_ids"][pad] == PAD).all() and (block["labels"][pad] == IGNORE_INDEX).all()
    expected = [(ids[:max_len], labels[1:max_len]) for ids, labels in examples]
    assert sorted(found) == sorted(expected)  # each example exactly once, tokens in order
    assert len(packed["seq_ids"]) == -(-sum(min(n, max_len) for n in lengths) // max_len)  # 4: optimal here


def test_first_fit_decreasing_is_optimal_on_a_known_case():
    # Total 30 = 3 full bins of 10; packing in arrival order (next-fit) needs 5.
    lengths = [2, 5, 4, 7, 1, 3, 8]
    bins = first_fit_decreasing(lengths, capacity=10)
    assert len(bins) == 3
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) == 10 for b in bins)


def test_packing_efficiency():
    packed = pack_examples(random_examples([6, 6, 10]), max_len=10, pad_token_id=PAD)
    assert len(packed["seq_ids"]) == 3  # 6 + 6 > 10
    assert packing_efficiency(packed["seq_ids"]) == pytest.approx(22 / 30)
    assert packing_efficiency(torch.as_tensor(packed["seq_ids"])) == pytest.approx(22 / 30)


def tiny_llama(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config).eval()


def per_document_loss(logits: torch.Tensor, labels: torch.Tensor, seq_ids: torch.Tensor, n_docs: int) -> list[float]:
    return [causal_lm_loss(logits, labels.masked_fill(seq_ids != d, IGNORE_INDEX))[0].item() for d in range(n_docs)]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_loss_equals_each_document_alone(attn_implementation):
    model = tiny_llama(attn_implementation)
    examples = random_examples([9, 14, 5, 11], seed=1)
    packed = {k: torch.as_tensor(v) for k, v in pack_examples(examples, max_len=48, pad_token_id=PAD).items()}
    assert packed["seq_ids"].shape == (1, 48) and (packed["seq_ids"] == -1).any()  # one row, with padding

    with torch.no_grad():
        alone = [
            causal_lm_loss(model(input_ids=torch.tensor([ids])).logits, torch.tensor([labels]))[0].item()
            for ids, labels in examples
        ]
        logits = model(**packed_model_inputs(packed, attn_implementation)).logits
        # Plain causal attention over the whole row (a 2D mask turns off transformers'
        # own packed-sequence detection): later documents see earlier ones.
        leaky = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"],
            attention_mask=torch.ones_like(packed["input_ids"]),
        ).logits

    # Document order inside a block is input order, so doc d of the row is examples[d].
    packed_losses = per_document_loss(logits, packed["labels"], packed["seq_ids"], len(examples))
    np.testing.assert_allclose(packed_losses, alone, rtol=0, atol=1e-4)
    total, n_targets = causal_lm_loss(logits, packed["labels"])  # no loss across boundaries
    assert total.item() == pytest.approx(sum(alone), abs=1e-3)
    assert n_targets.item() == sum(sum(lab != IGNORE_INDEX for lab in labels[1:]) for _, labels in examples)

    leaky_losses = per_document_loss(leaky, packed["labels"], packed["seq_ids"], len(examples))
    assert leaky_losses[0] == pytest.approx(alone[0], abs=1e-4)  # the first document has nothing before it
    assert all(abs(a - b) > 1e-3 for a, b in zip(leaky_losses[1:], alone[1:]))


def test_pack_dataset_on_ray(ray_cluster):
    import ray.data

    max_len = 64
    lengths = np.random.default_rng(2).integers(1, 50, size=60).tolist() + [80]  # one truncated
    examples = random_examples(lengths, seed=3)
    ds = ray.data.from_items(
        [{"input_ids": np.asarray(i, dtype=np.int64), "labels": np.asarray(lab, dtype=np.int64)} for i, lab in examples]
    )
    rows = pack_dataset(ds, max_len, PAD, window_rows=16).take_all()

    assert set(rows[0]) == {"input_ids", "labels", "position_ids", "seq_ids"}
    assert all(row[k].shape == (max_len,) for row in rows for k in row)
    seq_ids = np.stack([row["seq_ids"] for row in rows])
    assert (seq_ids != -1).sum() == sum(min(n, max_len) for n in lengths)
    found = sorted(ids for row in rows for ids, _, _ in unpack(row))
    assert found == sorted(ids[:max_len] for ids, _ in examples)
    assert packing_efficiency(seq_ids) > 0.8
