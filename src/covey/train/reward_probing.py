"""The reward probes before the first step (``reward_probes``): a small set of the probes of
``covey.rewards.probes`` on two training rows when the trainer is built, each finding shown as a warning
with its evidence, and all of them written to the run folder once training takes it (reward_probes.json,
which the run report shows). They never stop a run."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Sequence

from covey.config import GRPOConfig
from covey.rewards import RewardFunc, RewardModel, probe_rewards, reward_name
from covey.rewards.probes import ProbeReport
from covey.telemetry.probe_findings import FILE

ROWS = 2  # rows probed: with two calls per function, a few dozen completions scored


def probe_before_training(args: GRPOConfig, funcs: Sequence[RewardFunc], rows: list[dict],
                          tokenizer: Any) -> ProbeReport | None:
    """Probe ``funcs`` (reward models left to covey verify: each probe is a forward pass) on ROWS of ``rows``
    and warn of each finding; the report, for ``write_probe_findings``."""
    probed = [f for f in funcs if not isinstance(f, RewardModel)]
    try:
        report = probe_rewards(probed, rows, tokenizer=tokenizer, max_completion_length=args.max_completion_length,
                               num_rows=ROWS, timeout=args.reward_timeout, strip_reasoning=args.strip_reasoning)
    except Exception as e:  # the probes only inform: whatever goes wrong in them, the run goes on
        warnings.warn(f"the reward probes could not run ({type(e).__name__}: {e}); training goes on without them",
                      stacklevel=2)
        return None
    report.notes += [f"{reward_name(f)} is a reward model: not probed before training (covey verify probes it)"
                     for f in funcs if isinstance(f, RewardModel)]
    for finding in report.findings:
        warnings.warn(f"reward probe: {finding.text()} (training goes on; reward_probes: false turns the probes "
                      "off)", stacklevel=2)
    return report


def write_probe_findings(run_dir: Path, report: ProbeReport | None) -> None:
    """reward_probes.json in the run folder (nothing where the probes did not run)."""
    if report is not None:
        (run_dir / FILE).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
