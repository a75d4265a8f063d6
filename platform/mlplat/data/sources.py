"""Data sources: JSONL and Parquet files, directories and globs, local or any pyarrow URI.

Every source is normalised to rows of ``{"text": <the row as JSON>, "path": <file>,
"row": <1-based row in the file>, "source": <index in the config>}`` so one set of
validators, one rejects file and one tokenizer serve every format. For JSONL the raw
line is the row (a line that is not JSON is a bad row, not a crash; ``row`` is the
line number, blank lines skipped but counted); for Parquet each row is serialised to
JSON, dropping null struct fields (Parquet cannot tell a missing field from a null
one, and the validators treat absent optional fields as absent).

Files are listed on the driver through the same pyarrow filesystem Ray Data uses
(``s3://``, ``gs://``, ``hdfs://``, ``file://`` or a plain local path), so a bad path or
extension fails before any work starts, and are read by one Ray Data datasource
(``RowsDatasource``, a ``FileBasedDatasource``: one streaming read per file, retries
and compression as Ray does them). Not ``read_parquet``: in Ray 2.60 it starts a pool
of footer-reader actors on every read, seconds per dataset on a small cluster, for
metadata this pipeline never uses.
"""

from __future__ import annotations

import json
import os
from datetime import date, datetime, time
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray.data
from pydantic import Field
from ray.data.datasource import FileBasedDatasource

from mlplat.config import Config
from mlplat.errors import DataError

Format = Literal["jsonl", "parquet"]
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2")  # Ray Data decompresses by suffix
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = "supported: .jsonl (also .jsonl.gz/.zst/.bz2) and .parquet files, a directory of them, or a glob"
GLOB_CHARS = "*?["
STREAM_BLOCK_BYTES = 4 << 20  # block size of every dataset read here (see _cap_block_size)
MIN_BLOCK_BYTES = 1 << 20  # ... on a cluster whose object store is under 64x STREAM_BLOCK_BYTES


class SourceConfig(Config):
    path: str  # a file, a directory (searched recursively), or a glob; local or any pyarrow filesystem URI
    weight: float | None = Field(default=None, gt=0)  # share of the mixture (see mlplat.data.ingest)
    format: Format | None = None  # default: from each file's extension; set it for files without one


class Listing(NamedTuple):
    fs: pafs.FileSystem
    prefix: str  # prepended to a path inside ``fs`` gives it back in the user's form (``s3://``, ``file://``)
    files: list[tuple[str, Format]]  # (path inside ``fs``, format), sorted


def file_format(path: str, forced: Format | None = None) -> Format:
    """The format of one file from its extension (or ``forced``); DataError if unknown."""
    if forced:
        return forced
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise DataError(f"{path}: unknown data file extension ({SUPPORTED}; or set the source's format: jsonl|parquet)")


def _hidden(rel_path: str) -> bool:
    # Spark/Hadoop write _SUCCESS, .crc and _metadata files next to the data; never rows.
    return any(part.startswith((".", "_")) for part in rel_path.split("/"))


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Shell-style match of path components; ``**`` matches any number of directories."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pattern[0]) and _glob_match(parts[1:], pattern[1:])


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path inside it, prefix that turns such a path back into the user's URI form)."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri), ""
    try:
        fs, inner = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{uri}: cannot open this filesystem URI ({err})") from None
    prefix = uri[: len(uri) - len(inner)] if uri.endswith(inner) else ""
    return fs, inner, prefix


def list_files(source: SourceConfig) -> Listing:
    """The source's data files and their formats; DataError naming the path if there are none.

    Names starting with ``.`` or ``_`` inside a directory or glob are skipped
    (metadata such as ``_SUCCESS`` or ``.crc``); any other file must have a known
    extension, so no data is left out unnoticed.
    """
    path = source.path.rstrip("/") or "/"
    glob_at = min((path.find(c) for c in GLOB_CHARS if c in path), default=-1)
    if glob_at >= 0:
        cut = path.rfind("/", 0, glob_at)  # the pattern starts at the component holding the first wildcard
        base, pattern = (path[:cut] or "/", path[cut + 1 :]) if cut >= 0 else (".", path)
        fs, root, prefix = _filesystem(base)
    else:
        pattern = None
        fs, root, prefix = _filesystem(path)
    try:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{source.path}: data path not found ({SUPPORTED})")
        if info.type == pafs.FileType.File and pattern is None:
            return Listing(fs, prefix, [(root, file_format(prefix + root, source.format))])
        found = []
        for entry in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
            rel = entry.path[len(root) :].lstrip("/")
            if entry.type != pafs.FileType.File or _hidden(rel):
                continue
            if pattern is None or _glob_match(rel.split("/"), pattern.split("/")):
                found.append(entry.path)
    except OSError as err:
        raise DataError(f"{source.path}: cannot list data files ({err})") from None
    if not found:
        raise DataError(f"{source.path}: no data files {'match' if pattern else 'in this directory'} ({SUPPORTED})")
    return Listing(fs, prefix, [(f, file_format(prefix + f, source.format)) for f in sorted(found)])


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def parquet_row_text(row: dict) -> str:
    """One Parquet row as the JSON text the validators read."""
    return json.dumps(_drop_nulls(row), ensure_ascii=False, default=_json_default)


