"""covey's own sampler (``rollout_engine: fast``): a KV-cache decode loop over any Hugging Face causal LM
(``engine.py``), a lean forward for Llama-family models (``decoder.py``) and, on x86-64 CPUs with
AVX-512, a C kernel for its decode steps (``decode_kernel.py`` with ``decode_kernel.c``)."""

from covey.rollout.fast.engine import FastEngine

__all__ = ["FastEngine"]
