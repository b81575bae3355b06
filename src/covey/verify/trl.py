"""covey verify for a TRL pipeline: the stage checks run on a ``trl.GRPOTrainer`` the user built.

``verify_trl(trainer)`` drives the trainer's own code paths (whatever TRL is installed, patched copies
included) on completions whose token ids it chooses, and checks each stage against a computation
written here:

    data        the columns the reward functions read are in the dataset, and reach them row by row
    decode      the text a reward function receives for a plain answer, a closed <think> block and an
                unterminated one, against the tokenizer's own decode of those ids (the answer alone where
                TRL parses the reasoning apart)
    rewards     one value per completion, each the function's value for that completion alone; able to
                tell the row's reference answer from an empty completion; the weights TRL applies
    advantages  TRL's against a recomputation from its rewards: mean zero per group, order follows
                reward, a small epsilon, constant groups zero
    logprobs    TRL's per-token log-probs against log_softmax gathered at the token, all <= 0, the loss
                mask without padding and with the EOS token
    loss        TRL's loss at ratio 1 and away from it against the formula of its loss_type; KL >= 0 and
                0 at the reference
    direction   one small step (then undone) raises each group's best completion against its worst

``run_until_train(script, argv)`` runs a user's script unchanged up to its ``trainer.train()`` and
returns that trainer instead of training. Nothing is written to the output folder or pushed.
Where the installed TRL lacks an internal a stage needs, that stage says it cannot check this version.

The checks up to the scored batch (setup, data, decode, rewards) are in ``covey.verify.trl_batch``; those of
what TRL trains on that batch (advantages, log-probs, loss, direction) in ``covey.verify.trl_training``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

from covey.verify.report import Report
from covey.verify.trl_batch import STAGES
from covey.verify.trl_training import Checks


class _Stop(BaseException):
    """Raised in place of ``GRPOTrainer.train`` to hand the trainer back."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer


def run_until_train(script: str | Path, argv: list[str]) -> Any:
    """Run ``script`` with ``argv`` as its arguments, as ``python script argv...`` would, until it calls
    ``train()`` on a ``trl.GRPOTrainer``; that trainer (the script stops there). An error names the script."""
    import trl

    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"covey verify --trl: {script} is not a file; give the path of your TRL training "
                                "script, then its own arguments")
    original = trl.GRPOTrainer.train

    def stop(self, *args, **kwargs):
        raise _Stop(self)

    saved_argv, saved_path = sys.argv, list(sys.path)
    trl.GRPOTrainer.train = stop
    sys.argv, sys.path[0:0] = [str(script), *argv], [str(script.parent.resolve())]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Stop as stopped:
        return stopped.trainer
    finally:
        trl.GRPOTrainer.train = original
        sys.argv, sys.path[:] = saved_argv, saved_path
    raise RuntimeError(f"{script} ended without calling train() on a trl.GRPOTrainer: covey verify --trl checks the "
                       "trainer a script is about to train")


def verify_trl(trainer: Any, num_prompts: int = 2) -> Report:
    """The stage checks on a ``trl.GRPOTrainer`` (not trained, not saved); the report."""
    report = Report(STAGES)
    check = Checks(trainer, report, num_prompts)
    with check.trainer_left_as_it_was():
        check.guarded("setup", check.setup)
        if check.ready:
            check.guarded("data", check.data)
            batch = check.guarded("data", check.score)
            if batch is not None:
                check.guarded("decode", check.decode)
                check.guarded("rewards", check.rewards)
                check.guarded("advantages", check.advantages)
                logp = check.guarded("logprobs", check.logprobs)
                if logp is not None:
                    check.guarded("loss", check.loss, logp)
                    check.guarded("direction", check.direction)
    return report
