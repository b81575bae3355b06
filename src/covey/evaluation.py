"""Held-out evaluation: greedy completions scored for accuracy and mean reward."""

from __future__ import annotations

from typing import Sequence

import torch

from covey.data import extra_columns, is_conversational
from covey.core import weighted_reward_sum
from covey.rewards import RewardFunc, completion_text, is_correct, score_completions
from covey.rollout import RolloutEngine, SamplingParams
from covey.text import decode_completions, encode_prompts


def evaluate(engine: RolloutEngine, tokenizer, rows: list[dict], reward_funcs: Sequence[RewardFunc],
             reward_weights: Sequence[float], max_new_tokens: int, max_prompt_length: int,
             batch_size: int = 32, strip_reasoning: bool = False) -> dict:
    """Accuracy (the tagged answer equals the `answer` column) and mean weighted reward, greedy.

        {"accuracy": 0.42, "mean_reward": 1.3, "n": 64, "samples": [{prompt, completion, correct}, ...]}
    """
    correct, rewards, samples = [], [], []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in chunk], max_prompt_length, "eval_dataset")
        rollout = engine.generate(prompt_ids, 1, SamplingParams(max_new_tokens=max_new_tokens, greedy=True))
        completions, ids = decode_completions(tokenizer, rollout.completion_ids_BT, rollout.completion_mask_BT,
                                              is_conversational(chunk), strip_reasoning)
        columns = extra_columns(chunk)
        per_func = score_completions(reward_funcs, [r["prompt"] for r in chunk], completions, ids, columns)
        rewards.append(weighted_reward_sum(per_func, torch.tensor(reward_weights, dtype=torch.float64)))
        for row, completion in zip(chunk, completions):
            ok = "answer" in row and is_correct(completion, row["answer"])
            correct.append(ok)
            samples.append({"prompt": row["prompt"], "completion": completion_text(completion), "correct": ok})
    return {"accuracy": sum(correct) / max(len(correct), 1), "mean_reward": float(torch.cat(rewards).nanmean()),
            "n": len(rows), "samples": samples}


def before_after_rows(before: dict | None, after: dict | None) -> list[list[str]]:
    """[label, accuracy, mean reward, n] of the held-out evaluation before and after training (those
    present), then their change when both are: the one table the terminal, model card and report show."""
    rows = [[label, f"{100 * r['accuracy']:.1f}%", f"{r['mean_reward']:.3f}", str(r["n"])]
            for label, r in (("before", before), ("after", after)) if r]
    if before and after:
        rows.append(["change", f"{100 * (after['accuracy'] - before['accuracy']):+.1f} pts",
                     f"{after['mean_reward'] - before['mean_reward']:+.3f}", ""])
    return rows
