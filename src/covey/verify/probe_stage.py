"""covey verify's probes stage: every reward function scored on completions built to collect reward
without doing the task (``covey.rewards.probes``), against a correct answer where the data has one, else
against the batch the model sampled. A finding fails the stage unless accepted (``--accept-probe``)."""

from __future__ import annotations

from typing import Sequence

from covey.rewards import probe_rewards, reward_name
from covey.rewards.answers import completion_text
from covey.rewards.probe_set import REFERENCE_COLUMNS
from covey.train.parts import StepParts
from covey.verify.report import Report

ROWS = 8  # rows of the data probed


def accepts(accepted: Sequence[str], reward: str, probe: str) -> bool:
    """Whether ``--accept-probe`` names this finding: ``FUNCTION:PROBE``, or ``FUNCTION`` for all of its probes."""
    return reward in accepted or f"{reward}:{probe}" in accepted


def check_probes(report: Report, parts: StepParts, indices: list[int], calls: list[dict],
                        accepted: Sequence[str] = ()) -> None:
    """The full probe set on ROWS rows, a row per finding (FAIL, or WARN where accepted) and per function
    that nothing fooled (PASS); without a reference column the yardstick is the model's samples of the
    batch (``calls``: the rewards' calls on it, ``indices``: its rows). The functions are also judged together,
    with the run's reward_weights, and a run with tools against an episode that calls one and never answers."""
    args, rows, agent = parts.args, parts.prompts.rows, parts.sampler.agent
    with_reference = any(rows[0].get(c) not in (None, "") for c in REFERENCE_COLUMNS)
    samples = None
    if not with_reference:
        rows = [rows[i] for i in indices]
        texts = [completion_text(c) for c in calls[0]["completions"]] if calls else []
        G = args.num_generations
        samples = [texts[k * G:(k + 1) * G] for k in range(len(indices))] if texts else None
    result = probe_rewards(parts.rewards.funcs, rows, samples=samples, tokenizer=parts.sampler.tokenizer,
                           max_completion_length=args.max_completion_length, num_rows=ROWS,
                           timeout=args.reward_timeout, strip_reasoning=args.strip_reasoning,
                           weights=parts.rewards.weights, tools=[t.name for t in agent.tools] if agent else ())
    for finding in result.findings:
        known = accepts(accepted, finding.reward, finding.probe)
        report.add("probes", f"{finding.reward} against {finding.probe}", False,
                   f"{finding.score:.3g} vs yardstick {finding.yardstick:.3g}" + (" (accepted)" if known else ""),
                   finding.text() + ("" if known else f". Accept a known one: --accept-probe "
                                     f"{finding.reward}:{finding.probe}"), warn_only=known)
    for name, scores in result.scores.items():
        if name not in {f.reward for f in result.findings}:
            probed = [key for key in scores if key != "yardstick" and not key.startswith("length_")]
            report.add("probes", f"{name} is not fooled by a probe", True,
                       f"{len(probed)} probes and length on {result.rows} rows against {result.yardstick}")
    for note in result.notes:
        report.add("probes", "reward probed", False, "not probed" if "not probed" in note else "partly", note,
                   warn_only=True)
    named = {reward_name(f) for f in parts.rewards.funcs}
    for name in accepted:
        if not set(name.split(":", 1)[0].split("+")) <= named:  # a finding of functions together joins them by +
            report.add("probes", f"--accept-probe {name}", False, "no such reward function",
                       f"the reward functions are {', '.join(sorted(named))}: name one as FUNCTION or FUNCTION:PROBE",
                       warn_only=True)
