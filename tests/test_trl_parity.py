"""covey's loss against TRL's own loss code, fed identical tensors (float32, rel. error < 1e-6).

TRL's ``GRPOTrainer._compute_loss`` is called unbound on a stand-in object that carries only the
attributes it reads, with the model forward replaced by the log-probs under test. Where covey
deliberately differs from TRL, the test states the mapping and checks it.
"""

import types
from collections import defaultdict

import pytest
import torch

from covey.core import BatchCounts, LossSettings, policy_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl is a dev dependency: pip install -e .[dev]")
TOL = 1e-6


class _Accelerator:
    num_processes = 1

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_loss(logp, old, ref, adv, mask, loss_type, eps_low, eps_high, beta=0.0, delta=None, level="token",
             top_entropy_quantile=1.0, entropy=None, max_completion_length=8, bias_correction_kl=False):
    fake = types.SimpleNamespace(
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta, importance_sampling_level=level,
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, max_completion_length=max_completion_length,
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
        args=types.SimpleNamespace(delta=delta, use_bias_correction_kl=bias_correction_kl, steps_per_generation=1),
        _metrics=defaultdict(lambda: defaultdict(list)))
    ent = entropy if entropy is not None else torch.zeros_like(logp)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ent, None)
    fake.get_high_entropy_mask = types.MethodType(trl_grpo.GRPOTrainer.get_high_entropy_mask, fake)
    B, T = logp.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum().float()}
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)


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


def compare(covey_settings, trl_kwargs, seed=0, entropy=None):
    logp, old, ref, adv, mask = make(seed=seed)
    counts = BatchCounts(sequences=8, tokens=float(mask.sum()), micro_batches=1, max_completion_length=8)
    ours, _ = policy_loss(logp, old, adv, mask, counts, covey_settings, ref if covey_settings.beta else None,
                          entropy_BT=entropy)
    our_grad, = torch.autograd.grad(ours, logp)
    theirs = trl_loss(logp, old, ref, adv, mask, entropy=entropy, **trl_kwargs)
    their_grad, = torch.autograd.grad(theirs, logp)
    assert rel(ours, theirs) < TOL, (ours.item(), theirs.item())
    assert rel(our_grad, their_grad) < TOL


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_clipped_losses_match_trl(loss_type, beta):
    compare(LossSettings(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta),
            dict(loss_type=loss_type, eps_low=0.2, eps_high=0.28, beta=beta))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gspo_sequence_level_matches_trl(loss_type):
    compare(LossSettings(loss_type=loss_type, epsilon_low=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence"),
            dict(loss_type=loss_type, eps_low=3e-4, eps_high=4e-4, level="sequence"))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_matches_trl(level):
    """TRL multiplies the KL term by the importance ratio by default; covey does so only when asked.
    At sequence level the weight is the sequence's ratio, its gradient reaching every token."""
    compare(LossSettings(loss_type="grpo", beta=0.1, use_bias_correction_kl=True, importance_sampling_level=level),
            dict(loss_type="grpo", eps_low=0.2, eps_high=0.2, beta=0.1, bias_correction_kl=True, level=level))


def test_two_sided_delta_matches_trl():
    compare(LossSettings(loss_type="dapo", delta=1.4), dict(loss_type="dapo", eps_low=0.2, eps_high=0.2, delta=1.4))


def test_top_entropy_quantile_matches_trl():
    entropy = torch.rand(8, 6, generator=torch.Generator().manual_seed(1))
    compare(LossSettings(loss_type="dapo", top_entropy_quantile=0.2),
            dict(loss_type="dapo", eps_low=0.2, eps_high=0.2, top_entropy_quantile=0.2), entropy=entropy)


@pytest.mark.parametrize("cap", [1.05, 5.0])
def test_cispo_matches_trl_with_the_same_epsilon_high(cap):
    """A TRL config means in covey what it means in TRL: the CISPO weight is capped at epsilon_high
    itself (MiniMax-M1's 1 + eps_high^IS): a TRL CISPO config (epsilon_high: 5.0) trains as in TRL."""
    compare(LossSettings(loss_type="cispo", epsilon_high=cap), dict(loss_type="cispo", eps_low=0.2, eps_high=cap))
