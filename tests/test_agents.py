"""Episodes with tools and environments: the engine's turns, the tool loop, its faults and limits, TRL's
conventions (tools=, environment_factory=, rollout_func=), all on the tiny random Llama."""

import json
import time

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.agents import Agent, HermesFormat, ToolCall, as_tool, calculate, call_tool
from covey.agents.chat import template_renders_tools, tool_message_ids, with_tools
from covey.agents.tools import CallResult
from covey.errors import ConfigError, DataError
from covey.rollout import FastEngine, Rollout, SamplesWithPolicy, SamplingParams, left_pad
from covey.rollout.engine import episodes_by_turns
from covey.train.forward import SequenceBatch, completion_logprobs
from tests.conftest import SMALL_RUN, make_model, make_tokenizer, scored_batch

ROWS = [{"prompt": [{"role": "user", "content": f"what is {a} * {b}?"}], "answer": str(a * b)}
        for a, b in ((6, 7), (3, 9), (8, 4), (5, 5))]


def answer_correct(completions, answer, **kwargs):
    return [float(f"<answer>{a}</answer>" in c[-1]["content"]) for c, a in zip(completions, answer)]


class ScriptedAgent(SamplesWithPolicy):
    """Writes a tool call in its first turn (``call`` of the numbers in the prompt) and, once a tool has
    answered, the answer it was given; its episodes run turn by turn (``episodes_by_turns``)."""

    exact_logprobs = True

    def __init__(self, tokenizer, call='<tool_call>{{"name": "calculate", "arguments": {{"expression": "{a} * {b}"}}}}'
                                       '</tool_call>'):
        self.tokenizer, self.call, self.pad_token_id = tokenizer, call, tokenizer.pad_token_id
        self.turns = []  # (prompt text, what it wrote)

    def generate(self, prompt_ids, num_generations, params, seed=None) -> Rollout:
        rows, reasons = [], []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            if "<s>tool\n" in text:
                written = f"<answer>{text.rsplit('<s>tool' + chr(10), 1)[1].split('</s>')[0]}</answer>"
            else:
                a, b = text.rsplit("what is ", 1)[1].split("?")[0].split(" * ")
                written = self.call.format(a=a, b=b)
            self.turns.append((text, written))
            ids = self.tokenizer.encode(written, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            fits = len(ids) <= params.max_new_tokens
            rows += [ids[:params.max_new_tokens]] * num_generations
            reasons += ["eos" if fits else "length"] * num_generations
        T = max(map(len, rows))
        ids_BT = torch.tensor([r + [self.tokenizer.pad_token_id] * (T - len(r)) for r in rows])
        mask_BT = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
        return Rollout(ids_BT, mask_BT, torch.zeros(ids_BT.shape), reasons)


def agent_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), max_steps=1, num_generations=2, per_device_train_batch_size=4,
                  max_completion_length=200, max_prompt_length=1024, learning_rate=1e-3, eval_max_samples=0)
    values = {**SMALL_RUN, **values}  # what the run relies on beyond its sizes
    return GRPOConfig(**{**values, **overrides})


def trainer_with(tmp_path, tokenizer, engine=None, config=None, **kwargs):
    """A trainer of the tiny model on ROWS (``config``: settings; ``kwargs``: the trainer's own arguments)."""
    return GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=kwargs.pop("reward_funcs", [answer_correct]),
                       args=agent_args(tmp_path, **(config or {})), train_dataset=kwargs.pop("train_dataset", ROWS),
                       processing_class=tokenizer,
                       rollout_engine=engine if engine is not None else ScriptedAgent(tokenizer), quiet=True, **kwargs)


# ---- the engines keep an episode's tokens as sampled ------------------------------------------------------


def _chat(tokenizer, text):
    return tokenizer.encode(f"<s>user\n{text}</s>\n<s>assistant\n", add_special_tokens=False)


