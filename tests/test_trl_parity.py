"""covey's loss against TRL's own loss code, fed identical tensors (float32, rel. error < 1e-6).

TRL's ``GRPOTrainer._compute_loss`` is called unbound on a stand-in object that carries only the
attributes it reads, with the model forward replaced by the log-probs under test. Where covey
deliberately differs from TRL, the test states the mapping and checks it.
"""

import types
from collections import defaultdict

import pytest
import torch

from covey.core import BatchCounts, EntropyBonus, off_policy_mask, policy_loss
from tests.conftest import loss_settings

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl is a dev dependency: pip install -e .[dev]")
TOL = 1e-6


class _Accelerator:
    num_processes = 1
    sync_gradients = True  # the micro-batch that ends an optimizer step

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_trainer(loss_type, eps_low, eps_high, beta=0.0, delta=None, level="token", top_entropy_quantile=1.0,
                max_completion_length=8, bias_correction_kl=False, off_policy_mask_threshold=None, engine_ratio=False,
                entropy_coef=0.0, use_adaptive_entropy=False, accumulation_steps=1, **args):
    """A stand-in for TRL's GRPOTrainer with the attributes its loss reads; ``args``: more of TRL's
    GRPOConfig fields (sapo_temperature_pos, vespo_k_pos, entropy_target, ...)."""
    fake = types.SimpleNamespace(
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta, importance_sampling_level=level,
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=off_policy_mask_threshold,
        use_vllm=engine_ratio, vllm_importance_sampling_correction=engine_ratio, aux_loss_enabled=False,
        entropy_coef=entropy_coef, use_adaptive_entropy=use_adaptive_entropy,
        _entropy_bonus_enabled=entropy_coef != 0.0 or use_adaptive_entropy, _last_world_entropy=float("inf"),
        _entropy_window_stats=None, current_gradient_accumulation_steps=accumulation_steps,
        max_completion_length=max_completion_length, model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        args=types.SimpleNamespace(delta=delta, use_bias_correction_kl=bias_correction_kl, steps_per_generation=1,
                                   **args),
        _metrics=defaultdict(lambda: defaultdict(list)))
    fake.get_high_entropy_mask = types.MethodType(trl_grpo.GRPOTrainer.get_high_entropy_mask, fake)
    fake.get_off_policy_mask = trl_grpo.GRPOTrainer.get_off_policy_mask  # static methods
    fake.get_gamma_weights = trl_grpo.GRPOTrainer.get_gamma_weights
    return fake


def trl_micro_batch_loss(fake, logp, old, ref, adv, mask, entropy=None, sampling=None, engine_weights=None,
                         num_items_in_batch=None):
    """TRL's ``_compute_loss`` of one micro-batch, the model forward replaced by the log-probs under test."""
    ent = entropy if entropy is not None else torch.zeros_like(logp)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ent, None)
    B, T = logp.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum().float() if num_items_in_batch is None else num_items_in_batch}
    if sampling is not None:
        inputs["sampling_per_token_logps"] = sampling
    if engine_weights is not None:
        inputs["importance_sampling_ratio"] = engine_weights
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)


def trl_loss(logp, old, ref, adv, mask, entropy=None, sampling=None, engine_weights=None, **settings):
    return trl_micro_batch_loss(trl_trainer(**settings), logp, old, ref, adv, mask, entropy, sampling, engine_weights)


def make(B=8, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logp, old, ref, adv, mask


def rel(a, b):
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-12))


def compare(covey_settings, trl_kwargs, seed=0, entropy=None, sampling=None, engine_weights=None, entropy_coef=0.0):
    """covey's and TRL's loss on the same tensors, and their gradients in the log-probs (and the
    entropy, where it has a gradient)."""
    logp, old, ref, adv, mask = make(seed=seed)
    counts = BatchCounts(sequences=8, tokens=float(mask.sum()), micro_batches=1, max_completion_length=8)
    ours, _ = policy_loss(logp, old, adv, mask, counts, covey_settings, ref if covey_settings.beta else None,
                          entropy_BT=entropy, engine_weights=engine_weights,
                          behaviour_logp_BT=old if sampling is None else sampling, entropy_coef=entropy_coef)
    wrt = [logp] + ([entropy] if entropy is not None and entropy.requires_grad else [])
    our_grads = torch.autograd.grad(ours, wrt)
    theirs = trl_loss(logp, old, ref, adv, mask, entropy=entropy, sampling=sampling, engine_weights=engine_weights,
                      **trl_kwargs)
    their_grads = torch.autograd.grad(theirs, wrt)
    assert rel(ours, theirs) < TOL, (ours.item(), theirs.item())
    for our_grad, their_grad in zip(our_grads, their_grads):
        assert rel(our_grad, their_grad) < TOL


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_clipped_losses_match_trl(loss_type, beta):
    compare(loss_settings(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta),
            dict(loss_type=loss_type, eps_low=0.2, eps_high=0.28, beta=beta))


