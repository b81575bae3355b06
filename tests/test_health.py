"""Health warnings fire on the patterns they describe, once each, and not on a healthy run."""

import json

import pytest
import torch

import covey.core as core
from covey.errors import NumericsError
from covey.telemetry.health import HealthMonitor
from tests.conftest import optimize, scored_batch
from tests.test_trainer_variants import trainer_for

HEALTHY = {"reward": 0.5, "reward_std": 0.3, "frac_reward_zero_std": 0.1, "kl": 0.05, "completions/clipped_ratio": 0.1}


def history(n, **changes):
    rows = []
    for i in range(n):
        row = dict(HEALTHY, reward=0.5 + 0.01 * i)
        row.update({k: (v(i) if callable(v) else v) for k, v in changes.items()})
        rows.append(row)
    return rows


@pytest.mark.parametrize("changes, phrase", [
    (dict(reward_std=0.0), "reward_std has stayed below 0.01"),
    (dict(frac_reward_zero_std=0.8), "over half of the groups had identical rewards"),
    (dict(kl=0.9), "KL to the reference is 0.90"),
    (dict(kl=None), "KL to the reference is not finite"),  # a NaN or infinite KL is logged as null
    (dict(reward=lambda i: 0.25), "mean reward has not moved"),
    ({"completions/clipped_ratio": 0.9}, "hit max_completion_length"),
])
def test_each_rule_fires_once_on_its_pattern(changes, phrase):
    monitor = HealthMonitor()
    shown = []
    rows = history(12, **changes)
    for i in range(1, len(rows) + 1):
        shown.extend(monitor.check(rows[:i]))
    assert sum(phrase in m for m in shown) == 1, shown


def test_undefined_reward_spread_is_not_read_as_a_collapse():
    monitor = HealthMonitor()
    rows = history(12, reward=None, reward_std=None)  # no reward defined in any step: logged as null
    shown = [m for i in range(1, 13) for m in monitor.check(rows[:i])]
    assert not any("stayed below" in m for m in shown), shown


def test_healthy_run_only_gets_the_notes():
    monitor = HealthMonitor()
    rows = history(12)
    shown = [m for i in range(1, 13) for m in monitor.check(rows[:i])]
    assert len(shown) == 2 and "loss near 0 is expected" in shown[0], shown
    assert "no held-out evaluation during training" in shown[1] and "eval_steps" in shown[1]


def _noise(i):
    return 0.08 * (((i * 7919) % 11) - 5) / 5  # a deterministic scatter of +-0.08 around 0


def _shown_at(rows, phrase):
    monitor = HealthMonitor()
    return [i for i in range(1, len(rows) + 1) for m in monitor.check(rows[:i]) if phrase in m]


@pytest.mark.parametrize("trend, phrase", [(0.0, "not clearly above where it started"),
                                           (-0.005, "has fallen (0.284 over the first 10")])
def test_a_noisy_flat_or_falling_reward_is_reported_once_after_30_logged_steps(trend, phrase):
    rows = history(60, reward=lambda i: 0.3 + trend * i + _noise(i))
    assert _shown_at(rows, phrase) == [30]


@pytest.mark.parametrize("changes", [dict(reward=lambda i: 0.2 + 0.01 * i + _noise(i)),  # rising
                                     dict(reward=lambda i: 1.9 + _noise(i), frac_reward_zero_std=0.8)])  # solved
def test_a_rising_or_already_solved_reward_is_not_reported(changes):
    rows = history(60, **changes)
    assert _shown_at(rows, "mean reward") == []


def _nan_loss_for_steps(monkeypatch, trainer, bad_steps):
    original = core.policy_loss

    def maybe_nan(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        return (loss * float("nan"), stats) if trainer.global_step + 1 in bad_steps else (loss, stats)

    monkeypatch.setattr(core, "policy_loss", maybe_nan)


def test_a_nan_step_is_skipped_and_counted(tmp_path, tokenizer, monkeypatch):
    trainer = trainer_for(tmp_path, tokenizer, max_steps=3)
    _nan_loss_for_steps(monkeypatch, trainer, bad_steps={1})
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    batch, fixed = scored_batch(trainer, [0, 1])
    optimize(trainer, batch, fixed)  # step 1
    assert trainer.progress.bad_steps == 1 and all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    optimize(trainer, batch, fixed)  # step 2
    assert trainer.progress.consecutive_bad_steps == 0 and any(not torch.equal(before[n], p)
                                                               for n, p in trainer.model.named_parameters())


def test_the_run_stops_after_too_many_bad_steps_in_a_row(tmp_path, tokenizer, monkeypatch):
    trainer = trainer_for(tmp_path, tokenizer, max_steps=5, max_consecutive_bad_steps=2)
    _nan_loss_for_steps(monkeypatch, trainer, bad_steps={1, 2, 3, 4, 5})
    with pytest.raises(NumericsError, match="2 steps in a row had NaN/inf gradients"):
        trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["bad_steps"] == 1.0 and metrics[0]["loss"] is None  # NaN is written as null
