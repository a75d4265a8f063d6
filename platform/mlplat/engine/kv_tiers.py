"""Tiers below the prefix cache: host memory, then local disk (EngineConfig.kv_tiers).

The KV pool holds what fits; a hashed block that the pool evicts (``BlockManager.allocate_slots`` reusing it) is
copied to host memory first, and what falls out of host memory (LRU) is written to disk by a background thread, so
the engine loop never waits on a disk write (a load from disk is read on the loop, at the prompt's admission). A prompt whose prefix continues in a tier loads those blocks back into fresh
pool blocks instead of recomputing them. As LMCache and Mooncake do for vLLM, blocks are keyed by the chained block
hash the prefix cache uses, so a tier never needs to know tokens, adapters or sequences.

Capture is on eviction, not on every block computed (write-through): a block the pool keeps until it is freed costs
nothing, and the pool's own LRU picks what goes down, so the tiers hold what the pool could not.

On disk each block is one file: a header (magic, block hash, payload size, CRC32 of the payload) then the block's KV
as it lies in the pool, every layer's K and V. A file that is missing, short, for another hash or whose checksum
fails is dropped on load and its tokens recomputed: a tier never serves KV it cannot vouch for. Each engine writes
under a directory of its own (removed at exit), so engines sharing ``disk_path`` never read each other's blocks, and
a restarted engine (maybe with other weights) never reads its predecessor's.
"""

from __future__ import annotations

import os
import queue
import shutil
import struct
import tempfile
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from mlplat.engine.config import KVTiersConfig

HEADER = struct.Struct("<8sQQI")  # magic, block hash, payload bytes, CRC32 of the payload
MAGIC = b"MLPLKV01"
MAX_PENDING_WRITES = 64  # blocks queued for the disk writer; beyond it a block leaving host memory is dropped, not queued


def _record_nothing(kind: str, h: int) -> None:
    pass


