"""What one node measures: CPU, memory, disk, its GPUs (with NVML health) and its RDMA ports.

These run inside a probe actor pinned to the node (``mlplat.health.check``). Each figure
is the best of several trials: on a shared machine the slower trials measure the
neighbours, not the node. ``slowdown`` is a test hook: it stretches every timed trial by
that factor with a sleep, so a healthy machine can play a slow node through the real path.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel

from mlplat.health.hardware import NVML_OK, MeasurementSizes

_MB = 2**20
_CHUNK = 8 * _MB  # disk I/O unit: large enough for sequential throughput, small enough to hold twice in memory


def best_seconds(
    work: Callable[[], object],
    trials: int,
    slowdown: float = 1.0,
    sync: Callable[[], None] = lambda: None,
    before: Callable[[], None] | None = None,
    warmup: bool = True,
) -> float:
    """Seconds of the fastest of ``trials`` runs of ``work``; ``before`` runs untimed ahead of each."""
    if warmup:
        work()
        sync()
    best = math.inf
    for _ in range(trials):
        if before:
            before()
        start = time.perf_counter()
        work()
        sync()
        if slowdown > 1.0:
            time.sleep((slowdown - 1.0) * (time.perf_counter() - start))
        best = min(best, time.perf_counter() - start)
    return best


def cpu_matmul_gflops(size: int, trials: int, slowdown: float = 1.0) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2.0 * size**3 / best_seconds(lambda: a @ b, trials, slowdown) / 1e9


def memory_bandwidth_gbps(mb: int, trials: int, slowdown: float = 1.0) -> float:
    src = torch.ones(mb * _MB, dtype=torch.uint8)  # touched, so the copy does not measure page faults
    dst = torch.zeros_like(src)
    return 2.0 * src.numel() / best_seconds(lambda: dst.copy_(src), trials, slowdown) / 1e9


def disk_throughput_mbps(directory: Path, mb: int, trials: int, slowdown: float = 1.0) -> tuple[float, float]:
    """(write, read) MB/s of a file of ``mb`` MiB in ``directory``: fsync'd writes, reads after dropping its cached pages.

    The page cache is dropped with ``posix_fadvise(DONTNEED)``, which needs no privileges
    but does nothing on tmpfs: there, "disk" figures are memory figures (the report names
    the file system).
    """
    block = os.urandom(_CHUNK)  # incompressible
    chunks = max(1, mb * _MB // _CHUNK)
    fd, name = tempfile.mkstemp(prefix="mlplat-health-", dir=directory)
    os.close(fd)
    path = Path(name)

    def write() -> None:
        with open(path, "wb", buffering=0) as f:
            f.writelines(block for _ in range(chunks))
            os.fsync(f.fileno())

    def drop_cache() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    buffer = bytearray(_CHUNK)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass

    try:
        write_s = best_seconds(write, trials, slowdown, warmup=False)
        read_s = best_seconds(read, trials, slowdown, before=drop_cache, warmup=False)
    finally:
        path.unlink(missing_ok=True)
    nbytes = chunks * _CHUNK
    return nbytes / write_s / 1e6, nbytes / read_s / 1e6


def filesystem_type(path: Path) -> str:
    """The type (ext4, xfs, tmpfs, overlay, ...) of the mount holding ``path``, from /proc/mounts."""
    path = path.resolve()
    best, fs_type = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return fs_type
    for line in mounts:
        fields = line.split()
        if len(fields) >= 3 and path.is_relative_to(fields[1]) and len(fields[1]) > len(best):
            best, fs_type = fields[1], fields[2]
    return fs_type


def gpu_figures(device: torch.device, sizes: MeasurementSizes, slowdown: float = 1.0) -> dict[str, float]:
    """bf16 matmul TFLOP/s, device-memory copy and host<->device bandwidth of one GPU."""
    figures = {
        "gpu_bf16_tflops": _gpu_matmul_tflops(device, sizes.gpu_matmul, sizes.trials, slowdown),
        "gpu_memory_bandwidth_gbps": _gpu_copy_gbps(device, sizes.gpu_memory_mb, sizes.trials, slowdown),
    }
    return figures | _host_device_gbps(device, sizes.transfer_mb, sizes.trials, slowdown)


def _gpu_matmul_tflops(device: torch.device, n: int, trials: int, slowdown: float, repeats: int = 10) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)

    def matmuls() -> None:  # several per trial: kernel launch overhead amortised
        for _ in range(repeats):
            torch.mm(a, b, out=out)

    return repeats * 2.0 * n**3 / best_seconds(matmuls, trials, slowdown, lambda: torch.cuda.synchronize(device)) / 1e12


def _gpu_copy_gbps(device: torch.device, mb: int, trials: int, slowdown: float) -> float:
    src = torch.ones(mb * _MB, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    return 2.0 * src.numel() / best_seconds(lambda: dst.copy_(src), trials, slowdown, lambda: torch.cuda.synchronize(device)) / 1e9


def _host_device_gbps(device: torch.device, mb: int, trials: int, slowdown: float) -> dict[str, float]:
    host = torch.ones(mb * _MB, dtype=torch.uint8).pin_memory()  # pageable memory would add a bounce copy
    dev = torch.empty_like(host, device=device)
    sync = functools.partial(torch.cuda.synchronize, device)
    return {
        "host_to_device_gbps": host.numel() / best_seconds(lambda: dev.copy_(host, non_blocking=True), trials, slowdown, sync) / 1e9,
        "device_to_host_gbps": host.numel() / best_seconds(lambda: host.copy_(dev, non_blocking=True), trials, slowdown, sync) / 1e9,
    }


def nvml_status() -> str:
    """``"ok"`` when NVML answers on this machine, else what is missing (the module, or the driver's library).

    The verdict on it is made elsewhere (``mlplat.health.report.judge_nodes``): on a GPU profile a node
    without NVML fails, since its ECC, row-remapping, clock-slowdown and XID checks cannot run.
    """
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py not installed (pip install 'mlplat[gpu]')"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return f"NVML cannot start: {err} (is the NVIDIA driver's libnvidia-ml loadable here?)"
    return NVML_OK


class GpuHealth:
    """NVML view of one GPU: ECC, row remapping, retired pages, clock slowdowns, and XIDs while it is watched.

    Needs ``nvidia-ml-py`` (``pip install 'mlplat[gpu]'``). ``facts["nvml"]`` says whether NVML could watch
    this GPU (``"ok"``) or what was missing; on a GPU profile anything but ``"ok"`` fails the node.
    Create it before the measurements so critical XIDs raised under load are caught.
    """

    def __init__(self, device: torch.device):
        self.facts: dict[str, object] = {}
        self._nvml = self._handle = self._events = None
        self.facts["nvml"] = status = nvml_status()
        if status != NVML_OK:
            return
        import pynvml

        try:
            # CUDA and NVML number GPUs differently; the UUID names the same one in both.
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
        except pynvml.NVMLError as err:
            self.facts["nvml"] = f"NVML does not know this GPU: {err}"
            return
        self._nvml = pynvml
        try:
            self._events = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(self._handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
        except pynvml.NVMLError:
            self._events = None  # XID events unsupported here (e.g. some virtualised GPUs)

    def _query(self, fn, *args):
        """``fn(*args)``, or None where the GPU or driver does not support the query."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def faults(self) -> list[str]:
        if self._nvml is None:
            return []
        nvml, h, faults = self._nvml, self._handle, []
        ecc = self._query(nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        self.facts["ecc_uncorrected_volatile"] = ecc
        if ecc:
            faults.append(f"{ecc} uncorrected ECC errors since the last driver load")
        remap = self._query(nvml.nvmlDeviceGetRemappedRows, h)  # (correctable, uncorrectable, pending, failure); A100 and later
        if remap is not None:
            if remap[3]:
                faults.append("row remapping failed: the GPU needs service")
            elif remap[2]:
                faults.append("row remapping pending: reset the GPU")
        retired = self._query(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)  # pre-A100 parts
        if retired == nvml.NVML_FEATURE_ENABLED:
            faults.append("retired memory pages pending: reset the GPU")
        clock_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = self._query(clock_reasons, h)
        hw_slowdown = (
            nvml.nvmlClocksThrottleReasonHwSlowdown
            | nvml.nvmlClocksThrottleReasonHwThermalSlowdown
            | nvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown
        )
        if reasons is not None and reasons & hw_slowdown:
            faults.append("hardware clock slowdown active (thermal or power brake)")
        self.facts["temperature_c"] = self._query(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
        xids = self._xids()
        if xids:
            faults.append(f"critical XID events during the check: {sorted(set(xids))}")
        return faults

    def _xids(self) -> list[int]:
        xids = []
        while self._events is not None:
            try:
                xids.append(int(self._nvml.nvmlEventSetWait_v2(self._events, 1).eventData))
            except self._nvml.NVMLError:  # timeout: no more queued events
                break
        return xids


class RdmaPort(BaseModel):
    device: str
    port: int
    state: str  # ACTIVE, DOWN, INIT, ...
    rate_gbps: float
    link_layer: str  # InfiniBand or Ethernet (RoCE)


def rdma_ports(root: Path = Path("/sys/class/infiniband")) -> list[RdmaPort]:
    """RDMA ports from sysfs: ``<root>/<device>/ports/<n>/{state,rate,link_layer}``; empty where there are none."""

    def read(path: Path, default: str = "") -> str:
        try:
            return path.read_text().strip()
        except OSError:
            return default

    ports = []
    for port_dir in sorted(root.glob("*/ports/*")):
        state = read(port_dir / "state", "0: UNKNOWN")  # e.g. "4: ACTIVE"
        rate = read(port_dir / "rate", "0 Gb/sec")  # e.g. "400 Gb/sec (4X NDR)"
        try:
            rate_gbps = float(rate.split()[0])
        except (IndexError, ValueError):
            rate_gbps = 0.0
        ports.append(
            RdmaPort(
                device=port_dir.parent.parent.name,
                port=int(port_dir.name) if port_dir.name.isdigit() else 0,
                state=state.split(":")[-1].strip(),
                rate_gbps=rate_gbps,
                link_layer=read(port_dir / "link_layer", "unknown"),
            )
        )
    return ports
