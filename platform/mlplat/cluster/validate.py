"""``mlplat cluster validate``: cluster configs checked offline, before anything reaches a cluster.

- KubeRay manifests (apiVersion ray.io/*) against the OpenAPI schema in KubeRay's own CRDs, strictly:
  a field the CRD does not define is an error, as with ``kubectl apply --validate=strict``, where a
  plain API server would drop it silently. The CRDs are read from a folder (``$MLPLAT_KUBERAY_SCHEMAS``,
  else ``../shared/schemas/kuberay`` beside the repository), never bundled. A RayService's
  ``serveConfigV2`` is also checked against Serve's config schema, and the mlplat app's ``args``
  against :class:`~mlplat.serve.config.ServeConfig`.
- Monitoring manifests (apiVersion monitoring.coreos.com/*: PodMonitor, ServiceMonitor, PrometheusRule) the same strict
  way against the prometheus-operator's CRDs (``$MLPLAT_PROMETHEUS_OPERATOR_SCHEMAS``, else
  ``../shared/schemas/prometheus-operator``), and the dashboards' ConfigMaps against the fields a ConfigMap has.
- Ray cluster launcher YAMLs (``cluster_name`` + ``provider``) against ``ray-schema.json`` from the
  installed Ray, then as ``ray up`` would before it touches a cloud (defaults filled in, node types).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import jsonschema
import yaml

from mlplat.config import format_validation_error
from mlplat.errors import MlplatError

SCHEMAS_ENV = "MLPLAT_KUBERAY_SCHEMAS"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml", "RayService": "ray.io_rayservices.yaml"}
MONITORING_SCHEMAS_ENV = "MLPLAT_PROMETHEUS_OPERATOR_SCHEMAS"
MONITORING_CRD_FILES = {
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# The CRDs leave `metadata` to Kubernetes (ObjectMeta); the part a manifest writes, checked the same strict way.
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", "maxLength": 253},
        "generateName": {"type": "string"},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "finalizers": {"type": "array", "items": {"type": "string"}},
    },
}


class ValidationFailed(MlplatError):
    """Configs that do not validate; the message lists every problem, one per line."""


def kuberay_schemas_dir() -> Path:
    """Where the KubeRay CRDs are read from: ``$MLPLAT_KUBERAY_SCHEMAS``, else ``../shared/schemas/kuberay`` from the repo root."""
    if os.environ.get(SCHEMAS_ENV):
        return Path(os.environ[SCHEMAS_ENV])
    return Path(__file__).resolve().parents[3].parent / "shared" / "schemas" / "kuberay"


def prometheus_operator_schemas_dir() -> Path:
    """The prometheus-operator CRDs: ``$MLPLAT_PROMETHEUS_OPERATOR_SCHEMAS``, else ``../shared/schemas/prometheus-operator``."""
    if os.environ.get(MONITORING_SCHEMAS_ENV):
        return Path(os.environ[MONITORING_SCHEMAS_ENV])
    return Path(__file__).resolve().parents[3].parent / "shared" / "schemas" / "prometheus-operator"


def validate_paths(paths: Iterable[str | Path], schemas_dir: Path | None = None) -> int:
    """Validate every YAML document in ``paths`` (files, or folders searched for *.yaml); returns how many.

    Raises :class:`ValidationFailed` listing every problem.
    """
    files = _yaml_files(paths)
    problems, count = [], 0
    for path in files:
        try:
            docs = [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d is not None]
        except yaml.YAMLError as err:
            problems.append(f"{path}: not valid YAML: {err}".replace("\n", " "))
            continue
        for i, doc in enumerate(docs):
            where = f"{path}" + (f"[{i}]" if len(docs) > 1 else "")
            problems += [f"{where}: {p}" for p in validate_document(doc, schemas_dir)]
            count += 1
    if problems:
        raise ValidationFailed("\n".join(problems))
    return count


def validate_document(doc, schemas_dir: Path | None = None, monitoring_schemas_dir: Path | None = None) -> list[str]:
    """Problems with one parsed document (empty: valid)."""
    if isinstance(doc, dict) and str(doc.get("apiVersion", "")).startswith("ray.io/"):
        return validate_kuberay(doc, schemas_dir or kuberay_schemas_dir())
    if isinstance(doc, dict) and str(doc.get("apiVersion", "")).startswith("monitoring.coreos.com/"):
        return validate_monitoring(doc, monitoring_schemas_dir or prometheus_operator_schemas_dir())
    if isinstance(doc, dict) and doc.get("apiVersion") == "v1" and doc.get("kind") == "ConfigMap":
        return [f"ConfigMap {_path(e)}: {e.message}" for e in sorted(_validator(CONFIG_MAP).iter_errors(doc), key=_path)]
    if isinstance(doc, dict) and "cluster_name" in doc and "provider" in doc:
        return validate_launcher(doc)
    return ["neither a KubeRay manifest (apiVersion: ray.io/...), a monitoring manifest (monitoring.coreos.com/..., a ConfigMap) "
            "nor a Ray cluster launcher config (cluster_name, provider)"]


# A ConfigMap (core/v1) as the dashboards' manifests write one: string data only.
CONFIG_MAP = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "data"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "ConfigMap"}, "metadata": OBJECT_META, "immutable": {"type": "boolean"},
        "data": {"type": "object", "additionalProperties": {"type": "string"},
                 "propertyNames": {"pattern": r"^[-._a-zA-Z0-9]+$", "maxLength": 253}},
    },
}  # fmt: skip


def validate_monitoring(doc: dict, schemas_dir: Path) -> list[str]:
    kind = doc.get("kind")
    if kind not in MONITORING_CRD_FILES:
        return [f"kind {kind!r}: expected one of {', '.join(MONITORING_CRD_FILES)}"]
    version = doc["apiVersion"].removeprefix("monitoring.coreos.com/")
    schema = crd_schema(schemas_dir, kind, version, "monitoring.coreos.com")
    return [f"{kind} {_path(e)}: {e.message}" for e in sorted(_validator(schema).iter_errors(doc), key=_path)]


def validate_kuberay(doc: dict, schemas_dir: Path) -> list[str]:
    kind = doc.get("kind")
    if kind not in CRD_FILES:
        return [f"kind {kind!r}: expected one of {', '.join(CRD_FILES)}"]
    version = doc["apiVersion"].removeprefix("ray.io/")
    schema = crd_schema(schemas_dir, kind, version)
    problems = [f"{kind} {_path(e)}: {e.message}" for e in sorted(_validator(schema).iter_errors(doc), key=_path)]
    if kind == "RayService" and not problems and "serveConfigV2" in doc["spec"]:
        problems += [f"RayService spec.serveConfigV2: {p}" for p in validate_serve_config(doc["spec"]["serveConfigV2"])]
    return problems


def validate_serve_config(text: str) -> list[str]:
    """A Serve config (serveConfigV2) against Serve's schema, and mlplat's LLM app args against ServeConfig."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from mlplat.cluster.render import SERVE_IMPORT_PATH
    from mlplat.serve.config import ServeConfig

    try:
        config = ServeDeploySchema.model_validate(yaml.safe_load(text))
    except yaml.YAMLError as err:
        return [f"not valid YAML: {err}".replace("\n", " ")]
    except ValidationError as err:
        return format_validation_error(err, "Serve config").splitlines()
    problems = []
    for app in config.applications:
        if app.import_path == SERVE_IMPORT_PATH:
            try:
                ServeConfig.model_validate(app.args)
            except ValidationError as err:
                problems += format_validation_error(err, f"application {app.name!r} args").splitlines()
    return problems


