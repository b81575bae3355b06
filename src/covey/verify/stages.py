"""The stages of covey verify up to the rewards, in the order of the loop (data, decode, episodes, rewards),
each checked against an independent computation (``covey.verify.formulas``) on the batch the step's own
functions produced. What the step computes from that batch (advantages, log-probs, loss, the engine, the
asynchronous correction) is checked in ``covey.verify.step_stages``."""

from __future__ import annotations

import math
import time

import torch

from covey import core
from covey.data import text
from covey.rewards import TRAINER_REWARD_ARGS, call_reward, required_columns, returned_values, reward_name, without_logging
from covey.agents import ToolCall
from covey.rewards.answers import reference_number
from covey.train.batch import ScoredBatch
from covey.train.parts import StepParts
from covey.verify.formulas import eos_mask, episode_layout
from covey.verify.report import Report


def check_data(report: Report, parts: StepParts) -> None:
    rows, args = parts.prompts.rows, parts.args
    chat = isinstance(rows[0]["prompt"], list)
    report.add("data", "prompt column", True, "chat messages" if chat else "plain text")
    longest = max(len(ids) for ids in parts.prompts.ids)
    report.add("data", "prompt lengths fit", longest <= args.max_prompt_length,
               f"longest {longest} <= {args.max_prompt_length} tokens", "raise max_prompt_length")
    if chat:
        _check_chat_template(report, parts.sampler.tokenizer, rows[0]["prompt"], args.chat_template_kwargs)
    columns = set(rows[0]) - {"prompt"}
    for func in parts.rewards.funcs:
        needed = required_columns(func)
        missing = needed - columns
        report.add("data", f"columns for {reward_name(func)}", not missing,
                   ", ".join(sorted(needed)) or "none needed",
                   f"reward {reward_name(func)} needs dataset column(s) {sorted(missing)}; add them to the data")


def _check_chat_template(report: Report, tokenizer, messages: list[dict], template_kwargs: dict | None) -> None:
    """The prompt the model continues ends where its answer begins: the template opens the assistant's
    turn when asked, or (a template that ignores add_generation_prompt, [INST] ... [/INST]) an
    assistant message follows the prompt directly. And it renders an assistant message it is given."""
    def render(chat, opened):
        return text.render_chat(tokenizer, chat, opened, template_kwargs=template_kwargs)

    reply = "covey verify: a reply"
    opened, closed, replied = render(messages, True), render(messages, False), render(
        messages + [{"role": "assistant", "content": reply}], False)
    if opened != closed:
        ok, value = replied.startswith(opened), "add_generation_prompt opens the turn"
    else:
        ok = replied.startswith(opened) and replied[len(opened):].lstrip().startswith(reply)
        value = "the prompt ends where the answer begins" if ok else "the prompt ends in the user's message"
    report.add("data", "chat template opens the assistant's turn", ok, value,
               "the model would continue the user's message instead of answering it: fix the tokenizer's chat "
               "template (add_generation_prompt should open the assistant's turn)")
    kept = reply in replied
    report.add("data", "chat template keeps assistant messages", kept, "kept" if kept else "dropped",
               "the chat template drops assistant messages: fix the tokenizer's chat template")


def check_rewarded_text(report: Report, parts: StepParts, batch: ScoredBatch, calls: list[dict],
                        turns: dict[int, list] | None = None) -> None:
    """What the reward functions were given is the text of each row's own sampled tokens (no prompt,
    no special tokens), decoded here independently of the trainer; for an episode, each of the model's
    turns (``turns`` as the engine handed them over, then what the budget cut) in its own message."""
    if not calls:
        return
    seq = batch.samples.sequences
    wrong = None
    for i, completion in enumerate(calls[0]["completions"]):
        ids = seq.completion_ids_BT[i, : int(seq.completion_mask_BT[i].sum())].tolist()
        if parts.sampler.agent is None:
            pieces = [ids]
        else:
            pieces = [turn for turn, _ in turns.get(i, [])]
            done = sum(len(turn) + len(appended or []) for turn, appended in turns.get(i, []))
            pieces += [ids[done:]] if len(ids) > done else []
        want = [parts.sampler.tokenizer.decode(piece, skip_special_tokens=True) for piece in pieces]
        if parts.args.strip_reasoning:
            want = [text.answer_after_reasoning(w) for w in want]
        if parts.sampler.agent is None:
            got = [completion[0]["content"] if isinstance(completion, list) else completion]
        else:
            got = [m["content"] for m in completion if m.get("role") == "assistant"]
        if got != want:
            wrong = (i, " | ".join(got), " | ".join(want))
            break
    report.add("decode", "rewards see each sampled completion's text", wrong is None,
               f"{len(calls[0]['completions'])} completions compared",
               f"completion {wrong[0]} reached the rewards as {wrong[1][:60]!r}, but its tokens read {wrong[2][:60]!r}: "
               "see covey.data.text.decode_completions" if wrong else "")


