"""The metrics of an optimizer step, under TRL's names, and their mean over a logging interval."""

from __future__ import annotations

import math

from covey import core
from covey.rewards.stoppable import HOWS, KINDS, take_stop_counts
from covey.train.batch import ScoredBatch, Update

# metrics that are a state or a running count: the last value of a logging interval, not its mean
LAST_OF_INTERVAL = ("learning_rate", "bad_steps", "rewards/errors")
# counts of events since the step before: the sum over a logging interval
SUM_OF_INTERVAL = tuple(f"{kind}/{how}" for kind in KINDS for how in HOWS)


def step_metrics(batch: ScoredBatch, update: Update, reward_names: list[str], reward_weights_F,
                 reward_metrics: dict[str, list[float]], dynamic_sampling: dict[str, float], reward_errors: int,
                 reported: frozenset[str] = frozenset()) -> dict[str, float]:
    """TRL's metric names for ``update``, computed over its generation batch (of every process) and the
    step's loss statistics; ``tokens_per_second``: the batch's completion tokens per second of its round
    so far (its generation and the optimizer steps on it up to this one). ``reported``: the loss
    statistics the run's variant reports (``core.reported_metrics``)."""
    samples, stats = batch.samples, update.totals
    lengths_B = samples.sequences.completion_mask_BT.sum(1).float()
    tokens = max(stats["tokens"], 1.0)
    rewards_B = core.weighted_reward_sum(samples.rewards_BF, reward_weights_F)
    metrics = {
        "reward": float(rewards_B.nanmean()),
        "reward_std": float(core.nanstd(rewards_B)),  # NaN (logged as null) where no reward is defined
        "frac_reward_zero_std": float(batch.zero_std_N.float().mean()),
    }
    for j, name in enumerate(reward_names):
        column = samples.rewards_BF[:, j]
        metrics[f"rewards/{name}/mean"] = float(column.nanmean())
        metrics[f"rewards/{name}/std"] = float(core.nanstd(column))
    metrics.update({name: sum(values) / len(values) for name, values in reward_metrics.items()})
    if "kl" in reported:
        metrics["kl"] = stats["kl_sum"] / tokens
    if "engine_counted" in stats:
        n = max(stats["engine_counted"], 1.0)
        metrics["engine_is/mean_weight"] = stats["engine_weight_sum"] / n
        metrics["engine_is/masked_fraction"] = stats["engine_masked"] / n
    metrics.update({"loss": stats["loss"], "policy_loss": stats["policy_loss"], "entropy": stats["entropy_sum"] / tokens})
    if "entropy_coef" in reported:  # the entropy bonus's, after the step's adaptive move
        metrics["entropy_coef"] = stats["entropy_coef"]
    if "clip_ratio" in reported:  # objectives that clip (the soft ones, sapo and vespo, do not)
        metrics.update({"clip_ratio/low_mean": stats["clip_low_sum"] / tokens,
                        "clip_ratio/high_mean": stats["clip_high_sum"] / tokens,
                        "clip_ratio/region_mean": (stats["clip_low_sum"] + stats["clip_high_sum"]) / tokens})
    if "vespo_phi" in reported:
        metrics["vespo/phi_seq_mean"] = stats["vespo_phi_sum"] / max(stats["vespo_sequences"], 1.0)
    if "aux_loss" in reported:  # a mixture-of-experts model's load-balancing loss (TRL's name)
        metrics["aux_loss"] = stats["aux_loss_sum"] / max(stats["aux_loss_count"], 1.0)
    if "off_policy_mask" in reported:
        metrics["off_policy_mask/masked_fraction"] = stats["off_policy_masked"] / max(stats["off_policy_sequences"], 1.0)
    metrics.update({
        "completions/mean_length": float(lengths_B.mean()),
        "completions/min_length": float(lengths_B.min()),
        "completions/max_length": float(lengths_B.max()),
        "completions/clipped_ratio": sum(r == "length" for r in samples.finish_reasons) / samples.size,
        **episode_metrics(samples.records),
        "learning_rate": update.learning_rate,
        "grad_norm": update.grad_norm,
        "bad_steps": float(update.bad_steps),
        "rewards/errors": float(reward_errors),
        **take_stop_counts(),  # reward and tool calls past their time limit, and workers lost, since the step before, in this process
        "step_time": update.step_time,
        **update.timings,
        **dynamic_sampling,
        "tokens_per_second": float(lengths_B.sum()) / update.round_time,
    })
    return metrics


def interval_mean(steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of the steps since the last logged one, as TRL logs them: each the mean of its
    finite values over those steps (NaN where it had none), but state and counts as of the last, and
    the counts of events since the step before (calls stopped) summed."""
    merged = {}
    for key in dict.fromkeys(k for step in steps for k in step):
        values = [step[key] for step in steps if key in step]
        finite = [v for v in values if math.isfinite(v)]
        if key in SUM_OF_INTERVAL:
            merged[key] = sum(values)
        else:
            merged[key] = values[-1] if key in LAST_OF_INTERVAL else sum(finite) / len(finite) if finite else math.nan
    return merged


def episode_metrics(records: list[dict]) -> dict[str, float]:
    """Over a batch of episodes (none for single completions): model turns per episode, tool calls per
    episode, the share of calls that failed (TRL's names for the two), malformed calls per episode, and
    the shares of episodes cut by the turn limit and by the length limit (tool results that did not
    fit, or a turn the budget ended)."""
    episodes = [(r["episode"], r["finish_reason"]) for r in records if "episode" in r]
    if not episodes:
        return {}
    n, calls = len(episodes), sum(e["tool_calls"] for e, _ in episodes)
    return {"episodes/turns": sum(e["turns"] for e, _ in episodes) / n,
            "tools/call_frequency": calls / n,
            "tools/failure_frequency": sum(e["tool_errors"] for e, _ in episodes) / calls if calls else 0.0,
            "tools/malformed_frequency": sum(e["malformed_calls"] for e, _ in episodes) / n,
            "episodes/cut_by_turn_limit": sum(e["cut"] == "turns" for e, _ in episodes) / n,
            "episodes/cut_by_length": sum(e["cut"] == "length" or reason == "length" for e, reason in episodes) / n}