def test_the_fast_engine_keeps_its_cache_across_turns_as_a_recomputed_episode_would(tokenizer):
    """Turns ended by a stop string, the environment's tokens fed through the cache: the same episode,
    token for token and log-prob for log-prob, as sampling each turn anew from the whole episode; and
    the sampled tokens' log-probs are those of one forward over the episode."""
    model = make_model(len(tokenizer), seed=3)
    engine = FastEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
    appended = tokenizer.encode("\n<s>tool\n42</s>\n<s>assistant\n", add_special_tokens=False)
    prompts = [_chat(tokenizer, "hello"), _chat(tokenizer, "abc")]
    first = engine.generate(prompts, 1, SamplingParams(max_new_tokens=30, greedy=True))
    stop = tokenizer.decode(first.completion_ids_BT[0, 4:5])
    turns: dict[int, int] = {}

    def respond(row, ids, room):
        turns[row] = turns.get(row, 0) + 1
        return appended if turns[row] <= 2 else None

    params = SamplingParams(max_new_tokens=60, greedy=True, stop=(stop,))
    cached = engine.generate_episodes(prompts, 2, params, 0, respond)
    turns.clear()
    recomputed = episodes_by_turns(engine, prompts, 2, params, 0, respond, tokenizer.pad_token_id)
    assert torch.equal(cached.completion_ids_BT, recomputed.completion_ids_BT)
    assert torch.equal(cached.sampled_mask_BT, recomputed.sampled_mask_BT)
    assert torch.allclose(cached.sampling_logp_BT, recomputed.sampling_logp_BT, atol=1e-5)
    environment_BT = cached.completion_mask_BT - cached.sampled_mask_BT
    assert int(environment_BT.sum()) == 4 * 2 * len(appended)  # two answers in each of the four episodes
    for row in range(4):  # the appended ids stand where they were given, never sampled
        ids = cached.completion_ids_BT[row][environment_BT[row].bool()].tolist()
        assert ids == appended * 2
    sampled = engine.generate_episodes(prompts, 2, SamplingParams(max_new_tokens=60, stop=(stop,)), 5, respond)
    prompt_BP, prompt_mask_BP = left_pad([p for p in prompts for _ in range(2)], tokenizer.pad_token_id)
    with torch.no_grad():
        logp_BT, _ = completion_logprobs(model, SequenceBatch(prompt_BP, prompt_mask_BP, sampled.completion_ids_BT,
                                                              sampled.completion_mask_BT))
    on = sampled.sampled_mask_BT.bool()
    assert torch.allclose(logp_BT[on], sampled.sampling_logp_BT[on], atol=1e-4)


def test_an_episode_whose_next_tokens_would_not_fit_ends_at_its_budget(tokenizer):
    engine = FastEngine(make_model(len(tokenizer), seed=3), tokenizer.pad_token_id, [tokenizer.eos_token_id],
                        tokenizer)
    rooms = []

    def respond(row, ids, room):
        rooms.append(room)
        return [5] * room  # never fits: the episode is over
    rollout = engine.generate_episodes([_chat(tokenizer, "hi")], 2, SamplingParams(8, stop=("a", "e", "i", "o")), 1,
                                       respond)
    assert all(int(n) <= 8 for n in rollout.lengths_B) and torch.equal(rollout.sampled_mask_BT,
                                                                        rollout.completion_mask_BT)


# ---- the tool loop -----------------------------------------------------------------------------------------


