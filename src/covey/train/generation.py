"""Step 1, generation, in its three forms: one completion per row (the engine's ``generate``), an
episode of several turns in which the model calls tools (``generate_episodes``, with covey.agents
answering each turn), or a user's own ``rollout_func`` in TRL's convention. Each gives the same
``Generation``: token ids with which of them the model sampled, and what the rewards receive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from covey.agents import Agent, Episodes
from covey.data import is_conversational
from covey.data.rows import TRAINER_REWARD_ARGS
from covey.data.text import answer_after_reasoning, decode_completions, encode_prompts
from covey.errors import ConfigError, DataError
from covey.rewards.answers import completion_text
from covey.rollout import Rollout, RolloutEngine, SamplingParams
from covey.rollout.engine import padded_rollout

# the keys of a rollout_func's output that covey reads itself (TRL's); any other is a reward column
ROLLOUT_FUNC_KEYS = ("prompt_ids", "completion_ids", "logprobs")


@dataclass(frozen=True)
class Generation:
    """A round's completions, row by row (the G of a prompt in a row)."""

    rollout: Rollout
    prompt_ids: list[list[int]]  # each row's prompt
    completions: list  # what reward functions receive: text, or chat messages (an episode's, in turn)
    completion_ids: list[list[int]]  # each row's ids after its prompt
    texts: list[str]  # what completions.jsonl and the console show of each
    columns: dict[str, list]  # given to reward functions beside the dataset's: environments=, a rollout_func's own
    episodes: list[dict] | None = None  # each episode's turns, tool calls, errors (None: not episodes)


def generate(engine: RolloutEngine, tokenizer: Any, rows: list[dict], prompt_ids: list[list[int]],
             num_generations: int, params: SamplingParams, seed: int | None, strip_reasoning: bool = False,
             agent: Agent | None = None, indices: list[int] | None = None,
             rollout_func: Callable[[list], dict] | None = None, max_prompt_length: int = 10**9,
             prompt_overflow: str = "error", eos_ids: list[int] | None = None) -> Generation:
    """The completions of ``rows`` (each row once per completion; ``prompt_ids``: each distinct prompt's
    ids, G rows each; ``indices``: the rows' places in their dataset, for errors; ``eos_ids``: the
    model's end tokens, which tell a rollout_func's finished completions)."""
    G = num_generations
    if rollout_func is not None:
        return _from_rollout_func(rollout_func, tokenizer, rows, strip_reasoning, eos_ids)
    if agent is not None:
        return _episodes(engine, agent, rows, indices or list(range(len(rows))), prompt_ids, G, params, seed,
                         strip_reasoning, max_prompt_length, prompt_overflow)
    rollout = engine.generate(prompt_ids, G, params, seed=seed)
    completions, ids = decode_completions(tokenizer, rollout.completion_ids_BT, rollout.completion_mask_BT,
                                          is_conversational(rows), strip_reasoning)
    return Generation(rollout, [p for p in prompt_ids for _ in range(G)], completions, ids,
                      [completion_text(c) for c in completions], {})


def _episodes(engine: RolloutEngine, agent: Agent, rows: list[dict], indices: list[int], prompt_ids: list[list[int]],
              G: int, params: SamplingParams, seed: int | None, strip_reasoning: bool, max_prompt_length: int,
              prompt_overflow: str) -> Generation:
    episodes = agent.start(rows, indices)
    if agent.environment is None:  # the prompts are the dataset's, encoded with the tools when the run began
        row_ids = [p for p in prompt_ids for _ in range(G)]
    else:  # each episode's prompt holds what its environment's reset returned
        row_ids = _episode_prompt_ids(agent, episodes, rows, indices, max_prompt_length, prompt_overflow)
    groups = [row_ids[g:g + G] for g in range(0, len(row_ids), G)]
    episodes.begin(row_ids)
    if all(ids == group[0] for group in groups for ids in group):  # a group's prompt prefilled once
        rollout = engine.generate_episodes([group[0] for group in groups], G, params, seed, episodes.respond)
    else:
        rollout = engine.generate_episodes(row_ids, 1, params, seed, episodes.respond)
    completion_ids = [rollout.completion_ids_BT[b, :n].tolist() for b, n in enumerate(rollout.lengths_B.tolist())]
    episodes.finish(completion_ids)
    completions = [[{**m, "content": answer_after_reasoning(m["content"])} if strip_reasoning and
                     m["role"] == "assistant" else dict(m) for m in record.messages] for record in episodes.records]
    columns = {"environments": list(episodes.environments)} if agent.environment is not None else {}
    # each row's prompt ids, carrying its episode's pictures (its prompt's and its tools')
    return Generation(rollout, episodes.prompt_ids, completions, completion_ids,
                      [episodes.transcript(b) for b in range(len(rows))], columns,
                      [record.stats() for record in episodes.records])