def check_decode(report: Report, parts: StepParts, eos_ids: list[int]) -> None:
    """Decode known completions (with EOS and padding) and compare with the text they came from."""
    tokenizer = parts.sampler.tokenizer
    samples = ["The sum is 12.", "<think>7 + 5 is 12</think> 12", "<think>7 + 5 is"]
    answers = {True: ["The sum is 12.", "12", ""], False: samples}
    ids = [tokenizer(s, add_special_tokens=False)["input_ids"] + [eos_ids[0]] for s in samples]
    width = max(len(i) for i in ids) + 2
    ids_BT = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    mask_BT = core.completion_mask(ids_BT, eos_ids)
    names = ("plain completion", "complete reasoning block", "unterminated reasoning block")
    for strip in sorted({parts.args.strip_reasoning, True}, reverse=True):
        texts, _ = text.decode_completions(tokenizer, ids_BT, mask_BT, conversational=False, strip_reasoning=strip)
        for name, got, want in zip(names, texts, answers[strip]):
            got_clean = got.strip()
            report.add("decode", f"{name}{' (strip_reasoning)' if strip else ''}", got_clean == want.strip(),
                       repr(got_clean[:40]), f"rewards would see {got!r}, expected {want!r}: see covey.data.text.decode_completions "
                       "and text.answer_after_reasoning")
    specials = [t for t in (tokenizer.eos_token, tokenizer.pad_token) if t]
    plain, _ = text.decode_completions(tokenizer, ids_BT, mask_BT, conversational=False)
    leaked = [s for s in specials if any(s in t for t in plain)]
    report.add("decode", "special tokens and padding removed", not leaked, "none left" if not leaked else str(leaked),
               "decode with skip_special_tokens and cut at the completion mask")