def test_a_tool_call_is_answered_and_only_the_models_own_tokens_are_trained(tmp_path, tokenizer):
    engine = ScriptedAgent(tokenizer)
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return answer_correct(completions, **kwargs)

    trainer = trainer_with(tmp_path, tokenizer, engine, tools=[calculate], reward_funcs=[reward])
    seen.clear()  # the call on placeholder completions before the model loaded
    batch, _ = scored_batch(trainer, [0, 1])
    samples = batch.samples
    first = seen[0]
    assert [m["role"] for m in first] == ["assistant", "tool", "assistant"]
    assert first[0]["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {"expression": "6 * 7"}}
    assert first[1] == {"role": "tool", "name": "calculate", "content": "42"}
    assert first[2]["content"] == "<answer>42</answer>"
    assert samples.rewards_BF[:, 0].tolist() == [1.0] * 4
    record = samples.records[0]
    assert record["episode"] == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "malformed_calls": 0, "cut": None}
    assert "[calculate] 42" in record["completion"]
    # the trained ids: the model's two turns as written, the tool message between them as the template renders it
    call, answer = (tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
                    for _, text in engine.turns[:1] + engine.turns[2:3])
    between, _ = tool_message_ids(tokenizer, [first[1]], [tokenizer.eos_token_id])
    n = int(samples.sequences.completion_mask_BT[0].sum())
    assert samples.sequences.completion_ids_BT[0, :n].tolist() == call + between + answer
    assert samples.loss_mask_BT[0, :n].tolist() == [1] * len(call) + [0] * len(between) + [1] * len(answer)
    assert tokenizer.decode(between) == "\n<s>tool\n42</s>\n<s>assistant\n"
    trainer.train()
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["tools/call_frequency"] == 1.0 and metrics["episodes/turns"] == 2.0
    assert metrics["tools/failure_frequency"] == 0.0 and metrics["reward"] == 1.0


def test_the_default_models_template_gets_its_tools_in_the_system_prompt(tokenizer):
    assert not template_renders_tools(tokenizer)
    schema = as_tool(calculate).schema
    messages, tools = with_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                 [schema], HermesFormat(), renders_tools=False)
    assert tools is None and messages[0]["content"].startswith("Be brief.\n\nYou can call tools.")
    assert json.dumps(schema) in messages[0]["content"] and messages[1] == {"role": "user", "content": "hi"}
    rendering = make_tokenizer()
    rendering.chat_template = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }}{% endfor %}</tools>"
                               "{% endif %}{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                               "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    assert template_renders_tools(rendering)
    assert with_tools([{"role": "user", "content": "hi"}], [schema], HermesFormat(), renders_tools=True) == (
        [{"role": "user", "content": "hi"}], [schema])


def test_tool_calls_round_trip_through_the_format_and_malformed_ones_are_counted():
    fmt = HermesFormat()
    call = ToolCall("calculate", {"expression": "12 * 345"})
    assert fmt.parse(fmt.render(call)).calls == [call]
    parsed = fmt.parse('<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
                       "<tool_call>not json</tool_call><tool_call>{\"arguments\": {}}</tool_call>")
    assert parsed.calls == [ToolCall("calculate", {"expression": "1+1"})] and parsed.malformed == 2
    assert fmt.parse("no call here") == fmt.parse("")