def test_luspo_matches_trl():
    """LUSPO (arXiv:2602.05261): GSPO's sequence ratio, each sequence's loss times its length."""
    compare(loss_settings(loss_type="luspo", epsilon_low=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence"),
            dict(loss_type="luspo", eps_low=3e-4, eps_high=4e-4, level="sequence"))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gspo_sequence_level_matches_trl(loss_type):
    compare(loss_settings(loss_type=loss_type, epsilon_low=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence"),
            dict(loss_type=loss_type, eps_low=3e-4, eps_high=4e-4, level="sequence"))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_matches_trl(level):
    """TRL multiplies the KL term by the importance ratio by default, and so does covey (use_bias_correction_kl).
    At sequence level the weight is the sequence's ratio, its gradient reaching every token."""
    compare(loss_settings(loss_type="grpo", beta=0.1, use_bias_correction_kl=True, importance_sampling_level=level),
            dict(loss_type="grpo", eps_low=0.2, eps_high=0.2, beta=0.1, bias_correction_kl=True, level=level))


def test_two_sided_delta_matches_trl():
    compare(loss_settings(loss_type="dapo", delta=1.4), dict(loss_type="dapo", eps_low=0.2, eps_high=0.2, delta=1.4))


def test_top_entropy_quantile_matches_trl():
    entropy = torch.rand(8, 6, generator=torch.Generator().manual_seed(1))
    compare(loss_settings(loss_type="dapo", top_entropy_quantile=0.2),
            dict(loss_type="dapo", eps_low=0.2, eps_high=0.2, top_entropy_quantile=0.2), entropy=entropy)


@pytest.mark.parametrize("cap", [1.05, 5.0])
def test_cispo_matches_trl_with_the_same_epsilon_high(cap):
    """A TRL config means in covey what it means in TRL: the CISPO weight is capped at epsilon_high
    itself (MiniMax-M1's 1 + eps_high^IS): a TRL CISPO config (epsilon_high: 5.0) trains as in TRL."""
    compare(loss_settings(loss_type="cispo", epsilon_high=cap), dict(loss_type="cispo", eps_low=0.2, eps_high=cap))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("temperatures", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_matches_trl(level, temperatures):
    pos, neg = temperatures
    compare(loss_settings(loss_type="sapo", sapo_temperature_pos=pos, sapo_temperature_neg=neg, importance_sampling_level=level),
            dict(loss_type="sapo", eps_low=0.2, eps_high=0.2, level=level, sapo_temperature_pos=pos,
                 sapo_temperature_neg=neg))


def test_sapo_with_kl_and_engine_weights_matches_trl():
    weights = torch.exp(0.1 * torch.randn(8, 1, generator=torch.Generator().manual_seed(2)))
    compare(loss_settings(loss_type="sapo", beta=0.05, use_bias_correction_kl=True),
            dict(loss_type="sapo", eps_low=0.2, eps_high=0.2, beta=0.05, bias_correction_kl=True, engine_ratio=True,
                 sapo_temperature_pos=1.0, sapo_temperature_neg=1.05), engine_weights=weights)


VESPO_DEFAULTS = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)


@pytest.mark.parametrize("params", [VESPO_DEFAULTS, dict(vespo_k_pos=0.5, vespo_lambda_pos=0.0, vespo_k_neg=6.0,
                                                          vespo_lambda_neg=1.0)])
@pytest.mark.parametrize("seed", [0, 3])
def test_vespo_matches_trl(params, seed):
    compare(loss_settings(loss_type="vespo", **params), dict(loss_type="vespo", eps_low=0.2, eps_high=0.2, **params),
            seed=seed)


@pytest.mark.parametrize("truncated", [True, False])
def test_vespo_folds_the_engine_weights_into_its_weight_as_trl(truncated):
    """TRL's VESPO takes the token-level importance_sampling_ratio into its sequence weight, and does not
    multiply the loss by it; mask mode's zeros become its floor of 1e-8."""
    weights = torch.exp(0.2 * torch.randn(8, 6, generator=torch.Generator().manual_seed(4)))
    _, _, _, _, mask = make()
    weights = weights.masked_fill(mask == 0, 1.0)  # padding: ratio 1, as both compute it
    if not truncated:
        weights[0, 0] = 0.0
    compare(loss_settings(loss_type="vespo", beta=0.02), dict(loss_type="vespo", eps_low=0.2, eps_high=0.2, beta=0.02,
                                                             engine_ratio=True, **VESPO_DEFAULTS),
            engine_weights=weights)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "sapo", "cispo"])
