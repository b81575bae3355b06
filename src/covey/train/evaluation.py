"""Held-out evaluation: greedy completions scored for accuracy and mean reward."""

from __future__ import annotations

from typing import Sequence

import torch

from covey.config import GRPOConfig
from covey.core import weighted_reward_sum
from covey.data import extra_columns, is_conversational
from covey.data.text import decode_completions, encode_prompts
from covey.rewards import RewardFunc, RewardPool, TrainerState, reward_context, score_completions
from covey.rewards.answers import completion_text, is_correct, reference_number
from covey.rollout import RolloutEngine, SamplingParams


def evaluate(engine: RolloutEngine, tokenizer, rows: list[dict], reward_funcs: Sequence[RewardFunc],
             reward_weights: Sequence[float], args: GRPOConfig, reward_pool: RewardPool | None = None,
             reward_call_context: dict | None = None, batch_size: int = 32) -> dict:
    """Greedy completions of held-out rows under the run's own settings (prompt length and
    overflow, completion length, stop strings, reasoning stripping, reward errors and timeout):
    accuracy (the tagged answer equals the `answer` column, over the rows whose answer holds a number;
    None where none does) and mean weighted reward. Rows whose prompt ``prompt_overflow: drop`` drops
    are left out of both.
    ``reward_call_context``: what reward calls get beside the batch (default: step 0, nothing logged).

        {"accuracy": 0.42, "mean_reward": 1.3, "n": 64, "checked": 60,
         "samples": [{prompt, completion, correct, reward}, ...]}

    ``checked``: the rows whose answer holds a number (those the accuracy is over).
    """
    prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in rows], args.max_prompt_length, "eval_dataset",
                                args.prompt_overflow)
    kept = [(row, ids) for row, ids in zip(rows, prompt_ids) if ids is not None]
    params = SamplingParams(max_new_tokens=args.max_completion_length, stop=tuple(args.stop_strings or ()), greedy=True)
    weights_F = torch.tensor(reward_weights, dtype=torch.float64)
    context = reward_call_context or reward_context(TrainerState(global_step=0, max_steps=args.max_steps, epoch=0.0))
    correct, rewards, samples = [], [torch.empty(0, dtype=torch.float64)], []
    for start in range(0, len(kept), batch_size):
        part = kept[start:start + batch_size]
        chunk = [row for row, _ in part]
        rollout = engine.generate([ids for _, ids in part], 1, params)
        completions, ids = decode_completions(tokenizer, rollout.completion_ids_BT, rollout.completion_mask_BT,
                                              is_conversational(chunk), args.strip_reasoning)
        per_func = score_completions(reward_funcs, [r["prompt"] for r in chunk], completions, ids, extra_columns(chunk),
                                     args.reward_errors, args.reward_timeout, pool=reward_pool, context=context)
        rewards.append(weighted_reward_sum(per_func, weights_F))
        for row, completion, reward in zip(chunk, completions, rewards[-1].tolist()):
            checkable = reference_number(row.get("answer")) is not None
            ok = checkable and is_correct(completion, row["answer"])
            if checkable:
                correct.append(ok)
            samples.append({"prompt": row["prompt"], "completion": completion_text(completion), "correct": ok,
                            "reward": reward})
    return {"accuracy": sum(correct) / len(correct) if correct else None,
            "mean_reward": float(torch.cat(rewards).nanmean()), "n": len(kept), "checked": len(correct),
            "samples": samples}


def merge_evaluations(parts: list[dict]) -> dict:
    """One evaluation from those of consecutive shares of the rows (``evaluate`` in several processes)."""
    if len(parts) == 1:
        return parts[0]
    checked = sum(part["checked"] for part in parts)
    correct = sum(round(part["accuracy"] * part["checked"]) for part in parts if part["checked"])
    samples = [sample for part in parts for sample in part["samples"]]
    rewards = torch.tensor([sample["reward"] for sample in samples], dtype=torch.float64)
    return {"accuracy": correct / checked if checked else None, "mean_reward": float(rewards.nanmean()),
            "n": sum(part["n"] for part in parts), "checked": checked, "samples": samples}