def test_calculate_reads_arithmetic_only():
    assert calculate("47 * 382") == "17954" and calculate("(1 + 2) / 4") == "0.75" and calculate("-3 ** 2") == "-9"
    for bad in ("__import__('os')", "2 ** 1000", "x + 1", "1 +"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_a_tool_that_fails_in_any_way_gives_the_model_an_error_message():
    def raises(x: int) -> str:
        """Raise.

        Args:
            x: anything
        """
        raise RuntimeError("broken")

    def hangs(x: int) -> str:
        """Hang.

        Args:
            x: anything
        """
        time.sleep(30)

    def no_text(x: int) -> object:
        """Return an object.

        Args:
            x: anything
        """
        return object()

    start = time.monotonic()
    results = [call_tool(as_tool(f), {"x": 1}, 0.5) for f in (raises, hangs, no_text)]
    assert time.monotonic() - start < 5 and all(r.failed for r in results)
    assert "raised RuntimeError: broken" in results[0].text and "did not answer within 0.5 s" in results[1].text
    assert "returned a object, not text" in results[2].text
    assert call_tool(as_tool(raises), {"y": 1}, 1.0).failed  # arguments it does not take
    assert call_tool(as_tool(calculate), "1+1", 1.0).failed  # arguments that are no object
    ok = call_tool(as_tool(calculate), {"expression": "2 * 3"}, 1.0)
    assert ok == type(ok)("6", False)


def test_content_parts_of_text_alone_read_as_their_texts():
    def describe() -> list:
        """Describe the scene."""
        return [{"type": "text", "text": "a cat "}, {"type": "text", "text": "on a mat"}]

    assert call_tool(as_tool(describe), {}, 5.0) == CallResult("a cat on a mat", False)

    def pets() -> list:
        """List the pets."""
        return [{"type": "cat", "name": "Tom"}]  # records, not content parts: read as JSON

    assert call_tool(as_tool(pets), {}, 5.0) == CallResult('[{"type": "cat", "name": "Tom"}]', False)


def test_a_tool_without_a_readable_schema_is_refused_by_name(tmp_path, tokenizer):
    def undocumented(x):
        return x

    with pytest.raises(ConfigError, match="tool 'undocumented': its JSON schema cannot be read"):
        trainer_with(tmp_path, tokenizer, tools=[undocumented])


def test_faults_and_limits_are_counted_and_never_crash_the_run(tmp_path, tokenizer):
    """An unknown tool and a failing one get an error message; a malformed call makes no call; the turn
    limit and the length limit cut episodes, each counted."""
    def broken(expression: str) -> str:
        """Fail.

        Args:
            expression: anything
        """
        raise ValueError("no")

    cases = {  # what the scripted model writes in its first turn -> (tool errors, malformed, cut, turns)
        '<tool_call>{{"name": "nosuch", "arguments": {{}}}}</tool_call>': (1, 0, None, 2),
        '<tool_call>{{"name": "broken", "arguments": {{"expression": "{a}"}}}}</tool_call>': (1, 0, None, 2),
        "<tool_call>{{oops</tool_call>": (0, 1, None, 1),
    }
    for n, (call, (errors, malformed, cut, turns)) in enumerate(cases.items()):
        trainer = trainer_with(tmp_path / str(n), tokenizer, ScriptedAgent(tokenizer, call), tools=[calculate, broken])
        record = scored_batch(trainer, [0])[0].samples.records[0]
        assert record["episode"] == {"turns": turns, "tool_calls": 1 if errors else 0, "tool_errors": errors,
                                     "malformed_calls": malformed, "cut": cut}, call
    limited = trainer_with(tmp_path / "limit", tokenizer, tools=[calculate], config=dict(max_tool_calling_iterations=1),
                           train_dataset=[{"prompt": [{"role": "user", "content": "what is 2 * 3?"}], "answer": "6"}])
    limited.parts.sampler.engine.call = limited.parts.sampler.engine.call + " again"
    # a model that calls again after the answer: the second round of calls is over the limit
    limited.parts.sampler.engine.generate = _always_calls(limited.parts.sampler.engine)
    record = scored_batch(limited, [0])[0].samples.records[0]
    assert record["episode"]["cut"] == "turns" and record["episode"]["tool_calls"] == 1
    short = trainer_with(tmp_path / "short", tokenizer, tools=[calculate], config=dict(max_completion_length=100))
    samples = scored_batch(short, [0])[0].samples
    assert samples.records[0]["episode"]["cut"] == "length" and samples.records[0]["episode"]["tool_calls"] == 1
    assert int(samples.sequences.completion_mask_BT[0].sum()) <= 100
    assert torch.equal(samples.loss_mask_BT[0], samples.sequences.completion_mask_BT[0])  # nothing was appended


def _always_calls(engine):
    original = engine.generate

    def generate(prompt_ids, num_generations, params, seed=None):
        texts = [engine.tokenizer.decode(ids) for ids in prompt_ids]
        stripped = [engine.tokenizer.encode(t.replace("<s>tool\n", "<s>told\n"), add_special_tokens=False)
                    for t in texts]  # as if no tool had answered: it calls again
        return original(stripped, num_generations, params, seed)
    return generate


# ---- environments and rollout_func, in TRL's conventions -------------------------------------------------


class Calculator:
    """An environment in TRL's convention: made with no arguments, reset with a row's columns."""

    def reset(self, prompt, answer, **kwargs):
        self.answer, self.calls = answer, 0
        return " (use the calculator)"

    def calculate(self, expression: str) -> str:
        """Evaluate arithmetic.

        Args:
            expression: for example 2 * 3
        """
        self.calls += 1
        return calculate(expression)

    def get_reward(self) -> float:
        return float(self.calls)


def test_an_environment_written_for_trl_runs_unchanged(tmp_path, tokenizer):
    seen = {}

    def sees_environments(completions, environments, **kwargs):
        seen["environments"] = environments
        return [0.0] * len(completions)

    engine = ScriptedAgent(tokenizer)
    trainer = trainer_with(tmp_path, tokenizer, engine, environment_factory=Calculator,
                           reward_funcs=[answer_correct, sees_environments])
    samples = scored_batch(trainer, [0, 1])[0].samples
    assert trainer.parts.rewards.names == ["answer_correct", "sees_environments", "Calculator"]
    environments = seen["environments"]
    assert len(environments) == 4 and len({id(e) for e in environments}) == 4  # one instance per episode
    assert [e.answer for e in environments] == ["42", "42", "27", "27"] and all(e.calls == 1 for e in environments)
    assert samples.rewards_BF[:, 2].tolist() == [1.0] * 4  # get_reward, weight 1
    assert "what is 6 * 7? (use the calculator)</s>" in engine.turns[0][0]  # reset's text ends the prompt


def test_an_environment_whose_reset_raises_names_the_row(tmp_path, tokenizer):
    class Broken(Calculator):
        def reset(self, **row):
            if row["answer"] == "27":
                raise KeyError("difficulty")

    trainer = trainer_with(tmp_path, tokenizer, environment_factory=Broken)
    with pytest.raises(DataError, match=r"environment Broken: reset raised KeyError: 'difficulty' on row 1"):
        scored_batch(trainer, [0, 1])
    with pytest.raises(ConfigError, match="has no reset method"):
        trainer_with(tmp_path / "b", tokenizer, environment_factory=lambda: object())


def test_a_rollout_func_of_trls_shape_trains_with_its_environment_mask(tmp_path, tokenizer):
    given = []

    def rollout_func(prompts, run):  # the trainer comes by position, whatever its parameter's name (as in TRL)
        given.append(prompts)
        ids = run.processing_class.encode("<answer>42</answer>", add_special_tokens=False)
        tokenizer = run.processing_class
        prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
                                       add_special_tokens=False) for p in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": [ids + [3] for _ in prompts],
                "logprobs": [[-0.5] * (len(ids) + 1) for _ in prompts],
                "env_mask": [[1] * 3 + [0] * (len(ids) - 3) + [1] for _ in prompts], "judge": ["ok"] * len(prompts)}

    def judged(completions, judge, **kwargs):
        return [float(j == "ok") for j in judge]

    trainer = trainer_with(tmp_path, tokenizer, engine=FastEngine(make_model(len(tokenizer)), 0, [3], tokenizer),
                           rollout_func=rollout_func, reward_funcs=[answer_correct, judged])
    samples = scored_batch(trainer, [0, 1])[0].samples
    assert len(given[0]) == 4 and given[0][0] == given[0][1] == ROWS[0]["prompt"]  # each prompt once per completion
    assert samples.rewards_BF.tolist() == [[1.0, 1.0]] * 2 + [[0.0, 1.0]] * 2  # it always answers 42
    assert samples.loss_mask_BT[0].tolist() == [1, 1, 1] + [0] * 16 + [1]
    with pytest.raises(ConfigError, match="rollout_func must return a dict with prompt_ids, completion_ids, logprobs; "
                                          "it lacks logprobs"):
        bad = trainer_with(tmp_path / "bad", tokenizer, rollout_func=lambda prompts, trainer: {
            "prompt_ids": [], "completion_ids": []})
        scored_batch(bad, [0])


