"""What covey runs inside vLLM's workers: loading pushed weights, and the ``covey_gloo``
weight-transfer backend (registered by ``covey.rollout.vllm_plugin``; its protocol is
``covey.rollout.weight_transfer``'s). Imported only where vLLM is."""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from vllm.model_executor.model_loader.reload import layerwise
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from covey.rollout.weight_transfer import GlooInitInfo, GlooUpdateInfo, open_group, receive


class _ExpectedMisses(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for the layers no push carries by design: one whose
    weight is an earlier layer's (a tied head, redone by ``finish_reload``) and one without parameters
    of its own (rotary tables, computed at start)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        seen: set[int] = set()
        self.classes = set()
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and id(weight) in seen:
                self.classes.add(type(module).__name__)
            elif isinstance(weight, torch.Tensor):
                seen.add(id(weight))
            elif not any(True for _ in module.parameters(recurse=False)) and next(module.buffers(False), None) is not None:
                self.classes.add(type(module).__name__)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.classes)


def start_reload(model: torch.nn.Module) -> None:
    reload_logger = logging.getLogger(layerwise.__name__)
    if not any(isinstance(f, _ExpectedMisses) for f in reload_logger.filters):
        reload_logger.addFilter(_ExpectedMisses(model))
    initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config) -> None:
    """vLLM's layerwise reload redoes, for each layer whose weights arrived, what vLLM did to them after
    loading (fusing, repacking for the CPU's matmul kernels). A layer that shares its weight with an
    earlier one (an output head tied to the embedding) receives none, so it is redone here: otherwise
    it would keep computing with the old weights' packed copy."""
    finalize_layerwise_reload(model, model_config)
    first_holder: dict[int, str] = {}
    for name, module in model.named_modules():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if not isinstance(weight, torch.Tensor) or method is None:
            continue
        if id(weight) in first_holder:
            method.process_weights_after_loading(module)
        else:
            first_holder[id(weight)] = name


def reload_weights(model: torch.nn.Module, model_config, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Replace the model's weights by the (name, tensor) pairs, as vLLM's RL weight updates do."""
    start_reload(model)
    model.load_weights(weights)
    finish_reload(model, model_config)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config  # this worker's rank among all of the server's workers
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                init_info.timeout_s)

    def start_weight_update(self) -> None:
        start_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("covey_gloo: no weights can be received before /init_weight_transfer_engine")
        self.model.load_weights(receive(self.group, update_info))

    def update_weights(self, update_info: dict) -> None:
        # vLLM's base method waits for the accelerator after receiving, which fails on a machine without
        # one; gloo's broadcasts are done when they return, so only a GPU's copies are waited for
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None
