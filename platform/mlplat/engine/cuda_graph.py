"""Decode steps replayed from CUDA graphs (``cuda_graph_batch_sizes``, with ``attention_backend: flex``).

A decode step of a small batch is mostly kernel launches: per layer a dozen small kernels, each
waiting on the CPU to issue it. A graph captured once per batch size issues the whole forward at
once. Graphs replay fixed addresses and shapes, so a step runs on static buffers: the step's input
ids, positions, KV slots, context lengths and block tables are copied into the first rows of buffers
sized for the largest batch, the rest padded up to the next captured size, and the logits of the real
rows are sliced off. Padding rows are valid one-token sequences that write and read only a spare
block of the cache (the runner allocates it on the flex path; the block manager never hands it out).
Everything but the capture and the replay is the same on CPU, where ``capture=False`` runs the static
buffers eagerly (how the suite checks the padding).

FlexAttention builds its block masks from device tensors without reading them back
(``engine.flex``), so the masks are rebuilt inside the graph from the static buffers at each replay.
"""

from __future__ import annotations

import torch

from mlplat.engine.sequence import Sequence


class DecodeGraphs:
    def __init__(self, runner, batch_sizes: list[int], capture: bool):
        self.runner = runner
        self.sizes = sorted(set(batch_sizes))
        largest, device = self.sizes[-1], runner.device
        self.width = -(-runner.max_model_len // runner.block_size)  # block-table columns: the longest sequence's
        self.pad_block = runner.num_blocks  # the spare block past the ones the block manager hands out
        # One buffer for the per-sequence inputs, so that a step copies them in at once.
        self.inputs = torch.zeros(4, largest, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = self.inputs.unbind(0)
        self.block_tables = torch.zeros(largest, self.width, dtype=torch.long, device=device)
        self.logits_indices = torch.arange(largest, device=device)  # one row per sequence, in batch order
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self.capture()

    def fits(self, batch: list[tuple[Sequence, int]], num_logits: list[int] | None) -> bool:
        """Whether this step can run here: decodes only, one logit row each, and few enough."""
        return (
            len(batch) <= self.sizes[-1]
            and all(n == 1 and len(seq.block_table) <= self.width for seq, n in batch)
            and (num_logits is None or all(k == 1 for k in num_logits))
        )

    def forward(self, size: int) -> torch.Tensor:
        """The model on the first ``size`` rows of the static buffers: what a graph captures."""
        meta = self.runner.attention_metadata(self.slot_mapping[:size], [1] * size, self.context_lens[:size], self.block_tables[:size])
        return self.runner.model(self.input_ids[:size], self.positions[:size], self.runner.kv_caches, meta, self.logits_indices[:size])

    def run(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Logits [len(batch), V] of a decode-only step (``fits``), in batch order."""
        n, bs = len(batch), self.runner.block_size
        size = next(s for s in self.sizes if s >= n)
        rows, tables = [[], [], [], []], []
        for seq, _ in batch:
            p = seq.num_computed_tokens
            for row, value in zip(rows, (seq.token_ids[p], p, seq.block_table[p // bs] * bs + p % bs, p + 1)):
                row.append(value)
            tables.append(seq.block_table + [self.pad_block] * (self.width - len(seq.block_table)))
        for row, value in zip(rows, (0, 0, self.pad_block * bs, 1)):  # padding: token 0 at position 0 of the spare block
            row += [value] * (size - n)
        tables += [[self.pad_block] * self.width] * (size - n)
        self.inputs[:, :size].copy_(torch.tensor(rows))
        self.block_tables[:size].copy_(torch.tensor(tables))
        if size in self.graphs:
            self.graphs[size].replay()
            logits = self.outputs[size]
        else:
            logits = self.forward(size)
        return logits[:n].clone()  # the graph's output is overwritten by the next replay

    @torch.inference_mode()
    def capture(self) -> None:
        self.inputs[:] = torch.tensor([0, 0, self.pad_block * self.runner.block_size, 1], device=self.inputs.device)[:, None]
        self.block_tables.fill_(self.pad_block)
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self.forward(size)  # warm-up outside the capture: compiles FlexAttention for this shape
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
