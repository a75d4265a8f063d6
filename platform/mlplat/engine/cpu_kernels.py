"""The engine's C++ kernels on CPU (csrc/cpu_kernels.cpp), fp32.

- Paged decode attention. Every decode step reads each sequence's whole KV. Gathering the
  blocks into a contiguous copy for SDPA reads and writes it twice more; the kernel reads the
  blocks in place through the block table, the query heads of a GQA group sharing each row.
  On a 2-core CPU, 32 decodes at 512 tokens of context: about 2x faster than gather + SDPA.
- RMSNorm in two passes over each row, 4-6x faster than ATen's chain of ops on CPU; the skip
  connection's add fused into the norm after it, in place; SwiGLU's silu(gate) * up; RoPE in place.
  Each is one pass where ATen runs several ops, each a pass and a new tensor of its own.

Inference only: the ops have no autograd formula (the engine runs under inference_mode).

Built on first use by torch.utils.cpp_extension (~20 s on 2 cores; needs a C++ compiler and
ninja) and cached on disk per CPU; where they cannot be built the engine falls back to gather +
SDPA and ATen's ops and says why once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
HEAD_DIMS = (16, 32, 64, 128)
MAX_GROUP = 8  # query heads per KV head


def supports_decode_attention(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether paged_decode_attention takes this head size and GQA group."""
    return head_dim in HEAD_DIMS and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP


STALE_LOCK_SECONDS = 600  # a build takes ~20 s; a lock this old was left by a process killed mid-build


def _build_name() -> str:
    """One build per source and CPU (-march=native): checkouts and machines sharing a home directory keep theirs apart."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = platform.processor()
    digest = hashlib.sha1(f"{platform.machine()} {flags}".encode() + SOURCE.read_bytes()).hexdigest()[:12]
    return f"mlplat_cpu_kernels_{digest}"


def _build_directory(name: str) -> Path:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    # torch waits forever on a build lock; one left by a killed build would hang every engine start.
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    return directory


@functools.cache
def load() -> bool:
    """Build (or load the cached build of) the ``torch.ops.mlplat`` kernels; False where they cannot be built."""
    if hasattr(torch.ops.mlplat, "rms_norm"):
        return True
    from torch.utils.cpp_extension import load

    try:
        if shutil.which("ninja") is None:  # the pip-installed ninja sits in the venv's bin, not always on PATH
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        name = _build_name()
        load(
            name=name,
            sources=[str(SOURCE)],
            build_directory=str(_build_directory(name)),
            # -ffast-math at compile time only (not at link, which would set flush-to-zero for the whole process):
            # it lets GCC vectorise the softmax's exp.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch has already loaded: one OpenMP runtime
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, an unusual platform: the SDPA path still works
        log.warning("CPU kernels unavailable (%s: %s); the engine falls back to gather + SDPA and ATen's ops", type(exc).__name__, exc)
        return False
    return True


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """[B, H, D] attention of one new query per sequence over its cached keys and values.

    q [B, H, D] (rows contiguous); caches [num_blocks, block_size, KV, D]; block_tables [B, W] and
    context_lens [B], int64. Call ``load`` first."""
    return torch.ops.mlplat.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [..., N] with ``weight`` [N], float32 (as F.rms_norm). Call ``load`` first."""
    return torch.ops.mlplat.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``; both [..., N] contiguous, float32."""
    torch.ops.mlplat.add_rms_norm_(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of ``x`` [T, 2N] = [gate | up], float32."""
    return torch.ops.mlplat.silu_and_mul(x)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE in place on ``x`` [T, heads, D] (rows of D contiguous) with full-width cos and signed sin [T, D]."""
    torch.ops.mlplat.rotary_(x, cos, sin)
