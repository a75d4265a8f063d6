"""A training worker's view of its data shard (Ray Data's, or rows in memory): epochs, a resumable position, data-wait time.

Exact resume needs the same batches in the same order after a restart. Ray Data gives
that when the train datasets run with ``preserve_order`` (``mlplat.train.recipe.deterministic_data_config``):
the streaming split then hands blocks to workers in a fixed order (Ray drops locality
hints for it), and the local shuffle buffer is seeded per epoch. The position saved in
a checkpoint is (epoch, batches drawn in that epoch); resuming replays the epoch's
stream and discards that many batches, so nothing is trained on twice or skipped. The
discarded batches are still read and tokenized: resume costs up to one epoch of
ingestion, never training compute.

The stream starts when the loader is made, in a background thread: a recipe makes it
before building and restoring its model, so the pipeline's start-up (Ray Data's
coordinator, the first read and tokenizer tasks, replaying a resumed epoch) overlaps
that work instead of following it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from mlplat.train.worker import DataShard


class DataPosition(BaseModel):
    epoch: int = 0
    batches_in_epoch: int = 0  # batches this worker drew in the current epoch
    rows_consumed: int = 0  # rows this worker drew since the start of training


class ShardLoader:
    """Endless batches from a worker's shard, epoch after epoch, starting at ``position``."""

    def __init__(
        self,
        shard: DataShard,
        batch_size: int,
        collate_fn: Callable | None,
        seed: int,
        shuffle_buffer_batches: int = 8,
        position: DataPosition | None = None,
    ):
        self.shard, self.batch_size, self.collate_fn, self.seed = shard, batch_size, collate_fn, seed
        self.shuffle_buffer = shuffle_buffer_batches * batch_size if shuffle_buffer_batches else None
        self.position = position.model_copy() if position else DataPosition()
        self.wait_s = 0.0  # time spent blocked on the next batch, summed until read and reset by the caller
        self._batches: Iterator[dict] | None = None
        starter = ThreadPoolExecutor(1, thread_name_prefix="shard-loader-start")
        self._first: Future[dict | None] | None = starter.submit(self._start)
        starter.shutdown(wait=False)  # the submitted start still runs; the thread ends with it

    def _start(self) -> dict | None:
        self._batches = self._epoch(skip=self.position.batches_in_epoch)
        return next(self._batches, None)

    def _epoch(self, skip: int) -> Iterator[dict]:
        batches = self.shard.iter_torch_batches(
            batch_size=self.batch_size,
            collate_fn=self.collate_fn,
            drop_last=True,  # equal batch counts on every rank, so no rank waits on a missing peer
            local_shuffle_buffer_size=self.shuffle_buffer,
            local_shuffle_seed=self.seed + self.position.epoch if self.shuffle_buffer else None,
        )
        batches = iter(batches)
        for _ in range(skip):
            next(batches)
        return batches

    def next(self) -> dict:
        start = time.perf_counter()
        if self._first is not None:
            batch = self._first.result()  # raises what the start raised
            self._first = None
        else:
            batch = next(self._batches, None)
        if batch is None:  # end of the epoch: the next one starts a fresh pass over the dataset
            empty_epoch = self.position.batches_in_epoch == 0
            self.position = DataPosition(epoch=self.position.epoch + 1, rows_consumed=self.position.rows_consumed)
            self._batches = self._epoch(skip=0)
            batch = next(self._batches, None)
            if batch is None or empty_epoch:
                raise RuntimeError(
                    f"this worker's data shard has fewer than batch_size={self.batch_size} rows: "
                    "use more data, a smaller batch_size_per_worker or fewer workers"
                )
        self.position.batches_in_epoch += 1
        self.position.rows_consumed += self.batch_size
        self.wait_s += time.perf_counter() - start
        return batch
