"""covey verify --trl, on what TRL trains from the scored batch: its advantages, log-probs and loss against
formulas written here, and the direction of one small step (then undone). See ``covey.verify.trl``."""

from __future__ import annotations

import math

import torch

from covey import core
from covey.verify.formulas import formula_token_loss
from covey.verify.trl_batch import BatchChecks, _short


class Checks(BatchChecks):
    """The checks of a scored batch's training: each a stage of its own."""

    # ---- advantages ---------------------------------------------------------------------------

    def advantages(self) -> None:
        t, rpf, G = self.trainer, self.rewards_per_func, self.G
        got = self.out["advantages"].detach().float().cpu()
        weights = t.reward_weights.float().cpu()
        totals = (rpf * weights).nansum(1)
        groups = totals.view(-1, G)
        centred = groups - groups.nanmean(1, keepdim=True)
        got_G = got.view(-1, G)
        sums = got_G.sum(1).abs().max()
        self.report.add("advantages", "each group's advantages sum to ~0", bool(sums < 1e-3), f"max |sum| {sums:.2e}",
                        "the group mean is not taken off the rewards")
        moving = centred.abs() > 1e-6
        agree = bool(((got_G * centred)[moving] > 0).all()) if moving.any() else True
        self.report.add("advantages", "the order of advantages follows the rewards", agree,
                        f"rewards {_short(groups[0].tolist())} -> advantages {_short(got_G[0].tolist())}",
                        "advantages have the opposite sign of (reward - group mean): the update would unlearn")
        constant = ~moving.any(1)
        zero = bool((got_G[constant].abs() < 1e-6).all()) if constant.any() else True
        self.report.add("advantages", "a group whose rewards are all alike has zero advantages", zero,
                        f"{int(constant.sum())} such group(s)", "constant groups must carry no signal")
        scale = str(getattr(t, "scale_rewards", getattr(t.args, "scale_rewards", "group")))
        if scale in ("group", "True", "true") and moving.any():
            std = groups.std(1, keepdim=True)  # as TRL: Bessel's correction
            rows = moving.any(1)
            eps = (centred / got_G.where(got_G.abs() > 1e-12, torch.full_like(got_G, float("nan"))) - std)[moving]
            eps_value = float(eps.nanmedian()) if rows.any() else 0.0
            self.report.add("advantages", "the epsilon under the group std is small", abs(eps_value) < 1e-2,
                            f"epsilon ~ {eps_value:.2g}", "advantages are divided by (std + epsilon) with a large "
                            "epsilon, which shrinks them towards zero: TRL's is 1e-4")

    # ---- log-probs ----------------------------------------------------------------------------

    def logprobs(self) -> torch.Tensor | None:
        t, out = self.trainer, self.out
        prompt, completion = out["prompt_ids"], out["completion_ids"]
        mask = out["completion_mask"].float()
        ids = torch.cat([prompt, completion], 1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        K = completion.shape[1]
        # the loss mask, written out from the chosen ids: each completion's tokens, its EOS included
        lengths = torch.tensor([len(c[2]) for group in self.groups for c in group])
        expected_mask = (torch.arange(K).unsqueeze(0) < lengths.unsqueeze(1)).float()
        self.report.add("logprobs", "the loss mask holds the completion up to its EOS, and no padding",
                        torch.equal(mask.cpu(), expected_mask), f"{int(mask.sum())} tokens masked in, "
                        f"{int(expected_mask.sum())} written out", "the completion mask lets padding (or the prompt) "
                        "into the loss, or leaves the EOS token out")
        with torch.no_grad():
            got = t._get_per_token_logps_and_entropies(t.model, ids, attention, K)
            got = (got[0] if isinstance(got, tuple) else got).float()
            logits = t.model(input_ids=ids, attention_mask=attention).logits[:, -K - 1:-1].float() / t.temperature
            expected = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        on = expected_mask.bool().to(got.device)
        diff = float((got - expected)[on].abs().max()) if on.any() else 0.0
        half = bool(getattr(t.args, "bf16", False) or getattr(t.args, "fp16", False))  # TRL's pass in 16 bits
        tolerance = 0.1 if half else 1e-3
        self.report.add("logprobs", "TRL's log-probs equal log_softmax gathered at the token", diff < tolerance,
                        f"max |difference| {diff:.2e} (tolerance {tolerance:g})",
                        "the per-token log-probs are not log p(token): check the "
                        "log-softmax (its operands), the temperature and the shift by one")
        positive = float(got[on].max()) if on.any() else 0.0
        self.report.add("logprobs", "every log-prob is <= 0", positive <= 1e-6, f"max {positive:.3g}",
                        "a log-probability above 0 is no probability: log_softmax's operands are reversed?")
        return got

    # ---- loss ---------------------------------------------------------------------------------

    def loss(self, logp: torch.Tensor) -> None:
        t, out = self.trainer, self.out
        loss_type = getattr(t, "loss_type", t.args.loss_type)
        if loss_type not in TRL_AGGREGATIONS:
            self.report.add("loss", f"loss_type {loss_type} against its formula", False, "not checked",
                            f"covey checks TRL's {', '.join(TRL_AGGREGATIONS)}", warn_only=True)
            return
        t.current_gradient_accumulation_steps = 1
        mask = out["completion_mask"].float()
        generator = torch.Generator().manual_seed(0)
        old = logp + 0.3 * torch.randn(logp.shape, generator=generator)
        beta = float(getattr(t, "beta", 0.0))
        ref = logp + 0.2 * torch.randn(logp.shape, generator=generator)
        for label, old_logp in (("at ratio 1", None), ("away from ratio 1 (clipping)", old)):
            inputs = dict(out)
            if old_logp is None:
                inputs.pop("old_per_token_logps", None)
            else:
                inputs["old_per_token_logps"] = old_logp
            if beta:
                inputs["ref_per_token_logps"] = ref
            with torch.no_grad():
                got = float(t._compute_loss(t.model, inputs))
            expected = float(_formula(t, loss_type, logp, logp if old_logp is None else old_logp,
                                      ref if beta else None, out["advantages"].float(), mask, out, beta))
            self.report.add("loss", f"TRL's {loss_type} loss {label} equals its formula",
                            math.isclose(got, expected, rel_tol=1e-3, abs_tol=2e-4), f"{got:.6g} against {expected:.6g}",
                            "the loss differs from the formula of loss_type (clipping, aggregation, the KL term's "
                            "sign or the mask)")
        if beta:
            kl = _k3(ref, logp)
            self.report.add("loss", "KL >= 0, and 0 at the reference", bool((kl >= -1e-6).all()) and
                            float(_k3(logp, logp).abs().max()) < 1e-6, f"min {float(kl.min()):.3g}",
                            "the k3 estimator exp(ref - logp) - (ref - logp) - 1 is never negative")

    # ---- direction ----------------------------------------------------------------------------

    def direction(self) -> None:
        t, out = self.trainer, self.out
        model = t.model  # stepped and put back (TRL patches its forward in place, so a copy would not run alone)
        model.train()
        adv = out["advantages"].float().view(-1, self.G)
        spread = (adv.max(1).values - adv.min(1).values) > 1e-6
        if not spread.any():
            self.report.add("direction", "one step raises the best completion", False, "all advantages equal",
                            "no completion stands out, so the direction is not checked", warn_only=True)
            return
        offset = torch.arange(adv.shape[0]) * self.G  # each group's best and worst, as rows of the batch
        best, worst = (adv.argmax(1) + offset)[spread], (adv.argmin(1) + offset)[spread]
        before = self._sequence_logp(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        saved = [(p.detach().clone(), p.grad) for p in trainable]
        t.current_gradient_accumulation_steps = 1
        try:
            for p in trainable:
                p.grad = None
            t._compute_loss(model, dict(out)).backward()
            with torch.no_grad():
                for p in trainable:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-0.05)  # one plain gradient step
            moved = self._sequence_logp(model) - before
        finally:
            with torch.no_grad():
                for p, (value, grad) in zip(trainable, saved):
                    p.copy_(value)
                    p.grad = grad
        # Each completion moves by its own advantage and by what it shares with the others (the EOS token,
        # a common opening), so the worst may rise a little too; against the best of its group it must fall.
        gap = moved[best] - moved[worst]
        self.report.add("direction", "one small step raises the best completion of each group against its worst",
                        bool((gap > 0).all()), f"best {_short(moved[best].tolist())}, worst "
                        f"{_short(moved[worst].tolist())} (change of the sequence log-prob)",
                        "the update moves the wrong way: a sign in the advantages or the loss")

    def _sequence_logp(self, model) -> torch.Tensor:
        out = self.out
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        K = out["completion_ids"].shape[1]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits[:, -K - 1:-1].float() / self.trainer.temperature
            logp = torch.log_softmax(logits, -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)
        return (logp * out["completion_mask"].float()).sum(1)



def _formula(t, loss_type: str, logp, old, ref, adv, mask, out, beta: float) -> torch.Tensor:
    """TRL's loss of ``loss_type`` written out: covey verify's token loss of that objective
    (``covey.verify.formulas``) with TRL's settings, aggregated as TRL aggregates it."""
    args = t.args

    def field(name):  # a setting of TRL's config; None where this TRL has none (nor the loss type that reads it)
        return getattr(args, name, None)

    bonus = core.EntropyBonus(coef=0.0, adaptive=False, target=0.0, delta=0.0, coef_min=0.0, coef_max=0.0)
    settings = core.LossSettings(
        loss_type=loss_type, epsilon_low=float(getattr(t, "epsilon_low", args.epsilon)),
        epsilon_high=float(getattr(t, "epsilon_high", args.epsilon_high or args.epsilon)), delta=field("delta"),
        clip_ratio_c=None, importance_sampling_level=field("importance_sampling_level") or "token", beta=beta,
        kl_estimator="k3", use_bias_correction_kl=bool(field("use_bias_correction_kl")), top_entropy_quantile=1.0,
        sapo_temperature_pos=field("sapo_temperature_pos"), sapo_temperature_neg=field("sapo_temperature_neg"),
        vespo_k_pos=field("vespo_k_pos"), vespo_lambda_pos=field("vespo_lambda_pos"), vespo_k_neg=field("vespo_k_neg"),
        vespo_lambda_neg=field("vespo_lambda_neg"), off_policy_mask_threshold=getattr(t, "off_policy_mask_threshold", None),
        entropy_bonus=bonus, router_aux_loss_coef=0.0)
    per_token = formula_token_loss(settings, logp, old, adv, mask, ref)
    return TRL_AGGREGATIONS[loss_type](per_token, mask.double(), t, out)


def _window(t, out) -> float:
    """TRL's token normaliser of one accumulation window: the generation batch's completion tokens, per
    process and per step of the generation."""
    return float(out["num_items_in_batch"].clamp(min=1)) / t.accelerator.num_processes / t.args.steps_per_generation


# How TRL turns token losses into the loss of each loss type of covey's registry (core.LOSS_TYPES): the
# loss of one micro-batch that is the whole accumulation window.
TRL_AGGREGATIONS = {
    "grpo": lambda loss, mask, t, out: ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean(),
    "bnpo": lambda loss, mask, t, out: (loss * mask).sum() / mask.sum().clamp(min=1),
    "dr_grpo": lambda loss, mask, t, out: (loss * mask).sum() / (mask.shape[0] * t.max_completion_length),
    "dapo": lambda loss, mask, t, out: (loss * mask).sum() / _window(t, out),
    "cispo": lambda loss, mask, t, out: (loss * mask).sum() / _window(t, out),
    "sapo": lambda loss, mask, t, out: ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean(),
    "vespo": lambda loss, mask, t, out: (loss * mask).sum() / _window(t, out),
    "luspo": lambda loss, mask, t, out: (loss * mask).sum(1).mean(),
}


def _k3(ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    return torch.exp(ref - logp) - (ref - logp) - 1