class HostTier:
    """A fixed slab of ``capacity`` block slots in host memory (pinned when the pool is on a GPU), LRU over hashes."""

    def __init__(self, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool):
        self.capacity = capacity
        self.slab = torch.empty((capacity, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.slots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.free_slots = list(range(capacity - 1, -1, -1))
        # CUDA: the device-to-host copy into each slot, which host-side readers of the slot wait for
        self.copied: dict[int, torch.cuda.Event] = {}

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.slab[0].nbytes

    def __contains__(self, h: int) -> bool:
        return h in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def get(self, h: int) -> torch.Tensor | None:
        slot = self.slots.get(h)
        if slot is None:
            return None
        self.slots.move_to_end(h)
        return self.slab[slot]

    def put(self, h: int, kv: torch.Tensor) -> None:
        assert h not in self.slots and self.free_slots, "the caller makes room first"
        slot = self.free_slots.pop()
        self.slab[slot].copy_(kv, non_blocking=kv.is_cuda)  # on CUDA: ordered before the kernels that overwrite the block
        if kv.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self.copied[slot] = event
        self.slots[h] = slot

    def pop_lru(self) -> tuple[int, torch.Tensor]:
        """The least recently used block, out of the tier: its hash and a host copy it no longer owns."""
        h, slot = self.slots.popitem(last=False)
        event = self.copied.pop(slot, None)
        if event is not None:
            event.synchronize()
        self.free_slots.append(slot)
        return h, self.slab[slot].clone()

    def clear(self) -> None:
        self.slots.clear()
        self.copied.clear()
        self.free_slots = list(range(self.capacity - 1, -1, -1))


class DiskTier:
    """One checksummed file per block under a private directory, LRU over at most ``capacity_bytes``; writes run on a
    background thread. The index (what is on disk or queued for it) changes on the engine thread only; the writer
    checks under ``lock`` that a block is still wanted before it puts the file in place."""

    def __init__(self, root: Path, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype):
        root.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="kv-tier-", dir=root))
        self.block_shape, self.dtype = block_shape, dtype
        self.payload_bytes = torch.Size(block_shape).numel() * dtype.itemsize
        self.file_bytes = HEADER.size + self.payload_bytes
        self.capacity_bytes = capacity_bytes
        self.files: OrderedDict[int, None] = OrderedDict()  # block hash -> on disk or queued, least recently used first
        self.pending: dict[int, torch.Tensor] = {}  # queued, not yet in place: loads read these from memory
        self.lock = threading.Lock()
        self.generation = 0  # bumped by clear(): writes queued before it are discarded
        self.writes: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=_write_blocks, args=(self.writes, weakref.proxy(self)), daemon=True,
                                       name="kv-tier-writer")  # fmt: skip
        self.writer.start()
        self._finalizer = weakref.finalize(self, _shut_down, self.writes, self.writer, self.dir)

    @property
    def nbytes(self) -> int:
        return len(self.files) * self.file_bytes

    def __contains__(self, h: int) -> bool:
        return h in self.files

    def path(self, h: int) -> Path:
        return self.dir / f"{h:016x}.kv"

    def put(self, h: int, kv: torch.Tensor) -> list[int]:
        """Queue ``kv`` (a host tensor the tier now owns) for writing; the hashes this drops (LRU, or ``h`` itself when
        the writer is MAX_PENDING_WRITES behind)."""
        if h in self.files:
            self.files.move_to_end(h)
            return []
        if len(self.pending) >= MAX_PENDING_WRITES:
            return [h]
        with self.lock:
            self.files[h] = None
            self.pending[h] = kv
        self.writes.put((self.generation, h, kv))
        dropped = []
        while self.nbytes > self.capacity_bytes:
            dropped.append(self._drop_lru())
        return dropped

    def _drop_lru(self) -> int:
        h = next(iter(self.files))
        self.drop(h)
        return h

    def drop(self, h: int) -> None:
        with self.lock:
            self.files.pop(h, None)
            self.pending.pop(h, None)
            self.path(h).unlink(missing_ok=True)

    def read(self, h: int) -> torch.Tensor | None:
        """The block's KV, or None (the entry dropped) when its file is missing, short, for another hash or corrupt."""
        if h not in self.files:
            return None
        self.files.move_to_end(h)
        with self.lock:
            queued = self.pending.get(h)
        if queued is not None:
            return queued
        kv = torch.empty(self.block_shape, dtype=self.dtype)
        payload = kv.view(-1).view(torch.uint8).numpy()
        try:
            with open(self.path(h), "rb", buffering=0) as f:
                magic, stored_hash, size, crc = HEADER.unpack(f.read(HEADER.size))
                ok = magic == MAGIC and stored_hash == h and size == self.payload_bytes and f.readinto(payload) == size
        except (OSError, struct.error):
            ok = False
        if not ok or zlib.crc32(payload) != crc:
            self.drop(h)
            return None
        return kv

    def clear(self) -> None:
        with self.lock:
            self.generation += 1
            self.files.clear()
            self.pending.clear()
            for path in self.dir.glob("*.kv"):
                path.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued write is in place (tests, benchmarks)."""
        self.writes.join()

    def close(self) -> None:
        self._finalizer()


def _write_blocks(writes: queue.Queue, disk: DiskTier) -> None:
    """The disk writer. Holds only a weak proxy of the tier, so an engine going away takes its tier with it (the
    tier's finalizer stops this thread)."""
    while (item := writes.get()) is not None:
        try:
            _write_block(disk, *item)
        except ReferenceError:  # the tier is gone
            pass
        finally:
            writes.task_done()
    writes.task_done()


def _write_block(disk: DiskTier, generation: int, h: int, kv: torch.Tensor) -> None:
    """Checksum and write one block to a temporary file, then move it in place if the block is still wanted (not
    dropped or cleared meanwhile). A failed write (disk full) leaves no file: a load finds none and recomputes."""
    payload = kv.view(-1).view(torch.uint8).numpy()
    tmp = disk.dir / f"{h:016x}.tmp"
    try:
        with open(tmp, "wb", buffering=0) as f:
            f.write(HEADER.pack(MAGIC, h, payload.nbytes, zlib.crc32(payload)))
            f.write(payload)
        written = True
    except OSError:
        written = False
    with disk.lock:
        if written and generation == disk.generation and h in disk.files:
            os.replace(tmp, disk.path(h))
        else:
            tmp.unlink(missing_ok=True)
        if disk.pending.get(h) is kv:
            del disk.pending[h]


def _shut_down(writes: queue.Queue, writer: threading.Thread, directory: Path) -> None:
    writes.put(None)
    if writer is not threading.current_thread():
        writer.join(timeout=10)
    shutil.rmtree(directory, ignore_errors=True)


class TieredKVCache:
    """Host and disk tiers under one engine's KV pool (``kv_cache``: [layers, 2, blocks, block_size, kv_heads, head_dim]).

    ``record(kind, h)`` reports a block entering the tiers (``"offloaded"``) or leaving them (``"dropped"``), for the
    KV-event index; moving between host and disk is not reported (the replica still holds it)."""

    def __init__(self, cfg: KVTiersConfig, kv_cache: torch.Tensor, record: Callable[[str, int], None] = _record_nothing):
        self.kv_cache = kv_cache
        block_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        self.block_bytes = torch.Size(block_shape).numel() * kv_cache.element_size()
        if cfg.host_bytes < self.block_bytes:
            raise ValueError(f"kv_tiers.host_bytes ({cfg.host_bytes}) is under one KV block of this model ({self.block_bytes} bytes): "
                             f"set it to at least {self.block_bytes}, or remove kv_tiers")
        self.host = HostTier(cfg.host_bytes // self.block_bytes, block_shape, kv_cache.dtype, pin_memory=kv_cache.is_cuda)
        self.disk: DiskTier | None = None
        if cfg.disk_path is not None:
            if cfg.disk_bytes < HEADER.size + self.block_bytes:
                raise ValueError(f"kv_tiers.disk_bytes ({cfg.disk_bytes}) is under one block file ({HEADER.size + self.block_bytes} "
                                 f"bytes): set it to at least {HEADER.size + self.block_bytes}, or remove disk_path")
            try:
                self.disk = DiskTier(cfg.disk_path, cfg.disk_bytes, block_shape, kv_cache.dtype)
            except OSError as err:
                raise ValueError(f"kv_tiers.disk_path {str(cfg.disk_path)!r}: cannot make a directory there ({err.strerror}): "
                                 "give a writable local directory") from None
        self.record = record
        # counters: blocks offloaded from the pool, blocks loaded back (from host, from disk), loads refused (missing, corrupt)
        self.num_offloaded = self.num_host_loads = self.num_disk_loads = self.num_failed_loads = 0
        self.disk_load_s = 0.0  # time spent reading blocks from disk (benchmarks/kv_tiers.py's tier_load_gb_s)

    def __contains__(self, h: int) -> bool:
        return h in self.host or (self.disk is not None and h in self.disk)

    @property
    def capacity_blocks(self) -> int:
        return self.host.capacity + (self.disk.capacity_bytes // self.disk.file_bytes if self.disk is not None else 0)

    def hashes(self) -> list[int]:
        """Every block hash the tiers hold."""
        on_disk = [h for h in self.disk.files if h not in self.host] if self.disk is not None else []
        return [*self.host.slots, *on_disk]

    def offload(self, h: int, block_id: int) -> None:
        """Keep pool block ``block_id`` (hash ``h``), about to be reused, in host memory."""
        if h in self.host:
            self.host.get(h)  # refresh its LRU position
            return
        if not self.host.free_slots:
            self._demote(*self.host.pop_lru())
        new = h not in self  # else on disk already: the replica still holds it
        self.host.put(h, self.kv_cache[:, :, block_id])
        self.num_offloaded += 1
        if new:
            self.record("offloaded", h)

    def _demote(self, h: int, kv: torch.Tensor) -> None:
        """A block leaving host memory: to disk if there is one (which may drop others), else out of the tiers."""
        dropped = self.disk.put(h, kv) if self.disk is not None else [h]
        for gone in dropped:
            if gone not in self:
                self.record("dropped", gone)

    def touch(self, hashes: Iterable[int]) -> None:
        """Make ``hashes`` the most recently used, the last one most: blocks about to be loaded, which the pool's
        evictions for the same admission must not push out of host memory first."""
        for h in hashes:
            if h in self.host:
                self.host.get(h)
            elif self.disk is not None and h in self.disk:
                self.disk.files.move_to_end(h)

    def load(self, h: int, block_id: int) -> bool:
        """Write block ``h``'s KV into pool block ``block_id``; False (nothing written) when no tier can serve it."""
        kv = self.host.get(h)
        if kv is not None:
            self.num_host_loads += 1
        elif self.disk is not None and h in self.disk:
            start = time.perf_counter()
            kv = self.disk.read(h)
            self.disk_load_s += time.perf_counter() - start
            if kv is None:  # missing or corrupt: dropped, and recomputed by the caller
                self.num_failed_loads += 1
                self.record("dropped", h)
                return False
            self.num_disk_loads += 1
        else:
            self.num_failed_loads += 1
            return False
        self.kv_cache[:, :, block_id].copy_(kv, non_blocking=self.kv_cache.is_cuda)
        return True

    def clear(self) -> None:
        """Forget every block (new weights made them stale); the caller reports it (a "cleared" event)."""
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def check_invariants(self) -> None:
        assert len(self.host) + len(self.host.free_slots) == self.host.capacity, "host slots leaked"
        assert len(set(self.host.slots.values())) == len(self.host), "two blocks in one host slot"
        if self.disk is not None:
            disk = self.disk
            assert disk.nbytes <= disk.capacity_bytes, f"disk tier over its bound: {disk.nbytes} > {disk.capacity_bytes}"

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
