"""Sharded models (FSDP2): their parameters whole, a block at a time."""

from __future__ import annotations

import weakref
from typing import Iterator

import torch

def is_sharded(module: torch.nn.Module) -> bool:
    """Whether any part of ``module`` is a ``fully_shard`` unit."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def gathered_parameters(root: torch.nn.Module, of: torch.nn.Module | None = None
                        ) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``of.named_parameters(remove_duplicate=False)`` (``of``: a module inside the sharded ``root``, by
    default ``root``) with each parameter whole: the parameters of each unit are gathered when the
    iteration enters it and freed when it leaves, so that no more than one block beside the root's
    parameters is whole at once. Every process must iterate it to the end, together. A tensor yielded
    is valid until the iteration leaves its unit: copy what must stay."""
    of = root if of is None else of
    prefix = next(name for name, module in root.named_modules() if module is of)
    prefix = prefix + "." if prefix else ""
    for name, param in _gathered(root, ""):
        if name.startswith(prefix):
            yield name[len(prefix):], param


def _gathered(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.nn.Parameter]]:
    from torch.distributed.fsdp import FSDPModule

    unit = isinstance(module, FSDPModule)
    if unit:
        module.unshard()
    try:
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            yield prefix + name, param
        for name, child in module.named_children():
            yield from _gathered(child, f"{prefix}{name}.")
    finally:
        if unit:
            module.reshard()


# the passes sharded with FSDP2 so far (covey.train.sharding adds them), where parameters_whole finds a module's root
SHARDED_PASSES: weakref.WeakSet = weakref.WeakSet()


def parameters_whole(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.named_parameters(remove_duplicate=False)``, each parameter whole: for a module inside a
    sharded pass, gathered a block at a time (every process at once) and copied; else the parameters."""
    root = next((root for root in SHARDED_PASSES if any(m is module for m in root.modules())), None)
    if root is None:
        yield from module.named_parameters(remove_duplicate=False)
        return
    copies: dict[int, torch.Tensor] = {}  # a tensor met under two names (a tied head) is copied once
    for name, param in gathered_parameters(root, module):
        if id(param) not in copies:
            copies[id(param)] = param.detach().clone()
        yield name, copies[id(param)]