def _episode_prompt_ids(agent: Agent, episodes: Episodes, rows: list[dict], indices: list[int],
                        max_prompt_length: int, prompt_overflow: str) -> list[list[int]]:
    shown = [agent.prompt(messages, row) for messages, row in zip(episodes.prompts, rows)]
    ids = encode_prompts(agent.tokenizer, [messages for messages, _ in shown], max_prompt_length, "episodes",
                         "truncate_left" if prompt_overflow == "truncate_left" else "drop",
                         tools=[tools for _, tools in shown], template_kwargs=agent.chat_template_kwargs,
                         processor=agent.processor)
    if (over := next((b for b, row_ids in enumerate(ids) if row_ids is None), None)) is not None:
        raise DataError(f"row {indices[over]}: its prompt, with what the environment's reset added, is over "
                        f"max_prompt_length={max_prompt_length} tokens; raise max_prompt_length, shorten what reset "
                        "returns, or set prompt_overflow: truncate_left (rows are dropped only before a run starts, "
                        "where reset has not run yet)")
    return ids


def _from_rollout_func(rollout_func: Callable[[list], dict], tokenizer: Any, rows: list[dict],
                       strip_reasoning: bool, eos_ids: list[int] | None) -> Generation:
    """TRL's ``rollout_func(prompts, trainer)``: the prompts of the round (each once per completion) in;
    ``prompt_ids``, ``completion_ids`` and ``logprobs`` (per completion token) out, optionally
    ``env_mask`` (1 on the tokens the model sampled, 0 on those its environment wrote); any other key is
    a list, one value per completion, passed to the reward functions."""
    output = rollout_func([row["prompt"] for row in rows])
    if not isinstance(output, dict) or (missing := [k for k in ROLLOUT_FUNC_KEYS if k not in output]):
        raise ConfigError(f"rollout_func must return a dict with {', '.join(ROLLOUT_FUNC_KEYS)}"
                          + (f"; it lacks {', '.join(missing)}" if isinstance(output, dict) else
                             f"; it returned a {type(output).__name__}"))
    B = len(rows)
    for key, values in output.items():
        if not isinstance(values, (list, tuple)) or len(values) != B:
            raise ConfigError(f"rollout_func's {key!r} must be a list of one entry per completion ({B} here: each "
                              "prompt it was given, in order)")
    completion_ids = [list(map(int, ids)) for ids in output["completion_ids"]]
    sampled = [list(map(int, m)) for m in output.get("env_mask") or [[1] * len(ids) for ids in completion_ids]]
    logprobs = [list(map(float, lp)) for lp in output["logprobs"]]
    for b, (ids, mask, lp) in enumerate(zip(completion_ids, sampled, logprobs)):
        if not ids or len(mask) != len(ids) or len(lp) != len(ids):
            raise ConfigError(f"rollout_func's completion {b} has {len(ids)} ids, {len(lp)} log-probs and an env_mask "
                              f"of {len(mask)}: give at least one id, and as many of each")
    eos = set(eos_ids or [tokenizer.eos_token_id])
    reasons = ["eos" if ids[-1] in eos else "length" for ids in completion_ids]
    rollout = padded_rollout(completion_ids, sampled, logprobs, reasons, tokenizer.pad_token_id)
    completions, ids = decode_completions(tokenizer, rollout.completion_ids_BT, rollout.completion_mask_BT,
                                          is_conversational(rows), strip_reasoning)
    columns = {k: list(v) for k, v in output.items() if k not in (*ROLLOUT_FUNC_KEYS, "env_mask")}
    if clash := sorted(set(columns) & (TRAINER_REWARD_ARGS | set(rows[0]))):
        raise ConfigError(f"rollout_func returned {clash[0]!r}, which is a dataset column or an argument every reward "
                          "call gets already; give it another name")
    return Generation(rollout, [list(map(int, p)) for p in output["prompt_ids"]], completions, ids,
                      [completion_text(c) for c in completions], columns)
