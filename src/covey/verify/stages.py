"""The stages of covey verify, in the order of the loop, each checked against an independent
computation (``covey.verify.formulas``) on the batch the step's own functions produced."""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Callable

import torch

from covey import core
from covey.data import text
from covey.rewards import TRAINER_REWARD_ARGS, call_reward, required_columns, returned_values, reward_name, without_logging
from covey.agents import ToolCall
from covey.rewards.answers import reference_number
from covey.rollout import OwnWeights, Rollout
from covey.train import step
from covey.train.batch import FixedLogprobs, Progress, Samples, ScoredBatch
from covey.train.step import StepParts
from covey.verify.formulas import (advantages_written_out, eos_mask, episode_layout, formula_correction,
                                   formula_loss, formula_ratio)
from covey.verify.images import plain_inputs
from covey.verify.report import Report


def check_data(report: Report, parts: StepParts) -> None:
    rows, args = parts.prompts.rows, parts.args
    chat = isinstance(rows[0]["prompt"], list)
    report.add("data", "prompt column", True, "chat messages" if chat else "plain text")
    longest = max(len(ids) for ids in parts.prompts.ids)
    report.add("data", "prompt lengths fit", longest <= args.max_prompt_length,
               f"longest {longest} <= {args.max_prompt_length} tokens", "raise max_prompt_length")
    if chat:
        _check_chat_template(report, parts.tokenizer, rows[0]["prompt"])
    columns = set(rows[0]) - {"prompt"}
    for func in parts.rewards.funcs:
        needed = required_columns(func)
        missing = needed - columns
        report.add("data", f"columns for {reward_name(func)}", not missing,
                   ", ".join(sorted(needed)) or "none needed",
                   f"reward {reward_name(func)} needs dataset column(s) {sorted(missing)}; add them to the data")