class RowsDatasource(FileBasedDatasource):
    """Ray Data datasource: files of one format -> rows ``{"text", "path", "row", "source"}``."""

    def __init__(self, listing: Listing, fmt: Format, source: int, block_rows: int = 4096):
        paths = [f for f, f_fmt in listing.files if f_fmt == fmt]
        super().__init__(paths, filesystem=listing.fs)
        self._fmt, self._prefix, self._source, self._block_rows = fmt, listing.prefix, source, block_rows

    def _open_input_source(self, filesystem, path: str, **open_args):
        if self._fmt == "parquet":  # Parquet needs random access; JSONL streams (decompressed by suffix)
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _block(self, texts: list[str], rows: list[int], path: str) -> pa.Table:
        return pa.table(
            {
                "text": pa.array(texts, pa.string()),
                "path": pa.array([self._prefix + path] * len(texts), pa.string()),
                "row": pa.array(rows, pa.int64()),
                "source": pa.array(np.full(len(texts), self._source, dtype=np.int64)),
            }
        )

    def _read_stream(self, f, path: str):
        if self._fmt == "parquet":
            start = 1
            for batch in pq.ParquetFile(f).iter_batches(batch_size=self._block_rows):
                texts = [parquet_row_text(r) for r in batch.to_pylist()]
                yield self._block(texts, list(range(start, start + len(texts))), path)
                start += len(texts)
            return
        texts, rows, line_no, tail = [], [], 0, b""
        while True:
            chunk = f.read(1 << 22)
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop() if chunk else b""  # the last piece may continue in the next chunk
            for line in lines:
                line_no += 1
                if line.strip():
                    # Undecodable bytes become U+FFFD: the row stays visible (and usually fails validation).
                    texts.append(line.decode("utf-8", errors="replace"))
                    rows.append(line_no)
            if len(texts) >= self._block_rows or (not chunk and texts):
                yield self._block(texts, rows, path)
                texts, rows = [], []
            if not chunk:
                return


def read_source(source: SourceConfig, index: int, listing: Listing | None = None) -> ray.data.Dataset:
    """Lazy rows ``{"text", "path", "row", "source": index}`` of one source (see the module docstring).

    ``listing``: the source's ``list_files`` result, if the caller already has it.
    """
    listing = listing or list_files(source)
    parts = []
    for fmt in ("jsonl", "parquet"):
        if any(f_fmt == fmt for _, f_fmt in listing.files):
            try:
                parts.append(ray.data.read_datasource(RowsDatasource(listing, fmt, index)))
            except (OSError, ValueError) as err:
                raise DataError(f"{source.path}: cannot read {fmt} files ({err})") from None
    for part in parts:
        _cap_block_size(part.context)
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


def block_cap(object_store_bytes: int) -> int:
    """Block size for a cluster with this object store: ``STREAM_BLOCK_BYTES``, or 1/64 of the
    store where that is smaller, never below ``MIN_BLOCK_BYTES`` (see ``_cap_block_size``)."""
    return max(MIN_BLOCK_BYTES, min(STREAM_BLOCK_BYTES, object_store_bytes // 64))


def _cap_block_size(ctx: ray.data.DataContext) -> None:
    """Cap the blocks of this dataset (and everything derived from it) at ``block_cap`` of the cluster's store.

    Ray Data merges what a task yields into blocks of up to ``target_max_block_size`` (128 MiB
    by default) and hands a block on only when it is full or the task ends. Here that made one
    block per JSONL file, which can be larger than the whole store of a small cluster (it
    spilled however the streaming executor throttled), and every row of a file was read and
    validated before the first one reached a tokenizer. Small blocks keep the executor's
    backpressure, which budgets half the store, in control and start training on the first
    rows (data benchmark, 200k rows, warm workers: first-batch wait 9.2 s with store/64 blocks,
    6.1 s with 4 MiB, 5.2 s with 1 MiB). Each block costs the executor some fixed work, so not smaller than
    needed: the same benchmark's whole pipeline (packed, on 2 cores) took 78 s with store/64
    blocks, 86 s with 4 MiB, 94 s with 2 MiB and 99 s with 1 MiB. On a small store the blocks
    shrink with it: with a 75 MiB store, 4 MiB blocks spilled ~500 MiB, ~1 MiB ones nothing.
    """
    cap = block_cap(int(ray.cluster_resources().get("object_store_memory", 0)))
    ctx.target_max_block_size = min(ctx.target_max_block_size or cap, cap)