def test_an_agent_needs_a_chat_template_and_chat_prompts(tmp_path, tokenizer):
    plain = make_tokenizer()
    plain.chat_template = None
    with pytest.raises(ConfigError, match="need a model whose tokenizer has a chat template"):
        Agent.build(plain, [3], [as_tool(calculate)], None, HermesFormat(), None, 1.0)
    with pytest.raises(DataError, match="row 0: tools and environments need chat prompts"):
        trainer_with(tmp_path, tokenizer, tools=["calculate"], train_dataset=[{"prompt": "what is 2 * 3?", "answer": "6"}])


# ---- an ecosystem's environments: OpenEnv ------------------------------------------------------------------


def openenv_tally():
    """An OpenEnv environment class: add to a tally until it reaches the row's answer (reward 1 then)."""
    pytest.importorskip("openenv")
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.types import Observation, State

    class Tally(MCPEnvironment):
        """Add to a tally until it reaches the row's answer: reward 1 then."""

        def __init__(self):
            mcp = FastMCP("tally")

            @mcp.tool()
            def add(n: int) -> str:
                """Add n to the tally."""
                self.total += n
                return f"the tally is {self.total}"

            super().__init__(mcp)
            self._state, self.total, self.target = State(), 0, 0

        def reset(self, seed=None, episode_id=None, answer="0", **row):
            self.total, self.target = 0, int(answer)
            return Observation(done=False, reward=None, metadata={"prompt": " Use add."})

        def _step_impl(self, action, timeout_s=None, **kwargs):
            return Observation(done=False, reward=0.0)

        def step(self, action, **kwargs):
            observation = super().step(action, **kwargs)
            observation.reward = float(self.total == self.target)
            return observation

        @property
        def state(self):
            return self._state

    return Tally


