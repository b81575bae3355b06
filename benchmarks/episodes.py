"""Episodes of several turns: covey's fast engine, which keeps an episode's KV cache across turns,
against the same engine and transformers ``generate`` sampling each turn anew from the whole episode.

The default model on prompts of the built-in ``multiplication`` task with the ``calculate`` tool,
greedy (so every engine writes the same episodes, each a tool call, its result, and an answer), up
to 96 tokens per episode. Three ways alternate ``--repeats`` times on the same prompts:

- ``fast, cache kept``: ``FastEngine.generate_episodes``: a row whose turn ends stays in the batch and
  the tokens the tool's message adds are fed through its cache;
- ``fast, turn by turn``: each later turn sampled by ``FastEngine.generate`` from the whole episode so
  far (a prefill of the episode per turn);
- ``hf, turn by turn``: the same with transformers ``generate``.

Reported: episode tokens per second (every token after the prompt: the model's and the tool's),
medians; the ratios within the run; and what the later turns cost the batch: its time beyond what the
first turns alone take.

    python -m benchmarks.episodes --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import load_default, machine
from covey.agents import Agent, HermesFormat, as_tool, calculate
from covey.data.tasks import multiplication
from covey.data.text import encode_prompts
from covey.rollout import FastEngine, HFEngine, SamplingParams
from covey.rollout.engine import episodes_by_turns


def time_episodes(way: str, engines: dict, agent: Agent, rows: list[dict], prompt_ids: list[list[int]],
                  params: SamplingParams) -> tuple[float, int, int, float]:
    """(seconds, episode tokens, later turns, seconds of the first turns alone) of one batch of episodes."""
    episodes = agent.start(rows, list(range(len(rows))))
    engine = engines[way.split(",")[0]]
    start = time.perf_counter()
    if way.endswith("cache kept"):
        rollout = engine.generate_episodes(prompt_ids, 1, params, None, episodes.respond)
    else:
        rollout = episodes_by_turns(engine, prompt_ids, 1, params, None, episodes.respond, engine.pad_token_id)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(prompt_ids, 1, params)  # the first turns alone, as the episodes began
    first = time.perf_counter() - start
    later = sum(record.turns - 1 for record in episodes.records)
    return seconds, int(rollout.lengths_B.sum()), later, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, nargs="+", default=[4, 8])
    options = parser.parse_args()
    model, tokenizer, eos = load_default()
    engines = {"fast": FastEngine(model, tokenizer.pad_token_id, eos, tokenizer),
               "hf": HFEngine(model, tokenizer.pad_token_id, eos)}
    agent = Agent.build(tokenizer, eos, [as_tool(calculate)], None, HermesFormat(), 1, 10.0)
    params = SamplingParams(max_new_tokens=96, greedy=True)
    ways = ("fast, cache kept", "fast, turn by turn", "hf, turn by turn")
    print(f"machine: {machine()}")
    print("| prompts | " + " | ".join(f"{w} tok/s" for w in ways) + " | cache kept / fast turn by turn | "
          "cache kept / hf | later turns, s: " + " / ".join(ways) + " | episode tokens | same episodes |")
    print("|---" * (len(ways) * 2 + 4) + "|")
    for n in options.prompts:
        rows = multiplication("test")[:n]
        shown = [agent.prompt(r["prompt"]) for r in rows]
        prompt_ids = encode_prompts(tokenizer, [m for m, _ in shown], 1024, tools=[t for _, t in shown])
        results: dict[str, list] = {w: [] for w in ways}
        for _ in range(options.repeats):
            for way in ways:
                results[way].append(time_episodes(way, engines, agent, rows, prompt_ids, params))
        same = len({r[1] for w in ways for r in results[w]}) == 1  # as many episode tokens every time
        speed = {w: statistics.median(r[1] / r[0] for r in results[w]) for w in ways}
        later = {w: statistics.median(r[0] - r[3] for r in results[w]) for w in ways}
        print(f"| {n} | " + " | ".join(f"{speed[w]:.0f}" for w in ways)
              + f" | {speed[ways[0]] / speed[ways[1]]:.2f}x | {speed[ways[0]] / speed[ways[2]]:.2f}x | "
              + " / ".join(f"{later[w]:.2f}" for w in ways) + f" | {results[ways[0]][0][1]} | {same} |")


if __name__ == "__main__":
    main()
