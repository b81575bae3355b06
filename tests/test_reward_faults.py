"""Faults in user reward code: raises, hangs, async functions; contained or reported by name."""

import asyncio
import json
import time

import pytest

from covey import GRPOConfig, GRPOTrainer
from covey.errors import RewardError
from covey.rewards import score_completions
from tests.conftest import make_model
from tests.test_trainer import ROWS, small_args

COMPLETIONS = ["fine", "boom", "fine too"]


def explodes_on_boom(completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("cannot parse")
    return [1.0] * len(completions)


def test_a_raise_names_the_function_the_sample_and_its_text():
    with pytest.raises(RewardError, match=r"'explodes_on_boom' raised ValueError: cannot parse on completion 1: 'boom'"):
        score_completions([explodes_on_boom], ["p"] * 3, COMPLETIONS, [[1]] * 3, {})


def test_skip_scores_only_the_failing_sample_none():
    errors = []
    table = score_completions([explodes_on_boom], ["p"] * 3, COMPLETIONS, [[1]] * 3, {}, on_error="skip", errors=errors)
    assert table[:, 0].tolist()[0] == 1.0 and table[:, 0].isnan().tolist() == [False, True, False]
    assert errors == [("explodes_on_boom", 1, "raised ValueError: cannot parse")]


def test_a_hanging_reward_times_out():
    def hangs_on_boom(completions, **kwargs):
        if any("boom" in c for c in completions):
            time.sleep(5)
        return [0.5] * len(completions)

    start = time.perf_counter()
    errors = []
    table = score_completions([hangs_on_boom], ["p"] * 3, COMPLETIONS, [[1]] * 3, {}, on_error="skip",
                              timeout=0.2, errors=errors)
    assert time.perf_counter() - start < 3
    assert table[:, 0].isnan().tolist() == [False, True, False]
    assert "reward_timeout=0.2" in errors[0][2]
    with pytest.raises(RewardError, match="took longer than reward_timeout=0.2s on completion 1"):
        score_completions([hangs_on_boom], ["p"] * 3, COMPLETIONS, [[1]] * 3, {}, timeout=0.2)


def test_async_rewards_run_concurrently():
    async def slow_a(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow_b(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)

    start = time.perf_counter()
    table = score_completions([slow_a, slow_b], ["p"] * 3, COMPLETIONS, [[1]] * 3, {})
    elapsed = time.perf_counter() - start
    assert table[0].tolist() == [1.0, 2.0]
    assert elapsed < 0.55, elapsed  # run one after the other they would take 0.6 s


def test_batch_only_failures_are_reported():
    def fails_on_big_batches(completions, **kwargs):
        if len(completions) > 1:
            raise MemoryError("batch too big")
        return [0.0]

    with pytest.raises(RewardError, match="on the batch of 3, though each completion alone scores fine"):
        score_completions([fails_on_big_batches], ["p"] * 3, COMPLETIONS, [[1]] * 3, {})


def test_the_trainer_skips_counts_and_warns_once(tmp_path, tokenizer):
    def flaky(completions, **kwargs):
        texts = [c[0]["content"] for c in completions]
        if any(len(t) % 2 for t in texts):
            raise KeyError("odd length")
        return [len(set(t)) / 8 for t in texts]

    args = small_args(tmp_path, eval_max_samples=0, max_steps=2, reward_errors="skip")
    trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[flaky], args=args, train_dataset=ROWS,
                          processing_class=tokenizer, quiet=True)
    with pytest.warns(UserWarning, match="scored None") as caught:
        trainer.train()
    assert len([w for w in caught if "scored None" in str(w.message)]) <= 1
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["rewards/errors"] >= 1


def test_reward_settings_are_validated():
    with pytest.raises(Exception, match="reward_timeout=-1.0 must be positive"):
        GRPOConfig(reward_timeout=-1)
    with pytest.raises(Exception, match="reward_errors='ignore' is not one of raise, skip"):
        GRPOConfig(reward_errors="ignore")


def test_a_hung_reward_call_never_holds_up_the_process_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(
        "import time\n"
        "from covey.rewards import score_completions\n"
        "def hangs(completions, **kw):\n"
        "    time.sleep(600)\n"
        "table = score_completions([hangs], ['p'], ['c'], [[1]], {}, on_error='skip', timeout=0.2)\n"
        "print('scored', table.isnan().all().item())\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "scored True" in done.stdout, done.stderr
    assert time.monotonic() - start < 120  # not the 600 s the abandoned call sleeps


def test_async_rewards_score_where_an_event_loop_already_runs():
    async def halves(completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    async def notebook_cell():  # as in a notebook, whose cells run inside a loop
        return score_completions([halves], ["p", "q"], ["a", "b"], [[1], [2]], {}, timeout=5.0)

    assert asyncio.run(notebook_cell()).flatten().tolist() == [0.5, 0.5]
