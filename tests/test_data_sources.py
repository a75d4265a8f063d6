"""Data sources and mixing: JSONL/Parquet files, directories, globs and URIs; bad rows; weighted mixtures."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlplat.config import validate
from mlplat.data.ingest import DataConfig, prepare_rows
from mlplat.data.sft import SFTDataConfig
from mlplat.data.sources import MIN_BLOCK_BYTES, STREAM_BLOCK_BYTES, SourceConfig, block_cap, list_files, read_source
from mlplat.errors import ConfigError, DataError


def chat(tag: str, i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{tag} {i}"}, {"role": "assistant", "content": str(i)}]}


def write_jsonl(path, lines: list) -> None:
    """Rows as JSON lines; strings are written verbatim (to plant bad lines)."""
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write(text)


def write_parquet(path, rows: list[dict]) -> None:
    # pa.array infers one struct type from every row (from_pylist would use only the first row's keys).
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)


def read_rejects(out_dir) -> list[dict]:
    return [json.loads(line) for f in sorted((out_dir / "rejects").glob("*.json")) for line in f.read_text().splitlines()]


def read_all(cfg: DataConfig, tmp_path, task="chat"):
    dataset, report = prepare_rows(cfg, task, tmp_path / "out")
    return [json.loads(r["text"]) for r in dataset.iter_rows()], report


# A tool-calling conversation: in Parquet its assistant turn has content null and the
# plain rows have tool_calls null; both nulls must vanish so both rows validate.
TOOL_CHAT = {
    "messages": [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ],
    "tools": [{"type": "function", "function": {"name": "add", "description": "a + b"}}],
}


@pytest.fixture
def data_dir(tmp_path):
    """a.jsonl (30), b.parquet (20 incl. a tool call), sub/c.jsonl.gz (10), plus files that are never data."""
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    write_jsonl(root / "a.jsonl", [chat("a", i) for i in range(30)])
    write_parquet(root / "b.parquet", [TOOL_CHAT] + [chat("b", i) for i in range(19)])
    write_jsonl(root / "sub" / "c.jsonl.gz", [chat("c", i) for i in range(10)])
    (root / "_SUCCESS").write_text("")  # Spark/Hadoop marker: skipped
    (root / ".a.jsonl.crc").write_text("x")  # hidden: skipped
    return root


def canonical(rows: list[dict]) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def test_files_directories_globs_and_uris(ray_cluster, data_dir, tmp_path):
    cases = {
        str(data_dir / "a.jsonl"): ["a.jsonl"],
        str(data_dir): ["a.jsonl", "b.parquet", "c.jsonl.gz"],  # recursive, both formats, markers skipped
        str(data_dir / "**" / "*.jsonl*"): ["a.jsonl", "c.jsonl.gz"],  # ** spans zero or more directories
        str(data_dir / "*.parquet"): ["b.parquet"],
        (data_dir / "sub").as_uri(): ["c.jsonl.gz"],
    }
    for path, names in cases.items():
        assert [f.rsplit("/", 1)[-1] for f, _ in list_files(SourceConfig(path=path)).files] == names, path

    rows, report = read_all(DataConfig(path=data_dir.as_uri()), tmp_path)  # a directory as a file:// URI
    assert report.rows_read == report.rows_used == len(rows) == 60 and report.bad_rows == 0
    assert report.sources[0].files == 3
    # Every row exactly once, Parquet rows as they were written (nulls of the unified struct
    # dropped, so the tool call and the plain rows both validate), .gz decompressed.
    written = [chat("a", i) for i in range(30)] + [TOOL_CHAT] + [chat("b", i) for i in range(19)] + [chat("c", i) for i in range(10)]
    assert canonical(rows) == canonical(written)

    rows, report = read_all(DataConfig(path=str(data_dir / "**" / "*.jsonl*")), tmp_path)  # a glob through Ray
    assert canonical(rows) == canonical([chat("a", i) for i in range(30)] + [chat("c", i) for i in range(10)])


def test_bad_rows_in_each_format_are_rejected_with_reasons(ray_cluster, tmp_path):
    jsonl, parquet = tmp_path / "chat.jsonl", tmp_path / "chat.parquet"
    write_jsonl(jsonl, [chat("a", 0), "{not json", "", {"text": "no messages"}, chat("a", 1)])  # line 3 is blank
    bad_role = {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "1"}]}
    no_answer = {"messages": [{"role": "user", "content": "q"}]}
    write_parquet(parquet, [chat("b", 0), bad_role, chat("b", 1), no_answer])
    cfg = DataConfig(sources=[SourceConfig(path=str(jsonl)), SourceConfig(path=str(parquet))])

    rows, report = read_all(cfg, tmp_path)
    assert len(rows) == report.rows_used == 4
    assert report.rows_read == 8 and report.bad_rows == 4
    assert [(s.rows_read, s.bad_rows) for s in report.sources] == [(4, 2), (4, 2)]
    assert report.bad_rows_by_reason == {
        "not valid JSON": 1,
        "missing field 'messages'": 1,
        "messages[i].role must be one of ['system', 'user', 'assistant', 'tool']": 1,
        "no assistant message": 1,
    }
    rejects = read_rejects(tmp_path / "out")
    found = {(r["path"].rsplit("/", 1)[-1], r["row"]): r["error"] for r in rejects}
    assert set(found) == {("chat.jsonl", 2), ("chat.jsonl", 4), ("chat.parquet", 2), ("chat.parquet", 4)}  # file line / row
    assert found[("chat.jsonl", 2)].startswith("not valid JSON") and found[("chat.parquet", 2)].startswith("messages[0].role")
    assert json.loads(next(r["text"] for r in rejects if r["row"] == 2 and r["path"].endswith("parquet"))) == bad_role

    # A rerun into the same directory replaces the rejects instead of appending to them.
    prepare_rows(cfg, "chat", tmp_path / "out")
    assert len(read_rejects(tmp_path / "out")) == 4

    with pytest.raises(DataError, match=r"chat\.(jsonl|parquet): row \d: .*\(4 bad rows; set data.on_bad_row=skip"):
        prepare_rows(cfg.model_copy(update={"on_bad_row": "fail"}), "chat", tmp_path / "fail")


def test_missing_paths_and_unknown_formats_are_named(tmp_path):
    (tmp_path / "rows.csv").write_text("a,b\n")
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "ok.jsonl", [chat("a", 0)])
    (tmp_path / "mixed" / "notes.txt").write_text("not data")
    cases = {
        str(tmp_path / "nope.jsonl"): "nope.jsonl: data path not found",
        (tmp_path / "nope").as_uri(): "nope: data path not found",
        str(tmp_path / "rows.csv"): r"rows.csv: unknown data file extension \(supported: .jsonl",
        str(tmp_path / "mixed"): "notes.txt: unknown data file extension",  # nothing in a directory is skipped unnoticed
        str(tmp_path / "*.parquet"): r"\*.parquet: no data files match \(supported",
    }
    for path, message in cases.items():
        with pytest.raises(DataError, match=message):
            list_files(SourceConfig(path=path))
    # prepare_rows checks every source before any Ray work (no ray_cluster needed to fail).
    with pytest.raises(DataError, match="rows.csv: unknown data file extension"):
        prepare_rows(DataConfig(sources=[SourceConfig(path=str(tmp_path / "mixed" / "ok.jsonl")), SourceConfig(path=str(tmp_path / "rows.csv"))]), "chat", tmp_path)
    # An explicit format reads files whatever their names.
    assert list_files(SourceConfig(path=str(tmp_path / "rows.csv"), format="jsonl")).files[0][1] == "jsonl"


@pytest.mark.parametrize(
    "data, message",
    [
        ({}, "give either data.path"),
        ({"path": "/a.jsonl", "sources": [{"path": "/b.jsonl"}]}, "give either data.path"),
        ({"sources": [{"path": "/a.jsonl", "weight": 1}, {"path": "/b.jsonl"}]}, "give every source a weight, or none"),
        ({"sources": [{"path": "/a.jsonl", "weight": 0}]}, r"sources.0.weight: Input should be greater than 0"),
        ({"sources": [{"path": "/a.jsonl", "wieght": 1}]}, "sources.0.wieght: unknown field"),
    ],
)
def test_source_config_errors_are_named(data, message):
    with pytest.raises(ConfigError, match=message):
        validate(SFTDataConfig, data, "data")


def mixture(tmp_path, weights, seed=0):
    """chat.jsonl (3000 rows) and math.parquet (2000 rows) mixed by ``weights``; the sources of the rows in stream order."""
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path / "chat.jsonl"), weight=weights[0]), SourceConfig(path=str(tmp_path / "math.parquet"), weight=weights[1])],
        seed=seed,
    )
    rows, report = read_all(cfg, tmp_path)
    return [r["messages"][0]["content"] for r in rows], report


def test_weighted_mixture_matches_weights_deterministically(ray_cluster, tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", [chat("chat", i) for i in range(3000)])
    write_parquet(tmp_path / "math.parquet", [chat("math", i) for i in range(2000)])

    rows, report = mixture(tmp_path, (0.7, 0.3))
    # Largest mixture without repeats: all 3000 chat rows, 3000 * 3/7 ~ 1286 math rows.
    assert [s.fraction for s in report.sources] == pytest.approx([1.0, 1286 / 2000], abs=1e-3)
    assert abs(len(rows) - report.rows_used) < 100  # Bernoulli noise on the math rows: sd ~ 17
    share = sum(r.startswith("chat") for r in rows) / len(rows)
    assert share == pytest.approx(0.7, abs=0.02)
    assert len(set(rows)) == len(rows)  # no row twice
    # Interleaved, not concatenated: every quarter of the stream holds the mixture too.
    quarter = len(rows) // 4
    for q in range(4):
        part = rows[q * quarter : (q + 1) * quarter]
        assert sum(r.startswith("chat") for r in part) / len(part) == pytest.approx(0.7, abs=0.1), q

    again, _ = mixture(tmp_path, (0.7, 0.3))
    assert sorted(again) == sorted(rows)  # same seed: the same rows
    other, _ = mixture(tmp_path, (0.7, 0.3), seed=1)
    assert sorted(other) != sorted(rows)  # another seed: another subsample of math ...
    assert sum(r.startswith("chat") for r in other) / len(other) == pytest.approx(0.7, abs=0.02)  # ... same mixture

    rows, report = mixture(tmp_path, (1, 3))  # now chat is subsampled: 2000 math rows, ~667 chat rows
    assert [s.fraction for s in report.sources] == pytest.approx([2000 / 3 / 3000, 1.0], abs=1e-3)
    assert sum(r.startswith("math") for r in rows) / len(rows) == pytest.approx(0.75, abs=0.02)


def test_unweighted_sources_use_every_row(ray_cluster, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [chat("a", i) for i in range(300)])
    write_parquet(tmp_path / "b.parquet", [chat("b", i) for i in range(100)])
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "a.jsonl")), SourceConfig(path=str(tmp_path / "b.parquet"))])
    rows, report = read_all(cfg, tmp_path)
    assert len(rows) == report.rows_used == 400 and [s.share for s in report.sources] == [0.75, 0.25]


def test_reads_hand_on_small_blocks_without_touching_the_global_context(ray_cluster, tmp_path):
    # Ray Data hands a task's output on only when a block is full (128 MiB by default) or the task
    # ends: on a large file a tokenizer task would hold back every row it tokenized until its end.
    import ray.data

    write_jsonl(tmp_path / "a.jsonl", [chat("a", i) for i in range(10)])
    default = ray.data.DataContext.get_current().target_max_block_size
    dataset = read_source(SourceConfig(path=str(tmp_path / "a.jsonl")), 0)
    assert dataset.context.target_max_block_size == STREAM_BLOCK_BYTES < default
    assert ray.data.DataContext.get_current().target_max_block_size == default  # the caller's own datasets keep theirs
    assert dataset.count() == 10


def test_blocks_shrink_with_a_small_object_store():
    # With a 75 MiB store, 4 MiB blocks spilled ~500 MiB in the data benchmark; 1/64 of it did not.
    assert block_cap(7 << 30) == STREAM_BLOCK_BYTES
    assert block_cap(75 << 20) == (75 << 20) // 64 < STREAM_BLOCK_BYTES
    assert block_cap(16 << 20) == MIN_BLOCK_BYTES  # per-block overhead dominates below this