def test_an_openenv_environment_in_trls_convention_keeps_its_tools_prompt_reward_and_errors():
    """from_openenv's class alone, without a run (the run's episodes: the slow test below)."""
    import inspect

    from covey.agents.openenv import from_openenv

    Environment = from_openenv(openenv_tally())
    env = Environment()
    assert env.reset(answer="6") == " Use add." and env.get_reward() == 0.0
    assert env.add(n=2) == "the tally is 2" and env.get_reward() == 0.0
    assert env.add(n=4) == "the tally is 6" and env.get_reward() == 1.0
    assert env.add(n="x").startswith("error:")  # OpenEnv's own error comes back as the tool's result
    assert inspect.signature(Environment.add).parameters["n"].annotation is int
    assert Environment.__name__ == "Tally" and "Add n to the tally." in Environment.add.__doc__


def test_an_openenv_environment_runs_its_tools_in_episodes(tmp_path, tokenizer):
    from covey.agents.openenv import from_openenv

    Tally = openenv_tally()
    Environment = from_openenv(Tally)
    engine = ScriptedAgent(tokenizer, '<tool_call>{{"name": "add", "arguments": {{"n": {a}}}}}</tool_call>')
    trainer = trainer_with(tmp_path, tokenizer, engine, environment_factory=Environment,
                           train_dataset=[{"prompt": [{"role": "user", "content": "what is 6 * 1?"}], "answer": "6"},
                                          {"prompt": [{"role": "user", "content": "what is 3 * 1?"}], "answer": "4"}])
    assert trainer.parts.sampler.agent.environment.tool_names == ["add"]
    samples = scored_batch(trainer, [0, 1])[0].samples
    assert trainer.parts.rewards.names == ["answer_correct", "Tally"]
    assert samples.rewards_BF[:, 1].tolist() == [1.0, 1.0, 0.0, 0.0]  # 6 reaches 6; 3 is not 4
    assert "[add] the tally is 6" in samples.records[0]["completion"] and "Use add." in engine.turns[0][0]
    failed = Environment()
    failed.reset(answer="1")
    assert failed.add(n="x").startswith("error:")  # OpenEnv's own error comes back as the tool's result


def test_the_multiplication_task_keeps_its_held_out_products_apart_and_shows_one_worked_exchange():
    import re

    from covey.data.tasks import multiplication

    def pair(row):
        return tuple(int(n) for n in re.findall(r"\d+", row["prompt"][-1]["content"]))

    train, test = multiplication("train"), multiplication("test")
    assert len(test) == 64 and len(train) == 90 * 900 - 64
    assert not {pair(r) for r in test} & {pair(r) for r in train}
    assert [m["role"] for m in test[0]["prompt"]] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert "Use the tool." in test[0]["prompt"][-1]["content"]
    assert all(r["answer"] == str(pair(r)[0] * pair(r)[1]) and 10 <= pair(r)[0] < 100 <= pair(r)[1] < 1000
               for r in test)


