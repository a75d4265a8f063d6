"""What a step's cache key covers, and the cache's entries (``mlplat cache ls|rm``).

A key has two levels, because which code a step runs is only known once it has run:

- the **base key**, known before the step runs: the step's own source (``code_hash``) and
  ``version``, its resolved inputs (configs as JSON, so field order does not matter), the
  content behind its path inputs (``path_fingerprints``), the registry version behind a
  ``models:/NAME@ALIAS`` input, and the versions of torch, transformers, peft and Ray;
- the **modules** the step loaded: when a step succeeds, the worker process that ran it lists
  every *project module* it has loaded (``loaded_project_modules``) with a hash of its source
  (the executor shares a worker only along a chain of steps that take each other's outputs, so
  the list can also hold an upstream step's modules: when they change, that step reruns first).
  The entry is the step's MLflow run, tagged with the base key and the full key (base +
  modules), the module list in its artifact ``mlplat/cache.json``.

A lookup finds the finished runs with the same base key, newest first, and re-hashes the
current source of each one's recorded modules: the first whose modules are all unchanged is a
hit. So editing a function the step called misses, even in a module reached through an entry
point (a recipe), while editing a module the step never loaded does not.

A *project module* is one loaded from a ``.py`` file outside the standard library and outside
any ``site-packages``/``dist-packages`` directory: mlplat (installed editable), train_apps,
serve_apps, pipelines and the pipeline file's own package. Installed libraries count through
their versions, not their files. ``mlplat.pipeline`` itself (the runner) is left out. A module
is hashed from its syntax tree, so comments and formatting do not count, and without the
functions decorated ``@step`` or ``@pipeline``: a step's own source is in its base key, and the
wiring of the pipeline reaches a step only as its inputs.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import site
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from mlplat.errors import MlplatError
from mlplat.pipeline.artifacts import Artifact, to_json

LIBRARIES = ("torch", "transformers", "peft", "ray")
BASE_TAG = "mlplat.cache.base"  # on a step run that holds a result: its base key
KEY_TAG = "mlplat.cache_key"  # ... and its full key (base + modules), set when it succeeded
REMOVED_TAG = "mlplat.cache.removed"  # when `mlplat cache rm` took the run out of the cache
ENTRY_FILE = "mlplat/cache.json"  # the entry's details: base, key, modules, what the base covered
RUNNER = "mlplat.pipeline"  # the pipeline runner's own modules are not a step's code
_MISSING = "missing"  # the hash of a module whose source cannot be found
_LOADED_AT = time.time()  # a step's worker imports this (through steps.py) before the step's own modules


# -- modules ------------------------------------------------------------------------------


@cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    dirs.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    dirs.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def is_project_file(file: str | None) -> bool:
    if not file or not file.endswith(".py"):
        return False
    real = os.path.realpath(file)
    parts = Path(real).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not real.startswith(_library_dirs())


def _is_runner(name: str) -> bool:
    return name == RUNNER or name.startswith(RUNNER + ".") or name.startswith("__")  # __main__, __mp_main__


_HASHES: dict[tuple[str, int, int], str] = {}


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def source_hash(file: str | Path) -> str:
    """A hash of a module's syntax tree without comments, layout and ``@step``/``@pipeline`` functions."""
    try:
        stat = os.stat(file)
    except OSError:
        return _MISSING
    memo = (str(file), stat.st_mtime_ns, stat.st_size)
    if memo not in _HASHES:
        data = Path(file).read_bytes()
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            text = data
        else:
            tree.body = [
                node for node in tree.body
                if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and any(_decorator_name(d) in ("step", "pipeline") for d in node.decorator_list))
            ]
            text = ast.dump(tree).encode()
        _HASHES[memo] = hashlib.sha256(text).hexdigest()[:16]
    return _HASHES[memo]


def loaded_project_modules(since: float | None = None) -> dict[str, str]:
    """``{module: source hash}`` of every project module this process has loaded (the worker's side).

    A module whose file changed after ``since`` (default: when this process loaded the runner,
    before it unpickled the step's function and arguments) may not be the code that ran: it is
    recorded as changed, so the entry never matches.
    """
    since = _LOADED_AT if since is None else since
    found: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if _is_runner(name) or not is_project_file(file):
            continue
        try:
            modified = os.stat(file).st_mtime
        except OSError:
            modified = None
        found[name] = "changed-while-loaded" if modified is None or modified > since else source_hash(file)
    return dict(sorted(found.items()))