@pytest.mark.parametrize("from_engine", [True, False])
def test_off_policy_mask_matches_trl(loss_type, from_engine):
    """TRL measures drift from the engine's sampling log-probs where it has them (vLLM), else from the
    old policy's; covey hands the loss whichever applies as behaviour_logp_BT."""
    logp, old, _, adv, mask = make()
    sampling = old + 0.8 * torch.rand(old.shape, generator=torch.Generator().manual_seed(5)) if from_engine else None
    threshold = 0.8 if from_engine else 0.1
    kept = off_policy_mask(logp, old if sampling is None else sampling, adv[:, None], mask.float(), threshold)
    assert 0 < int((kept == 0).sum()) < int((adv < 0).sum())  # some negative sequences dropped, not all
    extra = dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05) if loss_type == "sapo" else {}
    eps_high = 5.0 if loss_type == "cispo" else 0.2
    compare(loss_settings(loss_type=loss_type, epsilon_high=eps_high, off_policy_mask_threshold=threshold),
            dict(loss_type=loss_type, eps_low=0.2, eps_high=eps_high, off_policy_mask_threshold=threshold, **extra),
            sampling=sampling)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo"])
@pytest.mark.parametrize("top_entropy_quantile", [1.0, 0.4])
def test_entropy_bonus_matches_trl(loss_type, top_entropy_quantile):
    entropy = (3 * torch.rand(8, 6, generator=torch.Generator().manual_seed(6))).requires_grad_(True)
    extra = dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05) if loss_type == "sapo" else {}
    compare(loss_settings(loss_type=loss_type, top_entropy_quantile=top_entropy_quantile,
                         entropy_bonus=EntropyBonus(coef=0.2)),
            dict(loss_type=loss_type, eps_low=0.2, eps_high=0.2, top_entropy_quantile=top_entropy_quantile,
                 entropy_coef=0.2, **extra), entropy=entropy, entropy_coef=0.2)


def test_adaptive_entropy_control_matches_trl_over_steps_of_two_micro_batches():
    """TRL's controller over six optimizer steps of two micro-batches: the coefficient each step applies,
    the loss and gradient of every micro-batch, and the coefficient after each step."""
    control = dict(entropy_target=1.2, entropy_coef_delta=0.05, entropy_coef_min=0.0, entropy_coef_max=0.12)
    fake = trl_trainer("grpo", 0.2, 0.2, entropy_coef=0.03, use_adaptive_entropy=True, accumulation_steps=2, **control)
    bonus = EntropyBonus(coef=0.03, adaptive=True, target=1.2, delta=0.05, coef_min=0.0, coef_max=0.12)
    settings = loss_settings(loss_type="grpo", entropy_bonus=bonus)
    coef, last_entropy, seen = 0.03, None, set()
    for step in range(6):
        applied = bonus.applied(coef, last_entropy)
        window_entropy = window_tokens = 0.0
        for micro in range(2):
            logp, old, ref, adv, mask = make(seed=10 * step + micro)
            scale = 0.6 if step in (0, 1, 4) else 2.0  # entropy below the target on some steps, above on others
            entropy = (scale * torch.rand(8, 6, generator=torch.Generator().manual_seed(step))).requires_grad_(True)
            counts = BatchCounts(sequences=16, tokens=float(mask.sum()), micro_batches=2, max_completion_length=8)
            ours, stats = policy_loss(logp, old, adv, mask, counts, settings, entropy_BT=entropy, entropy_coef=applied)
            fake.accelerator.sync_gradients = micro == 1
            theirs = trl_micro_batch_loss(fake, logp, old, ref, adv, mask, entropy)
            assert rel(ours, theirs) < TOL
            for a, b in zip(torch.autograd.grad(ours, [logp, entropy]), torch.autograd.grad(theirs, [logp, entropy])):
                assert rel(a, b) < TOL
            window_entropy += float(stats.entropy_bonus_sum)
            window_tokens += float(stats.entropy_bonus_tokens)
        last_entropy = window_entropy / window_tokens
        coef = bonus.moved(coef, last_entropy)
        seen.add(applied > 0)
        assert coef == pytest.approx(fake.entropy_coef, abs=1e-12)
        assert fake._metrics["train"]["entropy_coef"][-1] == pytest.approx(coef, abs=1e-12)
    assert seen == {True, False}  # steps with and without the bonus applied
