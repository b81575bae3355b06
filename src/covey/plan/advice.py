"""Settings that would make an over-budget run fit, each estimated again.

Each suggestion changes what the user can change in the config: a log-prob budget above the default back
to it, the micro-batch (halved, with twice the gradient accumulation so the step trains on the same
completions), gradient checkpointing, LoRA, FSDP2 sharding over the processes launched (or more of them),
shorter completions, a smaller vLLM share. Single changes come first; where none fits alone, they are
combined in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

from covey.core import LOGPROB_CHUNK_BYTES
from covey.errors import ConfigError


@dataclass(frozen=True)
class Suggestion:
    changes: dict  # config field -> value
    processes: int  # the processes it runs over
    needed: int  # the estimate with it: the step's peak plus the runtime
    fits: bool

    def describe(self) -> str:
        fields = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in self.changes.items())
        return fields + (f" over {self.processes} processes" if self.processes > 1 else "")


def candidate_changes(plan) -> list[tuple[dict, int]]:
    """(config changes, processes) worth trying for ``plan``, single changes in order of cost to the run."""
    args, s = plan.args, plan.settings
    out: list[tuple[dict, int]] = []
    if args.logprob_budget_bytes(plan.shape.vocab, plan.device.available) > LOGPROB_CHUNK_BYTES:  # slower, same run
        out.append(({"logprob_budget_mib": LOGPROB_CHUNK_BYTES // 2**20}, s.processes))
    if args.per_device_train_batch_size > 1:
        micro = args.per_device_train_batch_size
        for smaller in (micro // 2, micro // 4, 1):
            if smaller >= 1 and micro % smaller == 0 and smaller < micro:
                factor = micro // smaller
                out.append(({"per_device_train_batch_size": smaller,
                             "gradient_accumulation_steps": args.gradient_accumulation_steps * factor,
                             **({"steps_per_generation": args.steps_per_generation * factor}
                                if args.steps_per_generation else {})}, s.processes))
    if not args.gradient_checkpointing:
        out.append(({"gradient_checkpointing": True}, s.processes))
    if not s.trains_lora:
        out.append(({"use_peft": True}, s.processes))
    if not s.sharded:
        for processes in ([s.processes] if s.processes > 1 else [2, 4, 8]):
            out.append(({"fsdp": "full_shard"}, processes))
    if s.engine == "vllm" and args.vllm_gpu_memory_utilization > 0.1:
        out.append(({"vllm_gpu_memory_utilization": round(args.vllm_gpu_memory_utilization / 2, 2)}, s.processes))
    for shorter in (args.max_completion_length // 2, args.max_completion_length // 4):
        if shorter >= 1:
            out.append(({"max_completion_length": shorter}, s.processes))
    return out


def advice(plan, most: int = 6) -> list[Suggestion]:
    """Suggestions for ``plan``: the single changes that fit, each with its estimate; if none does, the
    changes combined one after another until the run fits (or every change is spent)."""
    from covey.plan.planning import replan

    tried: list[Suggestion] = []
    for changes, processes in candidate_changes(plan):
        try:
            other = replan(plan, processes, **changes)
        except ConfigError:  # a combination the config refuses
            continue
        tried.append(Suggestion(changes, processes, other.needed, other.fits))
    fitting = [t for t in tried if t.fits]
    if fitting:
        return sorted(fitting, key=lambda t: t.needed, reverse=True)[:most]  # the least change to the run first
    strongest: dict[str, tuple[dict, int]] = {}  # of each kind of change, the last (strongest) candidate
    for changes, processes in candidate_changes(plan):
        strongest[next(iter(changes))] = (changes, processes)
    combined, processes, last = {}, plan.settings.processes, None
    for changes, p in strongest.values():
        try:
            current = replan(plan, p, **{**combined, **changes})
        except ConfigError:
            continue
        combined, processes = {**combined, **changes}, p
        last = Suggestion(dict(combined), processes, current.needed, current.fits)
        if current.fits:
            break
    return [last] if last else []
