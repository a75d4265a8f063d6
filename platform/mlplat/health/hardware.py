"""Hardware profiles: what a healthy node of one kind measures (``cluster_configs/hardware/*.yaml``).

Every figure is higher-is-better, so one rule fits all: a node fails a figure when it
measures below ``expected * (1 - tolerance)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import Field

from mlplat.config import Config, load_config
from mlplat.errors import ConfigError

NodeMetric = Literal[
    "cpu_matmul_gflops",  # fp32 square matmul on all the node's cores
    "memory_bandwidth_gbps",  # host tensor copy, bytes read + written per second (STREAM copy convention)
    "disk_write_mbps",  # sequential write of a file, fsync included
    "disk_read_mbps",  # sequential read of that file, its page cache dropped first
    "gpu_bf16_tflops",  # bf16 square matmul; the node's slowest GPU
    "gpu_memory_bandwidth_gbps",  # device tensor copy, read + written; the slowest GPU
    "host_to_device_gbps",  # pinned host memory -> GPU; the slowest GPU
    "device_to_host_gbps",  # GPU -> pinned host memory; the slowest GPU
    "node_allreduce_busbw_gbps",  # all-reduce among the node's own GPUs (NVLink/NVSwitch); nodes with 2+ GPUs
]
# All-reduce bus bandwidth, as nccl-tests defines it: across all nodes, and across each pair of ring neighbours.
ClusterMetric = Literal["allreduce_busbw_gbps", "pair_allreduce_busbw_gbps"]
NODE_METRICS: tuple[str, ...] = get_args(NodeMetric)
Metric = Literal[NodeMetric, ClusterMetric]

NVML_OK = "ok"  # a node's ``nvml`` fact when NVML watched every GPU; anything else says what was missing
HARDWARE_DIR = Path("cluster_configs") / "hardware"
_REPO_ROOT = Path(__file__).resolve().parents[3]  # platform/mlplat/health/hardware.py -> the repository


class MeasurementSizes(Config):
    """How much work each measurement does: enough to reach steady state on the hardware the profile describes."""

    cpu_matmul: int = Field(default=2048, gt=0)  # square matrix side
    memory_mb: int = Field(default=512, gt=0)
    disk_mb: int = Field(default=256, gt=0)
    gpu_matmul: int = Field(default=8192, gt=0)
    gpu_memory_mb: int = Field(default=2048, gt=0)
    transfer_mb: int = Field(default=512, gt=0)  # host <-> device
    allreduce_mb: int = Field(default=64, gt=0)
    trials: int = Field(default=5, gt=0)  # each figure is the best trial: the slow ones measure the neighbours


class RdmaExpectation(Config):
    active_ports: int = Field(ge=1)  # ports in state ACTIVE on every node
    rate_gbps: float = Field(gt=0)  # link rate of each of them (sysfs ``rate``)


class HardwareProfile(Config):
    name: str
    description: str = ""
    tolerance: float = Field(default=0.3, ge=0, lt=1)  # a figure passes down to expected * (1 - tolerance)
    expected: dict[Metric, float] = Field(default_factory=dict)  # metrics left out are measured and reported, not judged
    tolerances: dict[Metric, float] = Field(default_factory=dict)  # per-metric override of ``tolerance``
    gpus_per_node: int = Field(default=0, ge=0)  # a node that shows fewer GPUs fails; > 0: a GPU profile, NVML required
    rdma: RdmaExpectation | None = None  # None: RDMA ports are reported where present, not required
    sizes: MeasurementSizes = MeasurementSizes()

    def floor(self, metric: str) -> float | None:
        """The lowest passing figure, or None when the profile does not judge ``metric``."""
        if metric not in self.expected:
            return None
        return self.expected[metric] * (1.0 - self.tolerances.get(metric, self.tolerance))


def profile_dirs() -> list[Path]:
    """Where profile names are looked up: the working directory's ``cluster_configs/hardware``, then the repository's."""
    return list(dict.fromkeys([Path.cwd() / HARDWARE_DIR, _REPO_ROOT / HARDWARE_DIR]))


def load_hardware_profile(name_or_path: str) -> HardwareProfile:
    """A profile by file path, or by name (``cpu-dev`` -> ``cluster_configs/hardware/cpu-dev.yaml``)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return load_config(HardwareProfile, path)
    for directory in profile_dirs():
        if (directory / f"{name_or_path}.yaml").is_file():
            return load_config(HardwareProfile, directory / f"{name_or_path}.yaml")
    known = sorted({p.stem for d in profile_dirs() if d.is_dir() for p in d.glob("*.yaml")})
    raise ConfigError(f"profile: no hardware profile named {name_or_path!r}; use one of {known} or a path to a YAML file")
