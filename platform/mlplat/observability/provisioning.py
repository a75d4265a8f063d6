"""Getting the dashboards into a Grafana: file provisioning (``--to-dir``) or its HTTP API (``--grafana-url``).

File provisioning mirrors what Ray's dashboard writes under
``<session>/metrics/grafana`` (``grafana.ini`` with ``[paths] provisioning``, then
``provisioning/dashboards/*.yml`` and ``provisioning/datasources/*.yml``). Pointing
``--to-dir`` at that directory adds our provider and data source beside Ray's, so the
Grafana that ``RAY_GRAFANA_HOST`` names (started with Ray's ``grafana.ini``) lists the
mlplat dashboards next to Ray's own. Our dashboards live in ``<dir>/mlplat/`` (outside
Ray's ``dashboards/``, which Ray's provider scans) and our data source is never the
default (Ray's is), so nothing collides. Into an empty directory it writes a complete,
standalone setup including ``grafana.ini``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from mlplat.errors import MlplatError
from mlplat.observability.dashboards import DASHBOARDS

FOLDER_UID, FOLDER_TITLE = "mlplat", "mlplat"
DATASOURCE_UID, DATASOURCE_NAME = "mlplat-prometheus", "mlplat-prometheus"
DEFAULT_PROMETHEUS_URL = "http://localhost:9090"  # Ray's default RAY_PROMETHEUS_HOST

GRAFANA_INI = """\
# Written by `mlplat dashboards install --to-dir` (same settings as Ray's own grafana.ini).
[security]
allow_embedding = true

[auth.anonymous]
enabled = true
org_name = Main Org.
org_role = Viewer

[paths]
provisioning = {provisioning}
"""


def datasource(prometheus_url: str, is_default: bool = False) -> dict:
    return {
        "name": DATASOURCE_NAME,
        "uid": DATASOURCE_UID,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "isDefault": is_default,
        "jsonData": {"timeInterval": "10s"},  # Ray's scrape interval: $__rate_interval stays >= 4 scrapes
    }


def write_provisioning(directory: str | Path, prometheus_url: str = DEFAULT_PROMETHEUS_URL) -> dict[str, Path]:
    """Grafana file provisioning for every dashboard; returns what was written, by role."""
    root = Path(directory).resolve()
    ray_layout = (root / "grafana.ini").is_file()  # Ray's (or an earlier run's) grafana.ini: keep it
    dashboards_dir = root / "mlplat"
    dashboards_dir.mkdir(parents=True, exist_ok=True)
    from mlplat.observability.dashboards import render

    written: dict[str, Path] = {}
    for name, dashboard in DASHBOARDS.items():
        written[f"dashboard:{name}"] = dashboards_dir / f"{name}.json"
        written[f"dashboard:{name}"].write_text(render(dashboard))
    provider = {
        "apiVersion": 1,
        "providers": [{
            "name": "mlplat", "folder": FOLDER_TITLE, "folderUid": FOLDER_UID, "type": "file", "disableDeletion": False,
            "allowUiUpdates": True, "updateIntervalSeconds": 30, "options": {"path": str(dashboards_dir)},
        }],
    }  # fmt: skip
    has_default = any(_declares_default(p) for p in (root / "provisioning" / "datasources").glob("*.y*ml") if p.name != "mlplat.yml")
    sources = {"apiVersion": 1, "datasources": [datasource(prometheus_url, is_default=not has_default)]}
    for kind, content in (("dashboards", provider), ("datasources", sources)):
        path = root / "provisioning" / kind / "mlplat.yml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(content, sort_keys=False))
        written[kind] = path
    if not ray_layout:
        (root / "grafana.ini").write_text(GRAFANA_INI.format(provisioning=root / "provisioning"))
    written["grafana.ini"] = root / "grafana.ini"
    return written


def _declares_default(path: Path) -> bool:
    try:
        content = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    return any(ds.get("isDefault") for ds in content.get("datasources", []) or [])


def ray_grafana_dir() -> Path | None:
    """Where the running Ray's dashboard wrote its Grafana provisioning, if it did."""
    candidate = Path(os.environ.get("RAY_METRICS_OUTPUT_ROOT", "/tmp/ray/session_latest/metrics")) / "grafana"
    return candidate if (candidate / "grafana.ini").is_file() else None


def install(
    grafana_url: str, token_env: str = "GRAFANA_TOKEN", prometheus_url: str = DEFAULT_PROMETHEUS_URL, timeout_s: float = 10.0
) -> list[str]:
    """Push the Prometheus data source, an mlplat folder and every dashboard through Grafana's HTTP API.

    The credential comes from ``$token_env``: a service-account token, or ``user:password``
    for basic auth. Returns the dashboard URLs Grafana reports.
    """
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException

    secret = os.environ.get(token_env, "")
    if not secret:
        raise MlplatError(
            f"${token_env} is empty: export a Grafana service-account token (or user:password) in it; it is never read from the command line"
        )
    credential = tuple(secret.split(":", 1)) if ":" in secret else secret
    api = GrafanaApi.from_url(grafana_url, credential=credential, timeout=timeout_s)
    try:
        try:
            api.datasource.get_datasource_by_uid(DATASOURCE_UID)
            api.datasource.update_datasource_by_uid(DATASOURCE_UID, datasource(prometheus_url))
        except GrafanaClientError as err:
            if err.status_code != 404:
                raise
            api.datasource.create_datasource(datasource(prometheus_url))
        try:
            api.folder.get_folder(FOLDER_UID)
        except GrafanaClientError as err:
            if err.status_code != 404:
                raise
            api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
        urls = []
        for name, dashboard in DASHBOARDS.items():
            body = {"dashboard": dashboard.to_grafana(), "folderUid": FOLDER_UID, "overwrite": True, "message": "mlplat dashboards install"}
            reply = api.dashboard.update_dashboard(body)
            urls.append(grafana_url.rstrip("/") + (reply.get("url") or f"/d/{dashboard.uid}") if isinstance(reply, dict) else name)
        return urls
    except GrafanaException as err:  # 401/403/5xx: one line naming what failed, never the token
        raise MlplatError(f"Grafana at {grafana_url} refused the install: {err}") from None
    except OSError as err:
        raise MlplatError(f"cannot reach Grafana at {grafana_url}: {err}") from None


def dump_json(paths: dict[str, Path]) -> str:
    return json.dumps({k: str(v) for k, v in paths.items()}, indent=2)
