"""What covey train runs before it loads the model: refuse a step clearly too big for the device."""

from __future__ import annotations

from covey.config import GRPOConfig
from covey.errors import ConfigError
from covey.plan.advice import advice
from covey.plan.planning import REFUSE_OVER, Plan, make_plan
from covey.plan.report import advice_text, gib


class MemoryPlanError(ConfigError):
    """A run whose estimated peak memory is clearly beyond the device's."""


def check_fits(args: GRPOConfig, processes: int) -> Plan | None:
    """What covey train runs before loading the model: refuse, with the plan's advice, a run whose
    estimated step is over REFUSE_OVER times the device's memory (memory_check: false skips it)."""
    if not args.memory_check:
        return None
    plan = make_plan(args, processes)
    if plan.clearly_too_big:
        raise MemoryPlanError(
            f"this run needs about {gib(plan.needed)} per device by covey's estimate, over {REFUSE_OVER}x the "
            f"{gib(plan.device.total)} of {plan.device.name}, so it cannot fit. "
            + advice_text(advice(plan)) + "\n(covey plan CONFIG shows the breakdown; memory_check: false "
            "(--memory-check false) trains anyway)")
    return plan
