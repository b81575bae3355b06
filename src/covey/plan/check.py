"""What covey train runs before it loads the model: refuse a step clearly too big for the device."""

from __future__ import annotations

import dataclasses

from covey.config import GRPOConfig
from covey.errors import ConfigError
from covey.plan.advice import advice
from covey.plan.memory import estimate
from covey.plan.planning import REFUSE_OVER, Plan, make_plan
from covey.plan.prompts import measure_prompts
from covey.plan.report import advice_text, gib
from covey.plan.shapes import model_config


class MemoryPlanError(ConfigError):
    """A run whose estimated peak memory is clearly beyond the device's."""


class MemoryCheckSkipped(Exception):
    """The estimate could not read the run's config, so the memory check did not run; the message says why
    (the trainer's own loading then says what is wrong). A note for the caller to show, not a refusal."""


def least_the_user_asked_for(plan: Plan) -> Plan:
    """``plan`` with what covey chose rather than the user taken at its least: prompts the data was not read
    for, bounded by a max_prompt_length left at covey's default, as short as the data may make them (none).
    What the check refuses is then what the user asked for, or the data measured, never a default of covey's."""
    if plan.prompts.measured or "max_prompt_length" in getattr(plan.args, "fields_given", ()):
        return plan
    settings = dataclasses.replace(plan.settings, prompt_length=0)
    return dataclasses.replace(plan, settings=settings, breakdown=estimate(plan.shape, settings))


def check_fits(args: GRPOConfig, processes: int, train_dataset=None, tools: bool = False) -> Plan | None:
    """What covey train runs before loading the model: refuse, with the plan's advice, a run whose
    estimated step is over REFUSE_OVER times the device's memory even at the least the user asked for
    (``least_the_user_asked_for``); memory_check: false skips the check. The prompts are measured as
    ``covey plan`` measures them (``train_dataset``: the rows handed to the trainer; ``tools``: the run's
    prompts show tools, known once it starts). A config the estimate cannot read raises ``MemoryCheckSkipped``."""
    if not args.memory_check:
        return None
    try:
        config = model_config(args.model, args.trust_remote_code, args.model_revision)  # before the data is read
        plan = make_plan(args, processes, config=config, prompts=measure_prompts(args, train_dataset, tools))
    except Exception as e:  # a config the estimate cannot read: the trainer's own loading says what is wrong
        raise MemoryCheckSkipped(f"covey: the memory check was skipped: {e}") from e
    least = least_the_user_asked_for(plan)
    if least.clearly_too_big:
        raise MemoryPlanError(
            f"this run needs about {gib(least.needed)} per device by covey's estimate, over {REFUSE_OVER}x the "
            f"{gib(plan.device.total)} of {plan.device.name}, so it cannot fit. "
            + advice_text(advice(plan)) + "\n(covey plan CONFIG shows the breakdown; memory_check: false "
            "(--memory-check false) trains anyway)")
    return plan
