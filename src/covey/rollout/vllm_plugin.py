"""covey's plugin for vLLM: registers the ``covey_gloo`` weight-transfer backend
(``covey.rollout.weight_transfer``) with vLLM's ``WeightTransferEngineFactory``, so that
``vllm serve --weight-transfer-config '{"backend": "covey_gloo"}'`` takes pushed weights on any machine.

vLLM calls ``register`` in each of its processes (the ``vllm.general_plugins`` entry point in
pyproject.toml); it imports nothing heavy until vLLM builds the backend.
"""

from __future__ import annotations

from covey.rollout.weight_transfer import BACKEND


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "covey.rollout.vllm_worker", "GlooWeightTransferEngine")
    except ValueError:  # registered already: vLLM loads its plugins more than once in some processes
        pass
