"""Tables and texts for people: the completions of a step, the held-out evaluation before and after
training (terminal, model card, report), and the model card."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from covey.data.text import prompt_text
from covey.telemetry.plain import print_table


def percent(fraction: float | None) -> str:
    """An accuracy as shown: a percentage, or n/a where there was nothing to check against."""
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"


def accuracy_change(before: dict, after: dict) -> float | None:
    """after - before, or None where either has no accuracy."""
    if before["accuracy"] is None or after["accuracy"] is None:
        return None
    return after["accuracy"] - before["accuracy"]


def before_after_rows(before: dict | None, after: dict | None) -> list[list[str]]:
    """[label, accuracy, mean reward, n] of the held-out evaluation before and after training (those
    present), then their change when both are: the one table the terminal, model card and report show."""
    def reward(value: float | None, sign: str = "") -> str:  # NaN (no reward applied) is saved as null
        return "n/a" if value is None or math.isnan(value) else f"{value:{sign}.3f}"

    rows = [[label, percent(r["accuracy"]), reward(r["mean_reward"]), str(r["n"])]
            for label, r in (("before", before), ("after", after)) if r]
    if before and after:
        change = accuracy_change(before, after)
        reward_change = None if None in (before["mean_reward"], after["mean_reward"]) else \
            after["mean_reward"] - before["mean_reward"]
        rows.append(["change", "n/a" if change is None else f"{100 * change:+.1f} pts", reward(reward_change, "+"), ""])
    return rows


def completions_table(records: list[dict], title: str) -> Table:
    """Prompt, completion, each reward, the weighted total and the advantage, one row per completion
    (the prompt is shown once per group)."""
    names = list(records[0]["rewards"])
    table = Table(title=title, show_lines=True)
    for column in ("prompt", "completion", *names, "total", "advantage"):
        table.add_column(column, overflow="fold")
    previous = None
    for record in records:
        prompt = prompt_text(record["prompt"])
        scores = ["None" if record["rewards"][n] is None else f"{record['rewards'][n]:.3g}" for n in names]
        total = "None" if record["reward"] is None else f"{record['reward']:.3g}"
        table.add_row("" if prompt == previous else prompt, record["completion"], *scores, total,
                      f"{record['advantage']:+.3f}")
        previous = prompt
    return table


def print_summary(console: Console, before: dict | None, after: dict | None, run_dir: Path) -> None:
    rows = before_after_rows(before, after)
    if rows:  # none where the run evaluated nothing (eval_max_samples: 0)
        table = Table(title="held-out evaluation (greedy)")
        table.add_column("")
        for column in ("accuracy", "mean reward", "n"):
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*row)
        print_table(console, table)
    console.print(f"run folder: {run_dir}  (a plain model of it for transformers: covey export "
                  f"{shlex.quote(str(run_dir))} OUT)")


def model_card(base_model: str, dataset: str, reward_names: list[str], reward_weights: list[float],
               hyperparameters: dict[str, Any], steps: int, before: dict | None, after: dict | None,
               adapter: bool) -> str:
    """A Hugging Face model card (README.md with YAML front matter) for the trained model."""
    # a hub id only ("org/name"), never a local folder that happens to hold one slash
    hub_id = base_model.count("/") == 1 and not base_model.startswith((".", "/", "~")) and not Path(base_model).exists()
    front = ["---", f"base_model: {base_model}" if hub_id else f"# base model: {base_model}",
             "library_name: " + ("peft" if adapter else "transformers"),
             "tags:", "- grpo", "- covey", "---"]
    lines = [*front, "", f"# {'LoRA adapter' if adapter else 'Model'} trained with GRPO (covey)", "",
             f"- base model: `{base_model}`", f"- training data: `{dataset}`", f"- optimizer steps: {steps}", "",
             "## Rewards", "", "| reward | weight |", "|---|---|"]
    lines += [f"| {name} | {weight:g} |" for name, weight in zip(reward_names, reward_weights)]
    lines += ["", "## Hyperparameters", "", "| field | value |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in hyperparameters.items()]
    if before and after:
        lines += ["", "## Held-out evaluation (greedy)", "", "| | accuracy | mean reward | n |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in before_after_rows(before, after)]
    return "\n".join(lines) + "\n"