def test_tool_use_credits_a_readable_call_and_a_call_that_answered():
    from covey.rewards import BUILTIN_REWARDS

    tool_use = BUILTIN_REWARDS["tool_use"]
    call = {"role": "assistant", "content": "<tool_call>...", "tool_calls": [{"type": "function", "function": {}}]}
    assert tool_use([[call, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}],
                     [call, {"role": "tool", "content": "error: no tool named 'x'"}],
                     [{"role": "assistant", "content": "<answer>1</answer>"}], "plain text"]) == [1.0, 0.5, 0.0, 0.0]


def test_code_runs_in_the_sandbox_as_a_tool():
    from covey.agents.tools import run_python

    assert call_tool(as_tool(run_python), {"code": "print(6 * 7)"}, 20.0).text.strip() == "42"
    looping = call_tool(as_tool(run_python), {"code": "while True: pass"}, 20.0)
    assert not looping.failed and looping.text.startswith("timeout")  # the sandbox stops it; the model reads why


def test_the_report_and_completions_show_each_episode_whole(tmp_path, tokenizer):
    from covey.telemetry.report import write_report

    trainer_with(tmp_path, tokenizer, tools=[calculate]).train()
    record = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert record["episode"]["tool_calls"] == 1 and "[calculate] 42" in record["completion"]
    page = write_report(tmp_path / "run").read_text()
    assert "[calculate] 42" in page and "&lt;answer&gt;42&lt;/answer&gt;" in page


def test_a_tool_message_is_read_off_a_template_that_renders_its_last_assistant_turn_otherwise():
    """Qwen3's template writes an empty think block into the last assistant turn only: the ids after
    the turn's end token are still the tool message and the next turn's opening."""
    qwen3_like = make_tokenizer()
    qwen3_like.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
        "<think></think>{% endif %}{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    ids, end = tool_message_ids(qwen3_like, [{"role": "tool", "name": "calculate", "content": "42"}], [3])
    assert qwen3_like.decode(ids) == "\n<s>tool\n42</s>\n<s>assistant\n" and end == 3
    no_tool_role = make_tokenizer()
    no_tool_role.chat_template = "{% for m in messages %}{{ raise_exception('no ' + m['role']) if m['role'] == 'tool' }}{% endfor %}"
    with pytest.raises(ConfigError, match="cannot render a tool's result after a tool call"):
        Agent.build(no_tool_role, [3], [as_tool(calculate)], None, HermesFormat(), None, 1.0)


def test_an_engine_of_single_completions_needs_no_episodes_until_tools_come(tmp_path, tokenizer):
    class OneTurn:
        exact_logprobs, shared_by_processes, policy_stale = True, False, False

        def generate(self, prompt_ids, num_generations, params, seed=None):
            raise AssertionError("not called here")

        def policy_changed(self, model): ...
        def push_policy(self, model): ...
        def follow_pushes(self, holder): ...

    trainer_with(tmp_path / "a", tokenizer, OneTurn(), tools=[])  # no tools: fine without generate_episodes
    with pytest.raises(ConfigError, match="lacks generate_episodes"):
        trainer_with(tmp_path / "b", tokenizer, OneTurn(), tools=[calculate])


# ---- several environments, and environments that own the data (TRL 1.16's environment_factory) --------------


