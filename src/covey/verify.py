"""covey verify: run every stage of a pipeline on one small real batch and check its invariant.

A GRPO run that does not learn usually has several independent defects, each of which silently
zeroes or inverts the signal. Each stage below is checked against an independent computation
written here (not by calling the code under test twice), in the order of the loop, so the first
FAIL names the broken stage:

    setup       the config, the model and its tokenizer load together
    data        prompts, columns that rewards need, alignment of columns with completions
    decode      the text rewards receive: plain, complete and unterminated reasoning, no special tokens
    rewards     one value per completion, lined up with its completion, not constant, weights applied
    advantages  group sums ~0, order follows reward, eps small, constant groups zero
    logprobs    <= 0, equal to a plain log_softmax gather, padding out, EOS in
    loss        value equal to the formula on the first pass (ratio 1) and away from it (clipping
                active), KL >= 0 and 0 at the reference, one step raises the best completion and
                lowers the worst
    engine      the sampler samples a batch, and its log-probs agree with the trainer's forward
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import dataclass

import torch

from covey import core, text
from covey.config import GRPOConfig
from covey.errors import ConfigError, CoveyError, DataError, ModelError, RewardError
from covey.rewards import (TRAINER_REWARD_ARGS, call_reward, required_columns, returned_values, reward_name,
                           without_logging)

STAGES = ("setup", "data", "decode", "rewards", "advantages", "logprobs", "loss", "engine")


@dataclass
class Check:
    stage: str
    name: str
    value: str
    status: str  # PASS | WARN | FAIL
    hint: str = ""


class Report:
    def __init__(self) -> None:
        self.checks: list[Check] = []

    def add(self, stage: str, name: str, ok: bool, value: str, hint: str = "", warn_only: bool = False) -> bool:
        status = "PASS" if ok else ("WARN" if warn_only else "FAIL")
        self.checks.append(Check(stage, name, value, status, "" if ok else hint))
        return ok

    @property
    def first_failure(self) -> str | None:
        failed = {c.stage for c in self.checks if c.status == "FAIL"}
        return next((s for s in STAGES if s in failed), None)


def verify(args: GRPOConfig, num_prompts: int = 2, model=None, processing_class=None, train_dataset=None,
           reward_funcs=None) -> Report:
    """Check the pipeline ``args`` describes (or the given objects) stage by stage."""
    from covey.trainer import GRPOTrainer, one_batch_settings

    report = Report()
    settings = one_batch_settings(args, num_prompts, max_steps=1, log_completions=False, num_iterations=1,
                                  dynamic_sampling=False)
    try:
        trainer = GRPOTrainer(model=copy.deepcopy(model) if model is not None else None, reward_funcs=reward_funcs,
                              args=settings, train_dataset=train_dataset, processing_class=processing_class, quiet=True)
    except DataError as e:
        report.add("data", "dataset loads", False, "error", str(e))
        return report
    except RewardError as e:
        report.add("rewards", "reward functions load", False, "error", str(e))
        return report
    except (ModelError, ConfigError) as e:
        report.add("setup", "the model, its tokenizer and the settings load", False, "error", str(e))
        return report
    parameters = sum(p.numel() for p in trainer.model.parameters())
    report.add("setup", "the model, its tokenizer and the settings load", True,
               f"{trainer.model_name}: {parameters / 1e6:.1f}M parameters")
    check_data(report, trainer)
    check_decode(report, trainer)
    indices = list(range(min(num_prompts, len(trainer.train_rows))))
    calls = _record_reward_calls(trainer)
    try:
        batch, _ = trainer.generate_and_score(indices)
    except RewardError as e:
        report.add("rewards", "reward functions run on a sampled batch", False, "error", str(e))
        return report
    except DataError as e:
        report.add("data", "the prompts of a batch are sampled", False, "error", str(e))
        return report
    except CoveyError as e:
        report.add("engine", f"the {settings.rollout_engine} engine samples a batch", False, "error", str(e))
        return report
    check_columns(report, trainer, indices, calls)
    check_rewarded_text(report, trainer, batch, calls)
    check_rewards(report, trainer, batch, calls)
    check_advantages(report, trainer, batch)
    logp_BT = check_logprobs(report, trainer, batch)
    check_loss(report, trainer, batch, logp_BT)
    check_loss_away_from_ratio_one(report, trainer, batch, logp_BT)
    check_engine(report, trainer, batch, logp_BT)
    return report


# ---- stages -------------------------------------------------------------------------------------


def check_data(report: Report, trainer) -> None:
    rows, args = trainer.train_rows, trainer.args
    chat = isinstance(rows[0]["prompt"], list)
    report.add("data", "prompt column", True, "chat messages" if chat else "plain text")
    longest = max(len(ids) for ids in trainer.prompt_ids)
    report.add("data", "prompt lengths fit", longest <= args.max_prompt_length,
               f"longest {longest} <= {args.max_prompt_length} tokens", "raise max_prompt_length")
    if chat:
        _check_chat_template(report, trainer.tokenizer, rows[0]["prompt"])
    columns = set(rows[0]) - {"prompt"}
    for func in trainer.reward_funcs:
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
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=opened)

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


def check_rewarded_text(report: Report, trainer, batch, calls: list[dict]) -> None:
    """What the reward functions were given is the text of each row's own sampled tokens (no prompt,
    no special tokens), decoded here independently of the trainer."""
    if not calls:
        return
    seq = batch.sequences
    wrong = None
    for i, completion in enumerate(calls[0]["completions"]):
        ids = seq.completion_ids_BT[i, : int(seq.completion_mask_BT[i].sum())].tolist()
        want = trainer.tokenizer.decode(ids, skip_special_tokens=True)
        if trainer.args.strip_reasoning:
            want = text.answer_after_reasoning(want)
        got = completion[0]["content"] if isinstance(completion, list) else completion
        if got != want:
            wrong = (i, got, want)
            break
    report.add("decode", "rewards see each sampled completion's text", wrong is None,
               f"{len(calls[0]['completions'])} completions compared",
               f"completion {wrong[0]} reached the rewards as {wrong[1][:60]!r}, but its tokens read {wrong[2][:60]!r}: "
               "see text.decode_completions" if wrong else "")


def check_decode(report: Report, trainer) -> None:
    """Decode known completions (with EOS and padding) and compare with the text they came from."""
    tokenizer = trainer.tokenizer
    samples = ["The sum is 12.", "<think>7 + 5 is 12</think> 12", "<think>7 + 5 is"]
    answers = {True: ["The sum is 12.", "12", ""], False: samples}
    ids = [tokenizer(s, add_special_tokens=False)["input_ids"] + [trainer.eos_ids[0]] for s in samples]
    width = max(len(i) for i in ids) + 2
    ids_BT = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    mask_BT = core.completion_mask(ids_BT, trainer.eos_ids)
    names = ("plain completion", "complete reasoning block", "unterminated reasoning block")
    for strip in sorted({trainer.args.strip_reasoning, True}, reverse=True):
        texts, _ = text.decode_completions(tokenizer, ids_BT, mask_BT, conversational=False, strip_reasoning=strip)
        for name, got, want in zip(names, texts, answers[strip]):
            got_clean = got.strip()
            report.add("decode", f"{name}{' (strip_reasoning)' if strip else ''}", got_clean == want.strip(),
                       repr(got_clean[:40]), f"rewards would see {got!r}, expected {want!r}: see text.decode_completions "
                       "and text.answer_after_reasoning")
    specials = [t for t in (tokenizer.eos_token, tokenizer.pad_token) if t]
    plain, _ = text.decode_completions(tokenizer, ids_BT, mask_BT, conversational=False)
    leaked = [s for s in specials if any(s in t for t in plain)]
    report.add("decode", "special tokens and padding removed", not leaked, "none left" if not leaked else str(leaked),
               "decode with skip_special_tokens and cut at the completion mask")


def check_columns(report: Report, trainer, indices: list[int], calls: list[dict]) -> None:
    G = trainer.args.num_generations
    if not calls:
        return
    columns = {k: v for k, v in calls[0].items() if k not in TRAINER_REWARD_ARGS}
    bad = [(k, i) for k, values in columns.items() for i, v in enumerate(values)
           if v != trainer.train_rows[indices[i // G]][k]]
    report.add("data", "columns aligned with completions", not bad, f"{len(columns)} column(s) checked",
               f"column {bad[0][0]!r} at completion {bad[0][1]} belongs to another prompt: see data.extra_columns"
               if bad else "")


def check_rewards(report: Report, trainer, batch, calls: list[dict]) -> None:
    rewards_BF = batch.rewards_BF
    kwargs = without_logging(calls[0])  # the batch the trainer gave the reward functions
    n = len(kwargs["completions"])
    for j, func in enumerate(trainer.reward_funcs):
        column = rewards_BF[:, j]
        defined = column[~column.isnan()]
        report.add("rewards", f"{reward_name(func)} varies over the batch", defined.numel() > 1 and bool(defined.std() > 0),
                   f"{defined.numel()} values, std {float(defined.std()) if defined.numel() > 1 else 0:.3g}",
                   "a constant reward gives no signal: make it incremental (partial credit)", warn_only=True)
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
                   "the reward table is shifted or reordered against the completions: see rewards.score_completions")
    weights = trainer.reward_weights
    total = core.weighted_reward_sum(rewards_BF, trainer.reward_weights_F)
    manual = [sum(w * v for w, v in zip(weights, row) if not math.isnan(v)) for row in rewards_BF.tolist()]
    report.add("rewards", "weights applied", torch.allclose(total.nan_to_num(0.0), torch.tensor(manual, dtype=torch.float64)),
               f"weights {weights}", "core.weighted_reward_sum does not equal sum(weight * reward)")


def check_advantages(report: Report, trainer, batch) -> None:
    args, G = trainer.args, trainer.args.num_generations
    weights = trainer.reward_weights_F
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
        rewards = core.weighted_reward_sum(batch.rewards_BF, weights).view(-1, G)
        adv_NG = batch.advantages_B.view(-1, G).double()
        inverted = ((rewards[:, :, None] > rewards[:, None, :]) & (adv_NG[:, :, None] < adv_NG[:, None, :])).any()
        report.add("advantages", "order follows reward in the sampled batch", not bool(inverted), "checked",
                   "a better completion got a lower advantage")
        if not bool(batch.rewards_BF.isnan().any()):  # the sampled batch's own advantages, written out
            want = _advantages_written_out(rewards, args.scale_rewards).flatten()
            off = float((batch.advantages_B.double() - want).abs().max())
            report.add("advantages", "the batch's advantages equal (r - mean) / (std + eps)", off < 1e-4,
                       f"max diff {off:.2g}", "the trainer's advantages are not the formula's: see core.group_advantages")


def _advantages_written_out(rewards_NG: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """GRPO's advantages of G completions per row, each group centred on its mean and divided by its
    (unbiased) std, the whole batch's, or nothing."""
    spread = {"group": rewards_NG.std(1, keepdim=True), "batch": rewards_NG.std(),
              "none": torch.tensor(1.0, dtype=torch.float64)}[scale_rewards]
    eps = 0.0 if scale_rewards == "none" else core.ADVANTAGE_EPS
    return (rewards_NG - rewards_NG.mean(1, keepdim=True)) / (spread + eps)


