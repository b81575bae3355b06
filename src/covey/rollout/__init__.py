"""Rollout engines: token ids in; completion ids, sampling log-probs and finish reasons out.

    engine.py       the interface (``RolloutEngine``), ``SamplingParams``, ``Rollout``, ``EngineSettings``
    hf.py           transformers' ``generate`` on the policy
    fast/           covey's own KV-cache sampler, its lean decoder and its C kernel
    vllm_engine.py  vLLM in the trainer's process
    client.py       a vLLM server (vllm serve, or covey server: ``server.py``) over vLLM's HTTP API (``wire.py``)
    weight_transfer.py  pushed weights over a process group: covey_gloo (any machine), vLLM's nccl (GPUs)
    vllm_plugin.py, vllm_worker.py  covey_gloo inside vLLM's workers

Engines know nothing of rewards, datasets or the run's config.
"""

from __future__ import annotations

import torch

from covey.rollout.client import ServerEngine
from covey.rollout.engine import (EngineSettings, OwnWeights, Rollout, RolloutEngine, SamplesWithPolicy, SamplingParams,
                                  left_pad)
from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine
from covey.rollout.vllm_engine import VLLMEngine

# engine name -> its class; each builds itself with ``build(settings, policy, tokenizer, eos_token_ids)``
ENGINES = {"fast": FastEngine, "hf": HFEngine, "vllm": VLLMEngine, "server": ServerEngine}


def make_engine(name: str, settings: EngineSettings, policy: torch.nn.Module, tokenizer,
                eos_token_ids: list[int]) -> RolloutEngine:
    """The engine called ``name`` (a key of ``ENGINES``) over ``policy``, built with ``settings``."""
    if name not in ENGINES:
        raise ValueError(f"rollout engine {name!r} is not one of {', '.join(ENGINES)}")
    return ENGINES[name].build(settings, policy, tokenizer, eos_token_ids)


__all__ = ["ENGINES", "EngineSettings", "OwnWeights", "Rollout", "RolloutEngine", "SamplesWithPolicy", "SamplingParams",
           "left_pad", "make_engine",
           "FastEngine", "HFEngine", "VLLMEngine", "ServerEngine"]
