"""Training: one GRPO step (``step.py``, over the typed values of ``batch.py``), the trainer that runs
the loop (``trainer.py``) and what it is built with (``setup.py``), the forward passes (``forward.py``),
several processes (``distributed.py``), checkpoints, the run folder, the held-out evaluation, the
metrics, and the export of a trained policy as a plain model."""