class Adder:
    def reset(self, **row):
        self.total = 0
        assert "environment" not in row  # the routing column is not the environment's

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: the first
            b: the second
        """
        self.total = a + b
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total > 0)


class Multiplier:
    def reset(self, **row):
        self.used = False

    def multiply(self, a: int, b: int) -> str:
        """Multiply two numbers.

        Args:
            a: the first
            b: the second
        """
        self.used = True
        return str(a * b)


def test_several_environments_are_chosen_row_by_row_each_showing_its_own_tools(tmp_path, tokenizer):
    rows = [{**ROWS[0], "environment": "adding"}, {**ROWS[1], "environment": "multiplying"}]
    engine = ScriptedAgent(tokenizer, '<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}'
                                      '</tool_call>')
    trainer = trainer_with(tmp_path, tokenizer, engine, train_dataset=rows,
                           environment_factory={"adding": Adder, "multiplying": Multiplier})
    # get_reward of the class that has one: a reward named after it, None for the other class's episodes
    assert trainer.reward_func_names == ["answer_correct", "Adder"]
    assert [tool.__name__ for tool in trainer.tools] == ["add", "multiply"]
    samples = scored_batch(trainer, [0, 1])[0].samples
    shown = [text for text, _ in engine.turns if "what is" in text]
    assert '"add"' in shown[0] and '"multiply"' not in shown[0]  # each prompt shows its environment's tools
    assert '"multiply"' in shown[1] and '"add"' not in shown[1]
    assert samples.rewards_BF[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]  # multiply is the adding row's unknown tool
    assert samples.rewards_BF[:2, 1].tolist() == [0.0, 0.0] and samples.rewards_BF[2:, 1].isnan().all()
    with pytest.raises(DataError, match=r"row 0: environment 'dividing' is not among the environments of environment_factory "
                                        r"\(adding, multiplying\)"):
        trainer_with(tmp_path / "b", tokenizer, train_dataset=[{**ROWS[0], "environment": "dividing"}],
                     environment_factory={"adding": Adder, "multiplying": Multiplier})
    with pytest.raises(DataError, match="has no 'environment' column"):
        trainer_with(tmp_path / "c", tokenizer, environment_factory={"adding": Adder})


class Quiz:
    """An environment that owns the data: reset() returns the question."""

    def reset(self, **row):
        self.count = 0
        return "what is 2 * 3?"

    def note(self, text: str) -> str:
        """Write a note.

        Args:
            text: the note
        """
        self.count += 1
        return "noted"

    def get_reward(self) -> float:
        return float(self.count)


def test_an_environment_that_owns_the_data_needs_no_dataset(tmp_path, tokenizer):
    engine = ScriptedAgent(tokenizer, '<tool_call>{{"name": "note", "arguments": {{"text": "{a}"}}}}</tool_call>')
    trainer = GRPOTrainer(model=make_model(len(tokenizer)), args=agent_args(tmp_path), environment_factory=Quiz,
                          processing_class=tokenizer, rollout_engine=engine, quiet=True)  # max_steps given: 1
    assert trainer.reward_func_names == ["Quiz"] and trainer.run.dataset_name == "the environment's reset()"
    samples = scored_batch(trainer, [0, 1])[0].samples
    assert samples.rewards_BF[:, 0].tolist() == [1.0] * 4  # each episode's note was counted
    assert all("what is 2 * 3?" in text for text, _ in engine.turns[:2])
    for unbounded in (GRPOConfig(output_dir=str(tmp_path / "b")), agent_args(tmp_path / "b", max_steps=-1)):
        with pytest.raises(ConfigError, match="set max_steps"):  # covey's default length is the demo's
            GRPOTrainer(model=make_model(len(tokenizer)), args=unbounded, environment_factory=Quiz,
                        processing_class=tokenizer)
    # a dataset of the environments' names alone: the environments write the prompts
    routed = GRPOTrainer(model=make_model(len(tokenizer)), args=agent_args(tmp_path / "d"), processing_class=tokenizer,
                         train_dataset=[{"environment": "quiz"}], environment_factory={"quiz": Quiz},
                         rollout_engine=engine, quiet=True)
    assert routed.parts.prompts.rows[0]["prompt"] == [{"role": "user", "content": ""}]
    with pytest.raises(ConfigError, match="A `dict` environment_factory .* requires a `train_dataset`"):
        GRPOTrainer(model=make_model(len(tokenizer)), args=agent_args(tmp_path / "c"),
                    environment_factory={"quiz": Quiz}, processing_class=tokenizer)
