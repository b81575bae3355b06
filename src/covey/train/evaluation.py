"""Held-out evaluation: greedy completions scored for accuracy and mean reward."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from covey.config import GRPOConfig
from covey.core import weighted_reward_sum
from covey.agents import Agent
from covey.data import extra_columns
from covey.data.text import encode_prompts
from covey.rewards import RewardFunc, RewardPool, TrainerState, reward_context, score_completions
from covey.rewards.answers import is_correct, reference_number
from covey.rollout import RolloutEngine, SamplingParams
from covey.train.generation import generate
from covey.train.setup import sampling_params


def evaluate(engine: RolloutEngine, tokenizer, rows: list[dict], reward_funcs: Sequence[RewardFunc],
             reward_weights: Sequence[float], args: GRPOConfig, reward_pool: RewardPool | None = None,
             reward_call_context: dict | None = None, agent: Agent | None = None,
             rollout_func=None, eos_ids: list[int] | None = None, processor=None) -> dict:
    """Greedy completions of held-out rows under the run's own settings (prompt length and
    overflow, completion length, stop strings, reasoning stripping, reward errors and timeout):
    accuracy (the tagged answer equals the `answer` column, over the rows whose answer holds a number;
    None where none does) and mean weighted reward. Rows whose prompt ``prompt_overflow: drop`` drops
    are left out of both. With ``args.num_generations_eval`` = k: k completions per row sampled as in
    training, each scored (the accuracy is then the mean over them), instead of one greedy completion.
    ``args.per_device_eval_batch_size`` completions are generated at a time.
    ``reward_call_context``: what reward calls get beside the batch (default: step 0, nothing logged).
    ``agent``: tools (and an environment) available, in episodes as in training; ``rollout_func``: the
    user's own generation, as in training (TRL calls it for evaluation too; greedy is its own to choose).
    ``processor``: a vision-language model's, which writes the prompts that show pictures.

        {"accuracy": 0.42, "mean_reward": 1.3, "n": 64, "checked": 60,
         "samples": [{prompt, completion, correct, reward}, ...]}

    ``checked``: the rows whose answer holds a number (those the accuracy is over).
    """
    prompts, tools = [r["prompt"] for r in rows], None
    if agent is not None:
        shown = [agent.prompt(p, row) for p, row in zip(prompts, rows)]
        prompts, tools = [messages for messages, _ in shown], [tools for _, tools in shown]
    prompt_ids = encode_prompts(tokenizer, prompts, args.max_prompt_length, "eval_dataset", args.prompt_overflow,
                                tools=tools, template_kwargs=args.chat_template_kwargs, processor=processor)
    kept = [(i, row, ids) for i, (row, ids) in enumerate(zip(rows, prompt_ids)) if ids is not None]
    k = args.num_generations_eval or 1
    params = (dataclasses.replace(sampling_params(args), extra=()) if args.num_generations_eval else
              SamplingParams(max_new_tokens=args.max_completion_length, stop=tuple(args.stop_strings or ()), greedy=True))
    batch_size = max(1, args.per_device_eval_batch_size // k)  # prompts per generation
    weights_F = torch.tensor(reward_weights, dtype=torch.float64)
    context = reward_call_context or reward_context(TrainerState(global_step=0, max_steps=args.max_steps, epoch=0.0))
    correct, rewards, samples = [], [torch.empty(0, dtype=torch.float64)], []
    for start in range(0, len(kept), batch_size):
        part = kept[start:start + batch_size]
        chunk = [row for _, row, _ in part]
        chunk = [row for row in chunk for _ in range(k)]  # each row's completions follow it
        made = generate(engine, tokenizer, chunk, [ids for _, _, ids in part], k, params, None, args.strip_reasoning,
                        agent, [i for i, _, _ in part for _ in range(k)], rollout_func, args.max_prompt_length, args.prompt_overflow,
                        eos_ids)
        completions = made.completions
        per_func = score_completions(reward_funcs, [r["prompt"] for r in chunk], completions, made.completion_ids,
                                     {**extra_columns(chunk), **made.columns}, args.reward_errors, args.reward_timeout,
                                     pool=reward_pool, context=context)
        rewards.append(weighted_reward_sum(per_func, weights_F))
        for row, completion, text, reward in zip(chunk, completions, made.texts, rewards[-1].tolist()):
            checkable = reference_number(row.get("answer")) is not None
            ok = checkable and is_correct(completion, row["answer"])
            if checkable:
                correct.append(ok)
            samples.append({"prompt": row["prompt"], "completion": text, "correct": ok, "reward": reward})
    return {"accuracy": sum(correct) / len(correct) if correct else None,
            "mean_reward": float(torch.cat(rewards).nanmean()), "n": len(kept), "checked": len(correct) // k,
            "samples": samples}


def merge_evaluations(parts: list[dict]) -> dict:
    """One evaluation from those of consecutive shares of the rows (``evaluate`` in several processes)."""
    if len(parts) == 1:
        return parts[0]
    checked = sum(part["checked"] for part in parts)  # problems (each of the same k completions in every part)
    correct = sum(part["accuracy"] * part["checked"] for part in parts if part["checked"])
    samples = [sample for part in parts for sample in part["samples"]]
    rewards = torch.tensor([sample["reward"] for sample in samples], dtype=torch.float64)
    return {"accuracy": correct / checked if checked else None, "mean_reward": float(rewards.nanmean()),
            "n": sum(part["n"] for part in parts), "checked": checked, "samples": samples}