def _check_chat_template(report: Report, tokenizer, messages: list[dict]) -> None:
    """The prompt the model continues ends where its answer begins: the template opens the assistant's
    turn when asked, or (a template that ignores add_generation_prompt, [INST] ... [/INST]) an
    assistant message follows the prompt directly. And it renders an assistant message it is given."""
    def render(chat, opened):
        return text.render_chat(tokenizer, chat, opened)

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
        if parts.agent is None:
            pieces = [ids]
        else:
            pieces = [turn for turn, _ in turns.get(i, [])]
            done = sum(len(turn) + len(appended or []) for turn, appended in turns.get(i, []))
            pieces += [ids[done:]] if len(ids) > done else []
        want = [parts.tokenizer.decode(piece, skip_special_tokens=True) for piece in pieces]
        if parts.args.strip_reasoning:
            want = [text.answer_after_reasoning(w) for w in want]
        if parts.agent is None:
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
    tokenizer = parts.tokenizer
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
        probes["completion_ids"] = [parts.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
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


def check_advantages(report: Report, parts: StepParts, batch: ScoredBatch) -> None:
    args, G = parts.args, parts.args.num_generations
    weights = parts.rewards.weights_F
    probe = torch.tensor([[0.0], [1.0], [3.0], [3.0]], dtype=torch.float64)
    # one reward function: both aggregations are the per-group formula, which the probe checks
    adv, zero_std = core.advantages_from_rewards(probe, torch.ones(1, dtype=torch.float64), 2, args.scale_rewards,
                                                 "sum_then_normalize")
    report.add("advantages", "higher reward, higher advantage", bool(adv[1] > adv[0]),
               f"A(r=1) - A(r=0) = {float(adv[1] - adv[0]):.3g}", "the advantage sign is flipped: see core.group_advantages")
    want = {"group": 1 / math.sqrt(2), "batch": 0.5 / float(probe.std()), "none": 0.5}[args.scale_rewards]
    report.add("advantages", "eps small next to the reward spread", abs(float(adv[1]) - want) < 0.01 * want,
               f"A(r=1) = {float(adv[1]):.4f}, formula {want:.4f}",
               "eps in (r - mean) / (std + eps) is too large and flattens the signal: see core.ADVANTAGE_EPS",)
    report.add("advantages", "constant group gives zeros and is counted",
               bool((adv[2:] == 0).all() and zero_std.tolist() == [False, True]), f"{adv[2:].tolist()}",
               "a group with equal rewards must have zero advantage")
    sums = batch.advantages_B.view(-1, G).sum(1).abs()
    report.add("advantages", "group sums near 0", bool((sums < 1e-3 * G).all()), f"max |sum| {float(sums.max()):.2g}",
               "advantages are not centred within each group")
    if args.multi_objective_aggregation == "sum_then_normalize":
        rewards = core.weighted_reward_sum(batch.samples.rewards_BF, weights).view(-1, G)
        adv_NG = batch.advantages_B.view(-1, G).double()
        inverted = ((rewards[:, :, None] > rewards[:, None, :]) & (adv_NG[:, :, None] < adv_NG[:, None, :])).any()
        report.add("advantages", "order follows reward in the sampled batch", not bool(inverted), "checked",
                   "a better completion got a lower advantage")
        if not bool(batch.samples.rewards_BF.isnan().any()):  # the sampled batch's own advantages, written out
            want = advantages_written_out(rewards, args.scale_rewards).flatten()
            off = float((batch.advantages_B.double() - want).abs().max())
            report.add("advantages", "the batch's advantages equal (r - mean) / (std + eps)", off < 1e-4,
                       f"max diff {off:.2g}", "the trainer's advantages are not the formula's: see core.group_advantages")


def check_logprobs(report: Report, parts: StepParts, batch: ScoredBatch, eos_ids: list[int],
                   turns: dict[int, list] | None = None) -> torch.Tensor:
    """Compare the trainer's log-probs with a plain full forward and a log_softmax gather (over a whole
    episode, for episodes: ``turns`` as the engine handed them over)."""
    args, model, seq = parts.args, parts.model, batch.samples.sequences
    with torch.no_grad():
        got, _ = step.logprob_pass(parts, model)(seq, parts.sampling.distribution, False)  # the step's own pass
        logits = model(**plain_inputs(model, seq)).logits.float().cpu()  # with the rows' pictures, if any
        P = seq.prompt_ids_BP.shape[1]
        # the distribution sampled from: logits / temperature over the tokens top_k/top_p/min_p keep
        reference = parts.sampling.distribution.logits(logits[:, P - 1:-1], seq.completion_ids_BT).log_softmax(-1)
        want = reference.gather(-1, seq.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
    if parts.agent is None:
        expected_mask = eos_mask(seq.completion_ids_BT, eos_ids, parts.tokenizer.pad_token_id,
                                 batch.samples.finish_reasons, args.max_completion_length)
    else:  # an episode holds the EOS of each turn: it is as long as its turns and what was appended
        lengths = [episode_layout(turns.get(row, []), args.max_completion_length)[2]
                   for row in range(batch.samples.size)]
        expected_mask = core.length_mask(torch.tensor(lengths), seq.completion_ids_BT.shape[1])
    on = expected_mask == 1
    got = got.float().cpu()
    report.add("logprobs", "all <= 0", bool((got[on] <= 1e-6).all()), f"max {float(got[on].max()):.3g}",
               "log-probs must be <= 0: the log-softmax operands are reversed (see core.token_logprobs)")
    diff = float((got[on] - want[on]).abs().max())
    report.add("logprobs", "equal to log_softmax gathered at the token", diff < 1e-3, f"max diff {diff:.2g}",
               "the trainer's log-probs differ from a plain forward: see covey.train.forward.completion_logprobs")
    eos_kept = all(seq.completion_ids_BT[row, int(seq.completion_mask_BT[row].sum()) - 1].item() in eos_ids
                   for row, reason in enumerate(batch.samples.finish_reasons) if reason == "eos")
    report.add("logprobs", "padding and prompt excluded, EOS included",
               torch.equal(seq.completion_mask_BT, expected_mask) and eos_kept,
               f"{int(expected_mask.sum())} completion tokens",
               "the completion mask must be 1 up to and including the first EOS and 0 after (an episode's: over all "
               "its turns and what was appended between them): see core.completion_mask")
    return want


def check_loss(report: Report, parts: StepParts, batch: ScoredBatch, fixed: FixedLogprobs,
               logp_BT: torch.Tensor) -> None:
    args, s, samples = parts.args, parts.loss_settings, batch.samples
    logp = -torch.rand(3, 4, dtype=torch.float64)
    estimator = core.KL_ESTIMATORS[s.kl_estimator]
    report.add("loss", "KL is 0 when policy = reference", bool((estimator(logp, logp) == 0).all()), s.kl_estimator,
               "see core.KL_ESTIMATORS")
    k3 = core.KL_ESTIMATORS["k3"](logp, logp - torch.rand(3, 4, dtype=torch.float64))
    report.add("loss", "k3 KL >= 0", bool((k3 >= 0).all()), f"min {float(k3.min()):.3g}", "the KL sign is flipped")

    expected = formula_loss(batch, fixed.ref_BT, logp_BT, logp_BT, s, args.max_completion_length)  # ratio exactly 1
    checkable = s.top_entropy_quantile == 1.0 and fixed.correction is None and not s.entropy_bonus.enabled
    B = samples.size

    # one optimizer step of the step's own, with plain SGD so the step follows the gradient
    G = args.num_generations
    rewards = core.weighted_reward_sum(samples.rewards_BF, parts.rewards.weights_F)
    # the rows the loss sees (mask_truncated_completions leaves truncated ones out) of a group with a spread
    trained = [[i for i in range(g * G, (g + 1) * G) if samples.loss_mask_BT[i].any()] for g in range(B // G)]
    group = next((g for g, rows in enumerate(trained) if len({float(rewards[i]) for i in rows}) > 1), None)
    model = parts.model
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sgd_parts = dataclasses.replace(parts, optimizer=sgd, scheduler=torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    stats, _, _ = step.optimizer_step(sgd_parts, batch, fixed, slice(0, B), True, Progress(entropy_coef=args.entropy_coef))
    if checkable:
        # relative to the size of the terms it sums (the loss itself is near 0 at ratio 1 for most objectives)
        scale = max(abs(float(expected)), float(batch.advantages_B.abs().mean()), s.beta)
        report.add("loss", "value equals the formula at ratio 1", abs(stats["loss"] - float(expected)) < 1e-4 * scale + 1e-7,
                   f"{stats['loss']:.6g} vs {float(expected):.6g}",
                   "the loss is normalised by the wrong count, uses the wrong old/reference log-probs, or the "
                   "KL term is wrong: see core.policy_loss and core.LOSS_NORMALISERS")
    else:
        report.add("loss", "value equals the formula at ratio 1", False, "not checked",
                   "top_entropy_quantile < 1 or the engine correction reweights tokens, or an entropy bonus is on; "
                   "the formula check covers the plain objectives only", warn_only=True)
    moved = any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    if bool((batch.advantages_B != 0).any()) or s.beta > 0:
        report.add("loss", "an optimizer step changes the weights", moved, "changed" if moved else "unchanged",
                   "gradients are not applied: see covey.train.step.apply_gradients")
    else:
        report.add("loss", "an optimizer step changes the weights", False, "no signal in this batch",
                   "every advantage is 0 (all groups constant): the rewards give nothing to learn from", warn_only=True)
    if group is None:
        report.add("loss", "step raises the best, lowers the worst", False, "no group with a reward spread",
                   "sample more prompts or use an incremental reward", warn_only=True)
        return
    rows = trained[group]
    best, worst = max(rows, key=lambda i: rewards[i]), min(rows, key=lambda i: rewards[i])
    after = sequence_logprobs(parts, samples)
    T = samples.loss_mask_BT.shape[1]
    before_sums = (logp_BT[:, :T] * samples.loss_mask_BT).sum(1)
    rose, fell = float(after[best] - before_sums[best]), float(after[worst] - before_sums[worst])
    # what the policy-gradient step must do: raise the advantage-weighted log-probs of the batch. Each
    # completion on its own may move otherwise in a small step (a LoRA adapter's first, where B starts at 0)
    gained = float((batch.advantages_B.double() * (after - before_sums).double()).sum())
    value = f"best {rose:+.3g}, worst {fell:+.3g}, sum of A * change {gained:+.3g}"
    if rose > 0 and fell < 0 or gained <= 0:
        report.add("loss", "step raises the best completion and lowers the worst", rose > 0 and fell < 0, value,
                   "the update moves the wrong way: check the loss sign")
    else:
        report.add("loss", "step raises the best completion and lowers the worst", False, value,
                   "the best and worst did not both move their way, though the batch's advantage-weighted "
                   "log-prob rose (a step too small to tell; a LoRA adapter's first)", warn_only=True)


def check_loss_away_from_ratio_one(report: Report, parts: StepParts, batch: ScoredBatch, fixed: FixedLogprobs,
                                   logp_BT: torch.Tensor) -> None:
    """covey's loss with this run's settings, at ratios up to e^0.5 from 1 either way (old log-probs
    moved at random, as after a few optimizer steps), against the formula: clipping is active here,
    as it never is on a first pass."""
    s, L = parts.loss_settings, parts.args.max_completion_length
    if s.top_entropy_quantile < 1.0:
        report.add("loss", "value equals the formula away from ratio 1", False, "not checked",
                   "top_entropy_quantile < 1 trains a subset of tokens; the formula check covers every token",
                   warn_only=True)
        return
    mask = batch.samples.loss_mask_BT.double()
    T = mask.shape[1]
    logp = logp_BT[:, :T].double()
    old = logp + torch.rand(logp.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 0.5
    counts = core.BatchCounts(sequences=mask.shape[0], tokens=float(mask.sum()), micro_batches=1,
                              max_completion_length=L)
    ref = fixed.ref_BT[:, :T].double() if s.beta > 0 else None
    # the old policy as the one that sampled, for the off-policy mask (an exact engine's case); the policy
    # objective alone, without an entropy bonus (which the formula does not cover)
    loss, _ = core.policy_loss(logp, old, batch.advantages_B.double(), mask, counts,
                               dataclasses.replace(s, entropy_bonus=core.EntropyBonus()), ref, behaviour_logp_BT=old)
    expected = formula_loss(batch, fixed.ref_BT, logp, old, s, L)
    w = formula_ratio(logp, old, mask, s.importance_sampling_level)
    value = f"{float(loss):.9g} vs {float(expected):.9g}"
    if s.loss_type in ("sapo", "vespo"):  # soft weights: no clip range to be outside of
        value += f", ratios from {float(w[mask == 1].min()):.3g} to {float(w[mask == 1].max()):.3g}"
    else:  # CISPO caps its weight from above only, at epsilon_high itself
        outside = w > s.epsilon_high if s.loss_type == "cispo" else (w > 1 + s.epsilon_high) | (w < 1 - s.epsilon_low)
        value += f", {float((outside * mask).sum() / mask.sum()):.0%} of ratios outside the clip range"
    report.add("loss", "value equals the formula away from ratio 1", abs(float(loss - expected)) <= 1e-9 * (1 + abs(float(expected))),
               value, "the ratio, its clipping or the KL weight is wrong: see core.POLICY_OBJECTIVES and "
               "core.IMPORTANCE_LEVELS")


def sequence_logprobs(parts: StepParts, samples: Samples) -> torch.Tensor:
    """Sum of the step's log-probs over each completion's trained tokens. (B,)"""
    with torch.no_grad():
        logp, _ = step.logprob_pass(parts, parts.model)(samples.sequences, parts.sampling.distribution, False)
    T = samples.loss_mask_BT.shape[1]
    return (logp.float().cpu()[:, :T] * samples.loss_mask_BT).sum(1)


def check_engine(report: Report, parts: StepParts, batch: ScoredBatch, logp_BT: torch.Tensor,
                 rollout: Rollout) -> None:
    """The sampling log-probs the batch carries, of the tokens the engine sampled (``rollout``, as it
    returned them), against the trainer's: a turn sampled from a context other than the episode's own
    shows here."""
    args = parts.args
    if args.top_k or args.top_p < 1 or args.min_p or args.repetition_penalty != 1:
        report.add("engine", "engine log-probs = trainer log-probs", False, "not comparable",
                   "top_k / top_p / min_p / repetition_penalty change the sampled distribution", warn_only=True)
        return
    on = rollout.sampled_mask_BT == 1
    T = min(on.shape[1], logp_BT.shape[1])
    on = on[:, :T]
    diff = float((batch.samples.sampling_logp_BT[:, :T][on] - logp_BT.float()[:, :T][on]).abs().max())
    exact = parts.engine.exact_logprobs
    report.add("engine", "engine log-probs = trainer log-probs", diff < (1e-3 if exact else 0.1), f"max diff {diff:.2g}",
               "the rollout engine samples from a different distribution than the trainer scores: check the "
               "temperature and the engine's dtype", warn_only=not exact)


def check_episodes(report: Report, parts: StepParts, batch: ScoredBatch, eos_ids: list[int],
                   turns: dict[int, list]) -> None:
    """Token-in, token-out: the ids trained are the ids the model sampled, turn after turn; what a tool or
    the environment wrote between turns is attended to but never trained; tool calls round-trip through
    their format. ``turns``: each episode's turns as the engine handed them to the environment."""
    samples, args = batch.samples, parts.args
    if parts.agent is None:  # one turn each: all of it the model's, and all of it trained
        want = eos_mask(samples.sequences.completion_ids_BT, eos_ids, parts.tokenizer.pad_token_id,
                        samples.finish_reasons, args.max_completion_length)
        if args.mask_truncated_completions:
            want[torch.tensor([reason == "length" for reason in samples.finish_reasons])] = 0
        report.add("episodes", "the loss trains every completion token (one turn each, the model's own)",
                   torch.equal(samples.loss_mask_BT, want), f"{int(want.sum())} tokens",
                   "tokens the model did not sample are trained, or sampled ones are left out: see "
                   "covey.train.step.loss_mask")
        return
    tool_format, schemas = parts.agent.tool_format, parts.agent.schemas()
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
               "not write: see covey.train.step.loss_mask")
    report.add("episodes", "every token the model sampled is trained", not untrained, "checked",
               f"{untrained} episode(s) leave tokens the model sampled out of the loss: see covey.train.step.loss_mask")
    if not environment_tokens:
        report.add("episodes", "an episode called a tool", False, "none in this batch",
                   "no episode of the batch called a tool, so nothing between turns was checked: sample more "
                   "prompts (--num-prompts)", warn_only=True)


def _example_arguments(parameters: dict) -> dict:
    """Arguments of each type a schema names, for a round trip through a tool-call format."""
    examples = {"string": "2 + 3", "integer": 7, "number": 1.5, "boolean": True, "array": [1, 2], "object": {"k": 1}}
    return {name: examples.get(spec.get("type"), "x") for name, spec in parameters.get("properties", {}).items()}


def check_async_correction(report: Report, parts: StepParts, indices: list[int],
                           build_engine: Callable[[torch.nn.Module], Any]) -> None:
    """Under async_generation: a batch sampled by a deliberately older policy (the weights moved by about
    1%) carries that policy's log-probs, and the correction the step applies equals the weights written
    out from them and the current policy's log-probs."""
    older = copy.deepcopy(parts.model).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in older.parameters():
            if p.requires_grad:
                p.mul_(1 + 0.01 * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))
    if isinstance(parts.engine, OwnWeights):  # vLLM's, shared as the worker shares it: the older weights pushed
        parts.engine.policy_changed(older)
        try:
            batch = step.score_prompts(parts, indices)
        finally:
            parts.engine.policy_changed(parts.model)
    else:
        batch = step.score_prompts(dataclasses.replace(parts, engine=build_engine(older)), indices)
    samples, correction = batch.samples, parts.correction
    mask = samples.loss_mask_BT.float()
    on = mask.bool()
    T = mask.shape[1]
    sampling = samples.sampling_logp_BT[:, :T]
    older_logp = step.logprobs_no_grad(parts, older, samples.sequences)[:, :T]
    current = step.logprobs_no_grad(parts, parts.model, samples.sequences)[:, :T]
    own = float((sampling - older_logp)[on].abs().max())
    apart = float((current - older_logp)[on].abs().mean())
    tolerance = 0.1 if parts.args.sample_in_bf16(parts.device) else 1e-3
    report.add("async", "the rows carry the log-probs of the older policy that sampled them", own < tolerance,
               f"max |sampling - older| {own:.2g}; the current policy is {apart:.2g} away on average",
               "the sampling log-probs are not those of the policy that sampled: the correction would use the "
               "wrong ones (see covey.train.asynchronous)")
    # the step's own correction, through an optimizer step that moves nothing (SGD at learning rate 0)
    sgd = torch.optim.SGD([p for p in parts.model.parameters() if p.requires_grad], lr=0.0)
    still = dataclasses.replace(parts, optimizer=sgd, scheduler=torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0))
    totals, _, _ = step.optimizer_step(still, batch, step.fixed_logprobs(parts, batch), slice(0, samples.size), True,
                                       Progress(entropy_coef=parts.args.entropy_coef))
    w = formula_correction(current, sampling, mask, correction)
    expected = float(w.sum() if correction.level == "sequence" else (w * mask.double()).sum())
    got = totals.get("engine_weight_sum")
    ok = got is not None and math.isclose(got, expected, rel_tol=1e-4, abs_tol=1e-6)
    mean = expected / (samples.size if correction.level == "sequence" else float(mask.sum()))
    report.add("async", "the step's correction equals pi_current / pi_sampling written out", ok,
               f"sum of weights {got if got is None else f'{got:.6g}'} vs {expected:.6g} (mean {mean:.4g}, "
               f"{correction.level} level, {correction.action})",
               "the step corrects with other log-probs than the rows' own sampling ones, or none: see "
               "covey.train.step.sampled_exactly and core.engine_importance_weights")
