"""What the device a run trains on holds: a CUDA GPU's memory, or the machine's RAM."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Device:
    """``total`` and ``available`` bytes for one process's step; ``runtime``: what the process itself
    holds before any model (python, torch, transformers), counted where the device is the CPU (a GPU's
    memory holds none of it)."""

    name: str
    kind: str  # "cuda" or "cpu"
    total: int
    available: int
    runtime: int = 0
    bfloat16_in_software: bool = False  # a CPU whose bfloat16 products torch runs in software (models.device)


def this_device(use_cpu: bool = False, processes: int = 1) -> Device:
    """The device covey trains on here: the current CUDA GPU (its free memory), else the CPU, whose RAM
    the ``processes`` share (each gets its part of what is available now, within any cgroup limit)."""
    import torch

    if torch.cuda.is_available() and not use_cpu:
        free, total = torch.cuda.mem_get_info()
        return Device(torch.cuda.get_device_name(), "cuda", total, free)
    total, available = ram_bytes()
    name = "this machine's RAM" + (f", shared by {processes} processes" if processes > 1 else "")
    from covey.models import bfloat16_products_in_software

    return Device(name, "cpu", total // processes, available // processes, resident_bytes(),
                  bfloat16_products_in_software(torch.device("cpu")))


def ram_bytes() -> tuple[int, int]:
    """(total, available) RAM in bytes: /proc/meminfo, within the cgroup's memory limit where one is set."""
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
        total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError):  # not Linux
        total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            total, available = min(total, int(limit)), min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return total, max(available, 0)


def resident_bytes() -> int:
    """This process's resident memory now (Linux), else 0."""
    try:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 0
