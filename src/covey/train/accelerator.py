"""``trainer.accelerator``: what TRL's scripts and transformers' callbacks ask of accelerate's
``Accelerator`` (printing once, which process this is, waiting for the others, gathering), answered
from covey's own process group (``World``). covey does not run on accelerate: this is a view, not a
second way to launch or place a model."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from covey.train.distributed import World


class ProcessView:
    """The run's processes as ``accelerate.Accelerator`` names them."""

    def __init__(self, world: World, device: torch.device):
        self.world, self.device = world, device

    @property
    def process_index(self) -> int:
        return self.world.rank

    @property
    def num_processes(self) -> int:
        return self.world.size

    @property
    def is_main_process(self) -> bool:
        return self.world.is_main

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.world.rank))

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` in the first process only."""
        if self.world.is_main:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier: every process waits here until all have come (nothing in a single process)."""
        if self.world.size > 1:
            dist.barrier()

    def unwrap_model(self, model: torch.nn.Module, **_: Any) -> torch.nn.Module:
        """The model without a data-parallel or compiled wrapper (a LoRA policy stays a PeftModel)."""
        while isinstance(model, torch.nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
            model = getattr(model, "_orig_mod", None) or model.module
        return model

    def gather(self, tensor: Any) -> Any:
        """A tensor of every process, concatenated along its first dimension in process order (a number
        becomes a one-element tensor first); a dict or list of tensors, each gathered."""
        if isinstance(tensor, dict):
            return {k: self.gather(v) for k, v in tensor.items()}
        if isinstance(tensor, (list, tuple)):
            return type(tensor)(self.gather(v) for v in tensor)
        tensor = torch.as_tensor(tensor)
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        return torch.cat([torch.as_tensor(t).to(tensor.device) for t in self.world.gather(tensor.cpu())])

    gather_for_metrics = gather