def check_columns(report: Report, parts: StepParts, indices: list[int], calls: list[dict]) -> None:
    G = parts.args.num_generations
    if not calls:
        return
    columns = {k: v for k, v in calls[0].items() if k not in TRAINER_REWARD_ARGS}
    bad = [(k, i) for k, values in columns.items() for i, v in enumerate(values)
           if v != parts.prompts.rows[indices[i // G]][k]]
    report.add("data", "columns aligned with completions", not bad, f"{len(columns)} column(s) checked",
               f"column {bad[0][0]!r} at completion {bad[0][1]} belongs to another prompt: see covey.data.rows.extra_columns"
               if bad else "")


def check_rewards(report: Report, parts: StepParts, batch: ScoredBatch, calls: list[dict]) -> None:
    rewards_BF = batch.samples.rewards_BF
    kwargs = without_logging(calls[0])  # the batch the trainer gave the reward functions
    n = len(kwargs["completions"])
    for j, func in enumerate(parts.rewards.funcs):
        column = rewards_BF[:, j]
        defined = column[~column.isnan()]
        report.add("rewards", f"{reward_name(func)} varies over the batch", defined.numel() > 1 and bool(defined.std() > 0),
                   f"{defined.numel()} values, std {float(defined.std()) if defined.numel() > 1 else 0:.3g}",
                   constant_reward_advice(parts, batch), warn_only=True)
        # the function again on the batch it was given, twice: the table must hold what it returns, row for row
        aligned = f"{reward_name(func)} values belong to their completions"
        start = time.perf_counter()
        try:
            again = [call_reward(func, kwargs, None) for _ in range(2)]
        except Exception as e:  # the trainer's call succeeded; this one is only a check
            report.add("rewards", aligned, False, f"not checked: a second call raised {type(e).__name__}", str(e)[:200], warn_only=True)
            continue
        per_call = (time.perf_counter() - start) / (2 * n)
        report.add("rewards", f"{reward_name(func)} time per completion", per_call < 1.0, f"{per_call * 1000:.1f} ms",
                   "a slow reward dominates the step: cache or batch its work", warn_only=True)
        first, second = ([math.nan if v is None else float(v) for v in returned_values(a)] for a in again)
        if not torch.allclose(*(torch.tensor(v, dtype=torch.float64).nan_to_num(1e9) for v in (first, second))):
            report.add("rewards", aligned, False, "not checked: two calls on the same batch differ",
                       "the function is random (a sampling judge?): the alignment of its values cannot be checked",
                       warn_only=True)
            continue
        want = torch.tensor(first, dtype=torch.float64)
        same = torch.allclose(column[:n].nan_to_num(1e9), want.nan_to_num(1e9), atol=1e-9)
        report.add("rewards", aligned, same,
                   "the table holds what the function returns, row for row" if same else "mismatch",
                   "the reward table is shifted or reordered against the completions: see covey.rewards.scoring.score_completions")
    weights = parts.rewards.weights
    total = core.weighted_reward_sum(rewards_BF, parts.rewards.weights_F)
    manual = [sum(w * v for w, v in zip(weights, row) if not math.isnan(v)) for row in rewards_BF.tolist()]
    report.add("rewards", "weights applied", torch.allclose(total.nan_to_num(0.0), torch.tensor(manual, dtype=torch.float64)),
               f"weights {weights}", "core.weighted_reward_sum does not equal sum(weight * reward)")


def constant_reward_advice(parts: StepParts, batch: ScoredBatch) -> str:
    """What to do about a reward that is the same for the whole batch: its likely cause first."""
    reasons = batch.samples.finish_reasons
    if (cut := reasons.count("length")) * 2 >= len(reasons) > 0:
        return (f"{cut} of the {len(reasons)} completions were cut at max_completion_length="
                f"{parts.args.max_completion_length} before they could finish: raise max_completion_length")
    return "a constant reward gives no signal: make it incremental (partial credit)"


def check_reward_probes(report: Report, parts: StepParts, calls: list[dict]) -> None:
    """Each reward that reads a reference column, on three completions of the batch's first row: its
    reference written as the prompt asks for an answer, an empty completion, and the prompt echoed back.
    A reward that scores them alike cannot tell right from wrong (its column is usually not in the form
    it parses); one that puts the reference below another is inverted or reads the wrong column."""
    if not calls:
        return
    kwargs = without_logging(calls[0])
    n, row = len(kwargs["completions"]), parts.prompts.rows[0]
    prompt = kwargs["prompts"][0]
    prompt_text = whole_prompt_text(prompt)
    for func in parts.rewards.funcs:
        column = next((c for c in sorted(required_columns(func)) if isinstance(row.get(c), (str, int, float))), None)
        if column is None:
            continue
        answer = written_answer(row[column], prompt_text, parts.args.strip_reasoning)
        user_text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
        texts = [answer, "", user_text]
        probes = {key: [value[0]] * 3 if isinstance(value, list) and len(value) == n else value
                  for key, value in kwargs.items()}
        conversational = not isinstance(kwargs["completions"][0], str)
        probes["completions"] = [[{"role": "assistant", "content": t}] if conversational else t for t in texts]
        probes["completion_ids"] = [parts.sampler.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        name = reward_name(func)
        try:
            scores = [math.nan if v is None else float(v) for v in returned_values(call_reward(func, probes, None))]
        except Exception as e:  # a check of its own: the trainer's call succeeded
            report.add("rewards", f"{name} tells a right answer from wrong ones", False,
                       f"not checked: it raised {type(e).__name__} on the probes", str(e)[:200], warn_only=True)
            continue
        right, empty, echoed = scores
        value = f"{column} as an answer {right:g}, empty {empty:g}, prompt echoed {echoed:g}"
        alike = all(v == right or (math.isnan(v) and math.isnan(right)) for v in scores)
        hint = (f"{name} scores the row's {column} written as an answer ({answer!r}), an empty completion and the "
                f"prompt echoed back alike: it cannot tell right from wrong; is the {column} column in the form it "
                "parses (a number, '#### N', a LaTeX expression)?" if alike else
                f"{name} scores an empty completion or the echoed prompt above the row's {column} written as an "
                "answer: is it inverted, or reading another column?")
        report.add("rewards", f"{name} tells a right answer from wrong ones",
                   not alike and not right < max(empty, echoed), value, hint, warn_only=True)


def whole_prompt_text(prompt: object) -> str:
    """A prompt's text, every message of a conversation joined (the system prompt says how to answer)."""
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return str(prompt or "")


def written_answer(reference: object, prompt_text: str, strip_reasoning: bool) -> str:
    """``reference`` written as the prompt asks the model to answer: in <answer> tags, \\boxed{} or after
    '####' where the prompt says so, after a reasoning block where it asks for one."""
    value = reference_number(reference)
    answer = str(reference).strip() if value is None else str(int(value)) if value.is_integer() else str(value)
    if "<answer>" in prompt_text:
        answer = f"<answer>{answer}</answer>"
    elif "boxed" in prompt_text:
        answer = f"The answer is \\boxed{{{answer}}}."
    elif "####" in prompt_text:
        answer = f"#### {answer}"
    if "<think>" in prompt_text and not strip_reasoning:
        answer = f"<think>Working it out.</think>\n{answer}"
    return answer



def check_episodes(report: Report, parts: StepParts, batch: ScoredBatch, eos_ids: list[int],
                   turns: dict[int, list]) -> None:
    """Token-in, token-out: the ids trained are the ids the model sampled, turn after turn; what a tool or
    the environment wrote between turns is attended to but never trained; tool calls round-trip through
    their format. ``turns``: each episode's turns as the engine handed them to the environment."""
    samples, args = batch.samples, parts.args
    if parts.sampler.agent is None:  # one turn each: all of it the model's, and all of it trained
        want = eos_mask(samples.sequences.completion_ids_BT, eos_ids, parts.sampler.tokenizer.pad_token_id,
                        samples.finish_reasons, args.max_completion_length)
        if args.mask_truncated_completions:
            want[torch.tensor([reason == "length" for reason in samples.finish_reasons])] = 0
        report.add("episodes", "the loss trains every completion token (one turn each, the model's own)",
                   torch.equal(samples.loss_mask_BT, want), f"{int(want.sum())} tokens",
                   "tokens the model did not sample are trained, or sampled ones are left out: see "
                   "covey.train.rounds.loss_mask")
        return
    tool_format, schemas = parts.sampler.agent.tool_format, parts.sampler.agent.schemas()
    calls = [ToolCall(s["function"]["name"], _example_arguments(s["function"].get("parameters", {}))) for s in schemas]
    lost = next((c for c in calls if tool_format.parse(tool_format.render(c)).calls != [c]), None)
    report.add("episodes", "tool calls round-trip through their format", lost is None, f"{len(calls)} tool(s)",
               f"{lost.name}'s call, written and read back, is not itself: see covey.agents.formats" if lost else "")
    drifted = untrained = trained_env = 0
    environment_tokens = 0
    for row in range(samples.size):
        ids, sampled, _ = episode_layout(turns.get(row, []), args.max_completion_length)
        n = len(ids)
        got = samples.sequences.completion_ids_BT[row, :n].tolist()
        drifted += got != ids
        mask = samples.loss_mask_BT[row, :n].tolist()
        attended = samples.sequences.completion_mask_BT[row, :n].tolist()
        cut = args.mask_truncated_completions and samples.finish_reasons[row] == "length"
        untrained += any(s and not m for s, m in zip(sampled, mask)) and not cut
        trained_env += any(m or not a for s, m, a in zip(sampled, mask, attended) if not s)
        environment_tokens += sampled.count(0)
    report.add("episodes", "the trained ids are the ids the model sampled, turn after turn", not drifted,
               f"{samples.size} episodes, {sum(len(t) for t in turns.values())} turns",
               f"{drifted} episode(s) train other ids than the model sampled (a turn re-encoded from its text?): "
               "the ids must travel as sampled, see covey.train.generation")
    report.add("episodes", "tokens a tool or the environment wrote are attended to, never trained", not trained_env,
               f"{environment_tokens} such tokens", f"{trained_env} episode(s) train (or drop) tokens the model did "
               "not write: see covey.train.rounds.loss_mask")
    report.add("episodes", "every token the model sampled is trained", not untrained, "checked",
               f"{untrained} episode(s) leave tokens the model sampled out of the loss: see covey.train.rounds.loss_mask")
    if not environment_tokens:
        report.add("episodes", "an episode called a tool", False, "none in this batch",
                   "no episode of the batch called a tool, so nothing between turns was checked: sample more "
                   "prompts (--num-prompts)", warn_only=True)


def _example_arguments(parameters: dict) -> dict:
    """Arguments of each type a schema names, for a round trip through a tool-call format."""
    examples = {"string": "2 + 3", "integer": 7, "number": 1.5, "boolean": True, "array": [1, 2], "object": {"k": 1}}
    return {name: examples.get(spec.get("type"), "x") for name, spec in parameters.get("properties", {}).items()}
