"""Where models live: the device covey loads them on, bfloat16 autocast there, and how the C library
handles the CPU memory of freed tensors."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

def default_device(use_cpu: bool = False) -> torch.device:
    """Where covey puts the models it loads: the current CUDA device when there is one (and ``use_cpu``
    is not asked), else the CPU (a model object handed to the trainer stays where it is)."""
    return torch.device("cuda") if torch.cuda.is_available() and not use_cpu else torch.device("cpu")


def keep_freed_memory() -> bool:
    """Have the C library keep the memory of freed tensors for the next ones, rather than hand every
    large block back to the system at free and take it again (zeroed page by page) at the next
    allocation, as glibc does by default for blocks over 32 MB or so: on CPU each training step
    allocates and frees its activations, gradients and vocabulary-wide logits. Measured on the
    default step: half the page faults, a third less system time (docs/benchmark-history.md), a step
    about 5% faster (BENCHMARKS.md). But where a later phase cannot reuse the blocks an earlier one
    freed, they stay held: examples/gsm8k.yaml's step peaked 7% higher (docs/plan.md), beyond what
    covey plan estimates, so it is off unless asked for (``keep_freed_memory: true``).
    Process-wide; the process's memory then stays near its peak instead of shrinking between passes.
    True where applied (Linux with glibc), False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>; musl's mallopt accepts nothing and returns 0
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))



def cpu_multiplies_bfloat16() -> bool | None:
    """Whether this CPU has bfloat16 instructions (x86: AVX-512 BF16 or AMX; Arm: BF16), as /proc/cpuinfo
    says; None where it says nothing. Without them torch multiplies bfloat16 in software: on an AVX2 CPU
    about 80 times slower than float32 (a 1024 x 1024 product: 0.9 against 76 GFLOP/s)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(("flags", "Features")):
            return bool(set(line.split(":", 1)[1].split()) & {"avx512_bf16", "amx_bf16", "bf16"})
    return None


def autocast(device: torch.device, enabled: bool):
    """bfloat16 autocast on ``device`` when enabled (the `bf16` setting), a no-op otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)
