"""The stages of covey verify after the rewards: what the step computes from the scored batch (advantages,
log-probs, the loss at ratio 1 and away from it, the engine's log-probs against the trainer's, and the
asynchronous correction), each checked against an independent computation (``covey.verify.formulas``)."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable

import torch

from covey import core
from covey.rollout import OwnWeights, Rollout
from covey.train import rounds, update
from covey.train.batch import FixedLogprobs, Progress, Samples, ScoredBatch
from covey.train.parts import StepParts
from covey.verify.formulas import (advantages_written_out, eos_mask, episode_layout, formula_correction,
                                   formula_loss, formula_ratio)
from covey.verify.images import plain_inputs
from covey.verify.report import Report


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
    args, model, seq = parts.args, parts.policy.model, batch.samples.sequences
    with torch.no_grad():
        got, _ = parts.policy.pass_for(model)(seq, parts.sampler.sampling.distribution, False)  # the step's own pass
        logits = model(**plain_inputs(model, seq)).logits.float().cpu()  # with the rows' pictures, if any
        P = seq.prompt_ids_BP.shape[1]
        # the distribution sampled from: logits / temperature over the tokens top_k/top_p/min_p keep
        reference = parts.sampler.sampling.distribution.logits(logits[:, P - 1:-1], seq.completion_ids_BT).log_softmax(-1)
        want = reference.gather(-1, seq.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
    if parts.sampler.agent is None:
        expected_mask = eos_mask(seq.completion_ids_BT, eos_ids, parts.sampler.tokenizer.pad_token_id,
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
    model = parts.policy.model
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sgd_parts = parts.stepping_with(sgd)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    stats, _, _ = update.optimizer_step(sgd_parts, batch, fixed, slice(0, B), True, Progress(entropy_coef=args.entropy_coef))
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
                   "gradients are not applied: see covey.train.policy.Policy.apply_gradients")
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
    objective = core.LOSS_TYPES[s.loss_type].objective
    if objective in ("sapo", "vespo"):  # soft weights: no clip range to be outside of
        value += f", ratios from {float(w[mask == 1].min()):.3g} to {float(w[mask == 1].max()):.3g}"
    else:  # CISPO caps its weight from above only, at epsilon_high itself
        outside = w > s.epsilon_high if objective == "cispo" else (w > 1 + s.epsilon_high) | (w < 1 - s.epsilon_low)
        value += f", {float((outside * mask).sum() / mask.sum()):.0%} of ratios outside the clip range"
    report.add("loss", "value equals the formula away from ratio 1", abs(float(loss - expected)) <= 1e-9 * (1 + abs(float(expected))),
               value, "the ratio, its clipping or the KL weight is wrong: see core.POLICY_OBJECTIVES and "
               "core.IMPORTANCE_LEVELS")


def sequence_logprobs(parts: StepParts, samples: Samples) -> torch.Tensor:
    """Sum of the step's log-probs over each completion's trained tokens. (B,)"""
    with torch.no_grad():
        logp, _ = parts.policy.pass_for(parts.policy.model)(samples.sequences, parts.sampler.sampling.distribution, False)
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
    exact = parts.sampler.engine.exact_logprobs
    report.add("engine", "engine log-probs = trainer log-probs", diff < (1e-3 if exact else 0.1), f"max diff {diff:.2g}",
               "the rollout engine samples from a different distribution than the trainer scores: check the "
               "temperature and the engine's dtype", warn_only=not exact)



def check_async_correction(report: Report, parts: StepParts, indices: list[int],
                           build_engine: Callable[[torch.nn.Module], Any]) -> None:
    """Under async_generation: a batch sampled by a deliberately older policy (the weights moved by about
    1%) carries that policy's log-probs, and the correction the step applies equals the weights written
    out from them and the current policy's log-probs."""
    older = copy.deepcopy(parts.policy.model).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in older.parameters():
            if p.requires_grad:
                p.mul_(1 + 0.01 * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))
    if isinstance(parts.sampler.engine, OwnWeights):  # vLLM's, shared as the worker shares it: the older weights pushed
        parts.sampler.engine.policy_changed(older)
        try:
            batch = rounds.score_prompts(parts, indices)
        finally:
            parts.sampler.engine.policy_changed(parts.policy.model)
    else:
        batch = rounds.score_prompts(parts.sampling_with(build_engine(older)), indices)
    samples, correction = batch.samples, parts.sampler.engine_correction  # the one configured
    mask = samples.loss_mask_BT.float()
    on = mask.bool()
    T = mask.shape[1]
    sampling = samples.sampling_logp_BT[:, :T]
    older_logp = update.logprobs_no_grad(parts, older, samples.sequences)[:, :T]
    current = update.logprobs_no_grad(parts, parts.policy.model, samples.sequences)[:, :T]
    own = float((sampling - older_logp)[on].abs().max())
    apart = float((current - older_logp)[on].abs().mean())
    tolerance = 0.1 if parts.args.sample_in_bf16(parts.policy.device) else 1e-3
    report.add("async", "the rows carry the log-probs of the older policy that sampled them", own < tolerance,
               f"max |sampling - older| {own:.2g}; the current policy is {apart:.2g} away on average",
               "the sampling log-probs are not those of the policy that sampled: the correction would use the "
               "wrong ones (see covey.train.asynchronous)")
    # the step's own correction, through an optimizer step that moves nothing (SGD at learning rate 0)
    sgd = torch.optim.SGD([p for p in parts.policy.model.parameters() if p.requires_grad], lr=0.0)
    still = parts.stepping_with(sgd)
    totals, _, _ = update.optimizer_step(still, batch, update.fixed_logprobs(parts, batch), slice(0, samples.size), True,
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
               "covey.train.sampler.Sampler.exact and core.engine_importance_weights")
