"""The plan as text: the breakdown, whether it fits, the advice; and the probe's timing."""

from __future__ import annotations

from covey.plan.advice import Suggestion


# keep_freed_memory on a CPU: what the C library keeps is not in the estimate (docs/plan.md)
KEPT_MEMORY_NOTE = ("keep_freed_memory: the C library keeps freed memory for reuse, which the estimate does not "
                    "count: where the training pass cannot reuse the blocks sampling freed, the peak is higher "
                    "(examples/gsm8k.yaml: 7% higher); keep_freed_memory: false for the peak estimated here")


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if abs(n) >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB"


def advice_text(suggestions: list[Suggestion]) -> str:
    if not suggestions:
        return "No single setting covey knows brings it within the device: use a smaller model or a larger device."
    if len(suggestions) == 1 and not suggestions[0].fits:
        return (f"Even with {suggestions[0].describe()} it would need {gib(suggestions[0].needed)}: use a smaller "
                "model or a larger device.")
    lines = ["Settings that would fit (each estimated):"] + [
        f"  - {s.describe()}  ->  {gib(s.needed)}" for s in suggestions]
    return "\n".join(lines)


def whole_logits_budget_mib(s, vocab: int) -> int | None:
    """The smallest ``logprob_budget_mib`` whose chunk holds a micro-batch's completion tokens, where the
    budget is smaller and the head trains (its backward then computes the other chunks' logits again); else
    None."""
    tokens = s.micro_batch * s.completion_length
    if s.trains_lora or s.logprob_chunk is None or tokens <= s.logprob_chunk:
        return None
    return -(-tokens * vocab * 4 // 2**20)


def plan_text(plan, suggestions: list[Suggestion] | None = None) -> str:
    """The whole plan, as covey plan prints it."""
    shape, s, b, device = plan.shape, plan.settings, plan.breakdown, plan.device
    training = "LoRA" + (f" on {s.quantization} weights" if s.quantization else "") if s.trains_lora else "full fine-tuning"
    dtype = {4: "float32", 2: "bfloat16/float16"}[s.weight_bytes] + (" + bf16 autocast" if s.bf16_autocast else "")
    over = (f"FSDP2 ({s.fsdp}) over {s.processes} processes" if s.sharded else
            f"DDP over {s.processes} processes" if s.processes > 1 else "one process")
    lines = [
        f"model: {plan.args.model} ({shape.model_type}: {shape.params / 1e6:,.1f}M parameters, vocabulary "
        f"{shape.vocab:,}, hidden {shape.hidden}, {shape.layers} layers)",
        f"run: {training}, {dtype}, {over}; micro-batch {s.micro_batch} x ({s.prompt_length} prompt + "
        f"{s.completion_length} completion tokens); {s.generation_rows} completions sampled per round by the "
        f"{s.engine} engine" + ("; gradient checkpointing" if s.gradient_checkpointing else ""),
        plan.prompts.describe(),
        "",
        "peak memory of a step, per device:",
    ]
    for name, value in b.parts():
        lines.append(f"  {name:<26}{gib(value):>12}")
    if device.runtime:
        lines.append(f"  {'runtime (python, torch)':<26}{gib(device.runtime):>12}")
    lines.append(f"  {'peak (' + b.phase + ')':<26}{gib(plan.needed):>12}")
    from covey.plan.planning import replan

    if not s.gradient_checkpointing:
        with_ckpt = replan(plan, gradient_checkpointing=True).breakdown.activations
        lines.append(f"  (activations with gradient checkpointing: {gib(with_ckpt)})")
    whole = whole_logits_budget_mib(s, shape.vocab)
    if whole is not None:
        lines.append(f"  (logprob_budget_mib: {whole} holds every logit of a micro-batch and computes none again, "
                     f"faster: peak {gib(replan(plan, logprob_budget_mib=whole).needed)})")
    lines += [f"  note: {note}" for note in b.notes]
    if device.kind == "cpu" and plan.args.keep_freed_memory:
        lines.append(f"  note: {KEPT_MEMORY_NOTE}")
    lines += ["", f"device: {device.name}: {gib(device.total)}, {gib(device.available)} available"]
    if plan.fits:
        lines.append(f"fits: yes ({gib(device.available - plan.needed)} to spare)")
    else:
        lines.append(f"fits: no (needs {gib(plan.needed - device.available)} more than is available)")
        if suggestions is not None:
            lines.append(advice_text(suggestions))
    return "\n".join(lines)