def check_logprobs(report: Report, trainer, batch) -> torch.Tensor:
    """Compare the trainer's log-probs with a plain full forward and a log_softmax gather."""
    args, model, seq = trainer.args, trainer.model, batch.sequences
    with torch.no_grad():
        from covey.trainer import completion_logprobs  # the function the trainer calls, as it calls it

        got, _ = completion_logprobs(model, seq, args.temperature)
        input_ids = torch.cat([seq.prompt_ids_BP, seq.completion_ids_BT], 1)
        attention = torch.cat([seq.prompt_mask_BP, seq.completion_mask_BT], 1)
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        device = next(model.parameters()).device
        logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                       position_ids=positions.to(device)).logits.float().cpu()
        P = seq.prompt_ids_BP.shape[1]
        reference = torch.log_softmax(logits[:, P - 1:-1] / args.temperature, -1)
        want = reference.gather(-1, seq.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
    expected_mask = _eos_mask(seq.completion_ids_BT, trainer.eos_ids, trainer.tokenizer.pad_token_id,
                              batch.finish_reasons, args.max_completion_length)
    on = expected_mask == 1
    got = got.float().cpu()
    report.add("logprobs", "all <= 0", bool((got[on] <= 1e-6).all()), f"max {float(got[on].max()):.3g}",
               "log-probs must be <= 0: the log-softmax operands are reversed (see core.token_logprobs)")
    diff = float((got[on] - want[on]).abs().max())
    report.add("logprobs", "equal to log_softmax gathered at the token", diff < 1e-3, f"max diff {diff:.2g}",
               "the trainer's log-probs differ from a plain forward: see logprobs.completion_logprobs")
    eos_kept = all(seq.completion_ids_BT[row, int(seq.completion_mask_BT[row].sum()) - 1].item() in trainer.eos_ids
                   for row, reason in enumerate(batch.finish_reasons) if reason == "eos")
    report.add("logprobs", "padding and prompt excluded, EOS included",
               torch.equal(seq.completion_mask_BT, expected_mask) and eos_kept,
               f"{int(expected_mask.sum())} completion tokens",
               "the completion mask must be 1 up to and including the first EOS and 0 after: see core.completion_mask")
    return want


def check_loss(report: Report, trainer, batch, logp_BT: torch.Tensor) -> None:
    args = trainer.args
    s = trainer.loss_settings
    logp = -torch.rand(3, 4, dtype=torch.float64)
    estimator = core.KL_ESTIMATORS[s.kl_estimator]
    report.add("loss", "KL is 0 when policy = reference", bool((estimator(logp, logp) == 0).all()), s.kl_estimator,
               "see core.KL_ESTIMATORS")
    k3 = core.KL_ESTIMATORS["k3"](logp, logp - torch.rand(3, 4, dtype=torch.float64))
    report.add("loss", "k3 KL >= 0", bool((k3 >= 0).all()), f"min {float(k3.min()):.3g}", "the KL sign is flipped")

    # the reference is moved away from the policy first, so a ratio taken against it would show
    if batch.ref_logp_BT is not None:
        batch.ref_logp_BT = batch.ref_logp_BT - 0.1
    expected = formula_loss(batch, logp_BT, logp_BT, s, args.max_completion_length)  # ratio exactly 1
    checkable = s.top_entropy_quantile == 1.0 and batch.engine_weights is None
    B = batch.loss_mask_BT.shape[0]

    # one optimizer step, plain SGD so the step follows the gradient
    G = args.num_generations
    rewards = core.weighted_reward_sum(batch.rewards_BF, trainer.reward_weights_F)
    # the rows the loss sees (mask_truncated_completions leaves truncated ones out) of a group with a spread
    trained = [[i for i in range(g * G, (g + 1) * G) if batch.loss_mask_BT[i].any()] for g in range(B // G)]
    group = next((g for g, rows in enumerate(trained) if len({float(rewards[i]) for i in rows}) > 1), None)
    trainer.optimizer = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=1e-2)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    stats = trainer.optimize(batch)
    if checkable:
        # relative to the size of the terms it sums (the loss itself is near 0 at ratio 1 for most objectives)
        scale = max(abs(float(expected)), float(batch.advantages_B.abs().mean()), s.beta)
        report.add("loss", "value equals the formula at ratio 1", abs(stats["loss"] - float(expected)) < 1e-4 * scale + 1e-7,
                   f"{stats['loss']:.6g} vs {float(expected):.6g}",
                   "the loss is normalised by the wrong count, uses the wrong old/reference log-probs, or the "
                   "KL term is wrong: see core.policy_loss and core.LOSS_NORMALISERS")
    else:
        report.add("loss", "value equals the formula at ratio 1", False, "not checked",
                   "top_entropy_quantile < 1 or the engine correction reweights tokens; the formula check "
                   "covers the plain objectives only", warn_only=True)
    moved = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    if bool((batch.advantages_B != 0).any()) or s.beta > 0:
        report.add("loss", "an optimizer step changes the weights", moved, "changed" if moved else "unchanged",
                   "gradients are not applied: see GRPOTrainer.apply_gradients")
    else:
        report.add("loss", "an optimizer step changes the weights", False, "no signal in this batch",
                   "every advantage is 0 (all groups constant): the rewards give nothing to learn from", warn_only=True)
    if group is None:
        report.add("loss", "step raises the best, lowers the worst", False, "no group with a reward spread",
                   "sample more prompts or use an incremental reward", warn_only=True)
        return
    rows = trained[group]
    best, worst = max(rows, key=lambda i: rewards[i]), min(rows, key=lambda i: rewards[i])
    after = sequence_logprobs(trainer, batch)
    T = batch.loss_mask_BT.shape[1]
    before_sums = (logp_BT[:, :T] * batch.loss_mask_BT).sum(1)
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


def formula_loss(batch, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, s: core.LossSettings,
                 max_completion_length: int) -> torch.Tensor:
    """The loss written out from the papers (docs/algorithms.md), in float64: the clipped surrogate
    (with delta's cap and dual-clip's floor) or CISPO's weighted log-prob, on the token ratio or GSPO's
    sequence ratio, plus beta times the KL estimator (times that ratio with use_bias_correction_kl),
    aggregated as loss_type says."""
    mask = batch.loss_mask_BT.double()
    adv = batch.advantages_B.double()[:, None]
    T = mask.shape[1]
    logp, old = logp_BT[:, :T].double(), old_logp_BT[:, :T].double()
    w = _formula_ratio(logp, old, mask, s.importance_sampling_level)
    if s.loss_type == "cispo":
        per_token = -torch.clamp(w, max=1 + s.epsilon_high) * adv * logp
    else:
        unclipped = w if s.delta is None else torch.clamp(w, max=s.delta)
        objective = torch.minimum(unclipped * adv, torch.clamp(w, 1 - s.epsilon_low, 1 + s.epsilon_high) * adv)
        if s.clip_ratio_c is not None:
            objective = torch.where(adv < 0, torch.maximum(objective, s.clip_ratio_c * adv), objective)
        per_token = -objective
    if s.beta > 0:
        d = batch.ref_logp_BT[:, :T].double() - logp
        kl = {"k1": -d, "k2": 0.5 * d ** 2, "k3": torch.exp(d) - d - 1}[s.kl_estimator]
        per_token = per_token + s.beta * (kl * w if s.use_bias_correction_kl else kl)
    B = mask.shape[0]
    token_mean = (per_token * mask).sum() / mask.sum().clamp(min=1)
    return {
        "grpo": ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / B,
        "bnpo": token_mean,
        "dr_grpo": (per_token * mask).sum() / (B * max_completion_length),
        "dapo": token_mean,
        "cispo": token_mean,
    }[s.loss_type]


def _formula_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Each token's importance ratio: its own, or (GSPO) its sequence's length-normalised one."""
    if level == "sequence":
        return torch.exp(((logp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
    return torch.exp(logp - old)


def check_loss_away_from_ratio_one(report: Report, trainer, batch, logp_BT: torch.Tensor) -> None:
    """covey's loss with this run's settings, at ratios up to e^0.5 from 1 either way (old log-probs
    moved at random, as after a few optimizer steps), against the formula: clipping is active here,
    as it never is on a first pass."""
    s = trainer.loss_settings
    if s.top_entropy_quantile < 1.0:
        report.add("loss", "value equals the formula away from ratio 1", False, "not checked",
                   "top_entropy_quantile < 1 trains a subset of tokens; the formula check covers every token",
                   warn_only=True)
        return
    mask = batch.loss_mask_BT.double()
    T = mask.shape[1]
    logp = logp_BT[:, :T].double()
    old = logp + torch.rand(logp.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 0.5
    counts = core.BatchCounts(sequences=mask.shape[0], tokens=float(mask.sum()), micro_batches=1,
                              max_completion_length=trainer.args.max_completion_length)
    ref = batch.ref_logp_BT[:, :T].double() if s.beta > 0 else None
    loss, _ = core.policy_loss(logp, old, batch.advantages_B.double(), mask, counts, s, ref)
    expected = formula_loss(batch, logp, old, s, trainer.args.max_completion_length)
    w = _formula_ratio(logp, old, mask, s.importance_sampling_level)
    outside = w > 1 + s.epsilon_high
    if s.loss_type != "cispo":  # CISPO caps its weight from above only
        outside |= w < 1 - s.epsilon_low
    value = (f"{float(loss):.9g} vs {float(expected):.9g}, {float((outside * mask).sum() / mask.sum()):.0%} of "
             "ratios outside the clip range")
    report.add("loss", "value equals the formula away from ratio 1", abs(float(loss - expected)) <= 1e-9 * (1 + abs(float(expected))),
               value, "the ratio, its clipping or the KL weight is wrong: see core.POLICY_OBJECTIVES and "
               "core.IMPORTANCE_LEVELS")


def sequence_logprobs(trainer, batch) -> torch.Tensor:
    """Sum of the trainer's log-probs over each completion's trained tokens. (B,)"""
    from covey.trainer import completion_logprobs

    with torch.no_grad():
        logp, _ = completion_logprobs(trainer.model, batch.sequences, trainer.args.temperature)
    T = batch.loss_mask_BT.shape[1]
    return (logp.float().cpu()[:, :T] * batch.loss_mask_BT).sum(1)


def check_engine(report: Report, trainer, batch, logp_BT: torch.Tensor) -> None:
    args = trainer.args
    if args.top_k or args.top_p < 1 or args.min_p or args.repetition_penalty != 1:
        report.add("engine", "engine log-probs = trainer log-probs", False, "not comparable",
                   "top_k / top_p / min_p / repetition_penalty change the sampled distribution", warn_only=True)
        return
    on = batch.sequences.completion_mask_BT == 1
    diff = float((batch.sampling_logp_BT[on] - logp_BT.float()[on]).abs().max())
    exact = getattr(trainer.engine, "exact_logprobs", True)
    report.add("engine", "engine log-probs = trainer log-probs", diff < (1e-3 if exact else 0.1), f"max diff {diff:.2g}",
               "the rollout engine samples from a different distribution than the trainer scores: check the "
               "temperature and the engine's dtype", warn_only=not exact)


# ---- helpers ------------------------------------------------------------------------------------


def _record_reward_calls(trainer) -> list[dict]:
    """Wrap each reward function so its calls' arguments are recorded; an async function stays async,
    so that score_completions awaits it as it would the function itself."""
    calls: list[dict] = []

    def failed(func, e: Exception) -> RewardError:  # a user function's own bug: report it as the rewards stage
        return RewardError(f"reward function {reward_name(func)!r} raised {type(e).__name__}: {e}")

    def recording(func):
        if inspect.iscoroutinefunction(func):
            async def wrapper(**kwargs):
                calls.append(kwargs)
                try:
                    return await func(**kwargs)
                except Exception as e:
                    raise failed(func, e) from e
        else:
            def wrapper(**kwargs):
                calls.append(kwargs)
                try:
                    return func(**kwargs)
                except Exception as e:
                    raise failed(func, e) from e
        wrapper.__name__ = reward_name(func)
        return wrapper

    trainer.reward_funcs = [recording(f) for f in trainer.reward_funcs]
    return calls


def _eos_mask(ids_BT: torch.Tensor, eos_ids: list[int], pad_id: int, finish_reasons: list[str],
              max_length: int) -> torch.Tensor:
    """1 up to and including the first EOS of each row; a row cut at the length limit: all of its
    max_length tokens (the pad token may be among them, sampled); a row ended by a stop string:
    everything before its trailing padding."""
    mask = torch.zeros_like(ids_BT)
    for row, (ids, reason) in enumerate(zip(ids_BT.tolist(), finish_reasons)):
        end = next((t + 1 for t, tok in enumerate(ids) if tok in eos_ids), None)
        if end is None and reason == "length":
            end = max_length
        elif end is None:
            end = len(ids)
            while end > 0 and ids[end - 1] == pad_id:
                end -= 1
        mask[row, :end] = 1
    return mask


def print_report(report: Report, console) -> int:
    from rich.table import Table

    table = Table(title="covey verify")
    for column in ("stage", "check", "measured", "status", "what to do"):
        table.add_column(column)
    colours = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
    for c in report.checks:
        table.add_row(c.stage, c.name, c.value, f"[{colours[c.status]}]{c.status}[/]", c.hint)
    console.print(table)
    failed = report.first_failure
    if failed:
        console.print(f"[bold red]FAIL[/]: first failing stage: {failed}")
        return 1
    console.print("[green]every stage passed[/]")
    return 0