def validate_launcher(doc: dict) -> list[str]:
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    problems = [f"launcher {_path(e)}: {e.message}" for e in sorted(_validator(schema).iter_errors(doc), key=_path)]
    if not problems:
        try:  # what `ray up` runs before it touches a cloud: defaults filled in, then Ray's checks
            with _quiet("ray.autoscaler"):
                validate_config(prepare_config(copy.deepcopy(doc)))
        except (ValueError, RuntimeError, jsonschema.ValidationError, SystemExit) as err:
            problems.append(f"launcher: {getattr(err, 'message', err)}")
    return problems


@functools.cache
def crd_schema(schemas_dir: Path, kind: str, version: str, group: str = "ray.io") -> dict:
    """The strict OpenAPI schema of ``kind`` at ``version`` from its CRD file (KubeRay's, or the prometheus-operator's)."""
    if group == "ray.io":
        path = Path(schemas_dir) / CRD_FILES[kind]
        if not path.is_file():
            raise MlplatError(f"{path}: KubeRay CRD not found; set {SCHEMAS_ENV} to a folder with {', '.join(CRD_FILES.values())} "
                              "(ray-operator/config/crd/bases in the kuberay repository)")
    else:
        path = Path(schemas_dir) / MONITORING_CRD_FILES[kind]
        if not path.is_file():
            raise MlplatError(f"{path}: prometheus-operator CRD not found; set {MONITORING_SCHEMAS_ENV} to a folder with "
                              f"{', '.join(MONITORING_CRD_FILES.values())} (example/prometheus-operator-crd in its repository)")
    crd = yaml.load(path.read_text(), Loader=_Loader)
    versions = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if version not in versions:
        raise MlplatError(f"{kind}: apiVersion {group}/{version} is not served by {path.name} (served: {', '.join(versions)})")
    schema = _strict(copy.deepcopy(versions[version]["schema"]["openAPIV3Schema"]))
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return schema


def _strict(node):
    """Forbid fields a schema object does not define, unless it says to keep unknown fields."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _validator(schema: dict) -> jsonschema.protocols.Validator:
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)


def _path(err: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "<root>"


def _yaml_files(paths: Iterable[str | Path]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*.yaml") if f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise MlplatError(f"{p}: no such file or folder")
    return files


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are megabytes: the C loader is ~10x faster
