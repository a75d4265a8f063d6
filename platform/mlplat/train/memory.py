"""Memory checks for training steps: the largest vocabulary-sized tensor a step creates.

A full-vocabulary logit tensor for the whole batch ([B, L, V] in fp32) is the first thing that
runs a real model out of memory in post-training (64 completions x 1k tokens x 152k vocabulary
is ~40 GB). ``VocabTensorWatch`` records, under a ``TorchDispatchMode``, every tensor an
operation returns that has a dimension of the vocabulary's size, so a test or a benchmark can
say how many rows of logits it held at most (forward and backward alike). The vocabulary-by-hidden
matrices (the embedding and head weight, its gradient, optimizer state, their transposes) are
parameters, not logits, and are left out.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class VocabTensorWatch(TorchDispatchMode):
    """Records the largest tensor with a vocabulary-sized dimension that any op returns, in rows of the vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.parameter_shapes = {(vocab_size, hidden_size), (hidden_size, vocab_size), (vocab_size,)}
        self.largest_rows = 0  # elements / vocab_size of the largest such tensor
        self.largest_shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor) or self.vocab_size not in value.shape or tuple(value.shape) in self.parameter_shapes:
                continue
            rows = value.numel() // self.vocab_size
            if rows > self.largest_rows:
                self.largest_rows, self.largest_shape = rows, tuple(value.shape)
        return out
