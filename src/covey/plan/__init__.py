"""Will it fit: the peak memory of a training step per device, estimated from a model's config and the
prompts' measured lengths before any weight is loaded (``covey plan``; ``covey train`` checks it first).

    >>> plan = make_plan(GRPOConfig(max_completion_length=64))         # doctest: +SKIP
    >>> plan.breakdown.peak, plan.device.total, plan.fits                # doctest: +SKIP

``covey.plan.shapes`` reads the model's sizes, ``covey.plan.prompts`` measures the prompts in the data,
``covey.plan.memory`` does the arithmetic, ``covey.plan.device`` says what the device holds,
``covey.plan.advice`` finds settings that fit.
"""

from __future__ import annotations

from covey.plan.check import MemoryCheckSkipped, MemoryPlanError, check_fits
from covey.plan.device import Device, this_device
from covey.plan.memory import Breakdown, Settings, estimate
from covey.plan.planning import REFUSE_OVER, Plan, make_plan, replan, settings_from_config
from covey.plan.shapes import ModelShape, model_config, model_shape

__all__ = ["Breakdown", "Device", "MemoryCheckSkipped", "MemoryPlanError", "ModelShape", "Plan", "REFUSE_OVER",
           "Settings", "check_fits", "estimate", "make_plan", "model_config", "model_shape", "replan", "settings_from_config", "this_device"]
