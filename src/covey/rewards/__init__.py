"""Rewards: the TRL calling convention, scoring a batch, the built-ins, loading the user's own
(``file.py:function``) and reward models, the worker pool and the sandboxed code runner. Rewards know
nothing of the trainer: they receive text, token ids and dataset columns.

    convention.py  the call, its names and the checks that a function and a dataset fit it
    scoring.py     every function on a batch; failures retried one completion at a time
    builtin.py     answer_format, answer_correct, reasoning_format, json_format, soft_overlong_penalty, code_tests
    trl_rewards.py TRL's built-ins under their names: accuracy_reward, think_format_reward, get_* factories
    reward_model.py a sequence classifier (hub id, folder or object) as a reward function
    loading.py     a function from its name or reference
    probes.py      each function scored on completions built to cheat it, beside a correct answer
    probe_set.py   those completions: the answer formats and the reward-hacking modes
    answers.py     reading the answer a completion gives
    symbolic.py    answers compared as mathematics by math-verify, in worker processes under a time limit
    pool.py        worker processes for slow synchronous functions
    code.py, sandbox.py, sandbox_boot.py   running a completion's program contained
"""

from covey.rewards.builtin import (BUILTIN_REWARD_FACTORIES, BUILTIN_REWARDS, SoftOverlongPenalty, answer_correct,
                                   answer_format, json_format, reasoning_format)
from covey.rewards.convention import (TRAINER_REWARD_ARGS, RewardFunc, TrainerState, check_reward_columns,
                                      check_reward_signature, required_columns, reward_context, reward_name,
                                      without_logging)
from covey.rewards.loading import NAMED_REWARDS, load_reward_func, reward_reference
from covey.rewards.pool import RewardPool
from covey.rewards.probes import ProbeFinding, ProbeReport, probe_rewards
from covey.rewards.reward_model import RewardModel, load_reward_model
from covey.rewards.scoring import call_reward, preflight_check, returned_values, score_completions
from covey.rewards.trl_rewards import (accuracy_reward, get_cosine_scaled_reward, get_repetition_penalty_reward,
                                       get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward)

__all__ = ["BUILTIN_REWARD_FACTORIES", "BUILTIN_REWARDS", "SoftOverlongPenalty", "answer_correct", "answer_format",
           "json_format", "reasoning_format", "TRAINER_REWARD_ARGS", "RewardFunc", "TrainerState",
           "check_reward_columns", "check_reward_signature", "required_columns", "reward_context", "reward_name",
           "without_logging", "NAMED_REWARDS", "load_reward_func", "reward_reference", "RewardPool", "ProbeFinding",
           "ProbeReport", "probe_rewards", "RewardModel", "load_reward_model", "call_reward", "preflight_check",
           "returned_values", "score_completions",
           "accuracy_reward", "get_cosine_scaled_reward", "get_repetition_penalty_reward",
           "get_soft_overlong_punishment", "reasoning_accuracy_reward", "think_format_reward"]