def module_file(name: str) -> str | None:
    """Where module ``name`` would be imported from here, without importing it (the driver's side)."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None):
        return module.__file__
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name imports nothing
    except (ImportError, ValueError):
        return None
    for i in range(len(rest)):
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join([top, *rest[: i + 1]]), list(spec.submodule_search_locations))
    return spec.origin if spec is not None and spec.has_location else None


def current_module_hashes(names) -> dict[str, str]:
    return {name: source_hash(file) if (file := module_file(name)) else _MISSING for name in names}


# -- the base key -------------------------------------------------------------------------


@cache
def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _walk_artifacts(value: Any, found: list[Artifact]) -> None:
    if isinstance(value, Artifact):
        found.append(value)
    elif isinstance(value, BaseModel):
        _walk_artifacts(dict(value), found)
    elif isinstance(value, dict):
        for v in value.values():
            _walk_artifacts(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk_artifacts(v, found)


def path_fingerprints(arguments: dict[str, Any], tracking_uri: str | None = None) -> dict[str, str]:
    """``{uri: fingerprint}`` of the artifact inputs (Dataset, Checkpoint, Model, Artifact):

    - a local path (or ``file://``): a hash of its contents (names and bytes of every file);
    - another filesystem pyarrow knows (``s3://``, ``gs://``, ``hdfs://``): size and mtime of every file;
    - ``models:/NAME@ALIAS`` (or ``/latest``, a stage): the version it resolves to now;
    - ``runs:/...`` and ``models:/NAME/VERSION`` name fixed contents: the URI is enough.
    """
    found: list[Artifact] = []
    _walk_artifacts(arguments, found)
    fingerprints: dict[str, str] = {}
    for artifact in found:
        uri = artifact.uri
        if uri in fingerprints or uri.startswith("runs:/"):
            continue
        if uri.startswith("models:/"):
            fingerprints[uri] = _model_version(uri, tracking_uri)
        elif artifact.is_local or uri.startswith("file://"):
            fingerprints[uri] = content_hash(Path(uri.removeprefix("file://")))
        else:
            fingerprints[uri] = _remote_fingerprint(uri)
    return dict(sorted(fingerprints.items()))


def _model_version(uri: str, tracking_uri: str | None) -> str:
    from mlplat.pipeline.artifacts import MODEL_VERSION_URI, current_tracking_uri

    if MODEL_VERSION_URI.match(uri):
        return uri
    client = MlflowClient(tracking_uri or current_tracking_uri())
    rest = uri.removeprefix("models:/")
    try:
        if "@" in rest:
            name, _, alias = rest.partition("@")
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, _, stage = rest.partition("/")
            if stage.lower() == "latest":
                versions = client.search_model_versions(f"name = '{name}'")
            else:
                with warnings.catch_warnings():  # stages are deprecated in MLflow, still resolvable
                    warnings.simplefilter("ignore", FutureWarning)
                    versions = client.get_latest_versions(name, [stage])
            if not versions:
                raise MlplatError(f"no version of {name} in {stage!r}")
            version = max(versions, key=lambda v: int(v.version))
    except Exception as err:  # noqa: BLE001 - MLflow raises its own errors for unknown names and aliases
        raise MlplatError(f"model input {uri}: cannot resolve it in the registry at {client.tracking_uri}: {err}") from None
    return f"models:/{version.name}/{version.version}"


_CONTENT: dict[tuple[str, int, int, int], str] = {}


def _file_hash(path: Path, stat: os.stat_result) -> str:
    memo = (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if memo not in _CONTENT:
        digest = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        _CONTENT[memo] = digest.hexdigest()
    return _CONTENT[memo]


def content_hash(path: Path) -> str:
    """Hash of a file's bytes, or of a directory's file names and bytes (mtimes do not count)."""
    if path.is_file():
        return "file:" + _file_hash(path, path.stat())
    if not path.is_dir():
        return _MISSING
    digest = hashlib.blake2b(digest_size=16)
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            file = Path(root) / name
            digest.update(f"{file.relative_to(path).as_posix()}\0{_file_hash(file, file.stat())}\n".encode())
    return "dir:" + digest.hexdigest()


def _remote_fingerprint(uri: str) -> str:
    from pyarrow import fs as pafs

    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except Exception:  # noqa: BLE001 - a scheme pyarrow does not know: the URI is all there is
        return uri
    return filesystem_fingerprint(filesystem, path)


def filesystem_fingerprint(filesystem, path: str) -> str:
    """Size and modification time of every file at ``path`` on a pyarrow filesystem."""
    from pyarrow import fs as pafs

    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return _MISSING
    infos = [info] if info.type == pafs.FileType.File else filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
    lines = sorted(
        f"{i.path.removeprefix(path)}\0{i.size}\0{i.mtime_ns}" for i in infos if i.type == pafs.FileType.File
    )
    return "stat:" + hashlib.blake2b("\n".join(lines).encode(), digest_size=16).hexdigest()


def base_key(function: str, code: str, version: str, arguments: dict[str, Any], paths: dict[str, str]) -> tuple[str, dict]:
    """(the base key, what it covers)."""
    identity = {
        "function": function,
        "code": code,
        "version": version,
        "inputs": to_json(arguments),
        "paths": paths,
        "libraries": library_versions(),
    }
    return _digest(identity), identity


def full_key(base: str, modules: dict[str, str]) -> str:
    return _digest({"base": base, "modules": modules})


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


# -- entries ------------------------------------------------------------------------------


class CacheEntry(BaseModel):
    experiment: str
    pipeline: str
    step: str
    run_id: str
    key: str
    base: str
    created: float  # seconds since the epoch
    size: int  # bytes of the run's file outputs
    modules: dict[str, str]

    def summary(self) -> str:
        """``12 modules (mlplat 9, pipelines 2, helper 1)``."""
        counts: dict[str, int] = {}
        for name in self.modules:
            top = name.partition(".")[0]
            counts[top] = counts.get(top, 0) + 1
        parts = ", ".join(f"{top} {n}" for top, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        return f"{len(self.modules)} module{'s' if len(self.modules) != 1 else ''}" + (f" ({parts})" if parts else "")


def read_entry_file(client: MlflowClient, run_id: str) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, ENTRY_FILE, tmp)
        except Exception:  # noqa: BLE001 - no such artifact (a run from before entries were recorded)
            return None
        return json.loads(Path(path).read_text())


def record_entry(client: MlflowClient, run_id: str, base: str, identity: dict, modules: dict[str, str]) -> str:
    """Make a succeeded step run a cache entry; returns its full key."""
    key = full_key(base, modules)
    client.log_text(run_id, json.dumps({"base": base, "key": key, "covers": identity, "modules": modules}, indent=1), ENTRY_FILE)
    client.set_tag(run_id, KEY_TAG, key)
    return key


def find_entry(client: MlflowClient, experiment_id: str, base: str, max_candidates: int = 20) -> str | None:
    """The newest finished run with this base key whose recorded modules are unchanged here, or None."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{BASE_TAG}` = '{base}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=max_candidates,
    )
    for run in runs:
        if KEY_TAG not in run.data.tags:
            continue
        entry = read_entry_file(client, run.info.run_id)
        if entry is None:
            continue
        modules = entry["modules"]
        if current_module_hashes(modules) == modules:
            return run.info.run_id
    return None


def list_entries(client: MlflowClient, experiment: str | None = None) -> list[CacheEntry]:
    if experiment is not None:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise MlplatError(f"no experiment named {experiment!r} at {client.tracking_uri}")
        experiments = [found]
    else:
        experiments = client.search_experiments()
    names = {e.experiment_id: e.name for e in experiments}
    entries = []
    token = None
    while True:
        page = client.search_runs(
            list(names), filter_string=f"tags.`{KEY_TAG}` LIKE '%' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"], max_results=1000, page_token=token,
        )
        for run in page:
            details = read_entry_file(client, run.info.run_id) or {}
            tags = run.data.tags
            entries.append(CacheEntry(
                experiment=names[run.info.experiment_id],
                pipeline=tags.get("mlplat.pipeline", "-"),
                step=tags.get("mlplat.step", "-"),
                run_id=run.info.run_id,
                key=tags[KEY_TAG],
                base=tags.get(BASE_TAG, ""),
                created=run.info.start_time / 1000,
                size=_outputs_size(client, run.info.run_id),
                modules=details.get("modules", {}),
            ))
        token = page.token
        if not token:
            return entries


def _outputs_size(client: MlflowClient, run_id: str, path: str = "outputs") -> int:
    total = 0
    for item in client.list_artifacts(run_id, path):
        total += _outputs_size(client, run_id, item.path) if item.is_dir else (item.file_size or 0)
    return total


def select(entries: list[CacheEntry], target: str) -> list[CacheEntry]:
    """The entries a ``mlplat cache rm TARGET`` names: a step (``STEP`` or ``PIPELINE.STEP``), a key or its prefix, a run id."""
    matched = [e for e in entries if target in (e.step, f"{e.pipeline}.{e.step}", e.run_id)]
    if not matched and len(target) >= 6:
        matched = [e for e in entries if e.key.startswith(target)]
    return matched


def remove_entries(client: MlflowClient, entries: list[CacheEntry]) -> None:
    """Take runs out of the cache: their results stay in MLflow, no lookup finds them again."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for entry in entries:
        for tag in (KEY_TAG, BASE_TAG):
            client.delete_tag(entry.run_id, tag)
        client.set_tag(entry.run_id, REMOVED_TAG, now)


def format_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def step_function_name(fn: Callable) -> str:
    return f"{fn.__module__.rpartition('.')[2]}.{fn.__qualname__}"  # the same file imported as a package or not
