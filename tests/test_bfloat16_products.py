"""On a CPU where torch multiplies bfloat16 in software, covey computes bfloat16's products in float32 from
the same bfloat16 operands (``models.Float32Products``; the fast engine's ``prepacked_linear``): the
numbers of torch's own bfloat16 products, which sum in float32 too, but for the order of the sums.

Tolerances: a product's elements within one bfloat16 unit in the last place of torch's (almost all equal)
and of the float32 result of the same bfloat16 values (a convolution's gradients, which torch sums partly
in bfloat16, nearer that float32 result than torch's);
a training pass's log-probs within 2e-2 and its gradients within 2e-2 of the largest entry, as for the other
bfloat16 comparisons (tests/test_chunked_logprobs.py), since a 1-unit difference in one product moves
everything after it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import covey.models.device as device_module
import covey.rollout.fast.decoder as decoder_module
from covey import GRPOTrainer
from covey.models import Float32Products, autocast, float32_products
from covey.train.forward import SequenceBatch, completion_logprobs
from tests.conftest import make_model

CPU = torch.device("cpu")


@pytest.fixture
def computed(monkeypatch):
    """The products ``Float32Products`` computed in float32, each as (op, grad enabled, in a backward)."""
    seen = []
    in_float32 = device_module.in_float32

    def spy(func, args, kwargs):
        seen.append((func, torch.is_grad_enabled(), torch._C._current_graph_task_id() != -1))
        return in_float32(func, args, kwargs)
    monkeypatch.setattr(device_module, "in_float32", spy)
    return seen


def products_in_software(monkeypatch, value: bool) -> None:
    """Whether covey takes this CPU for one that multiplies bfloat16 in software (whatever it is)."""
    for module in (device_module, decoder_module):
        monkeypatch.setattr(module, "bfloat16_products_in_software", lambda device: value and device.type == "cpu")


def within_one_unit(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    unit = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp(min=1e-30))) - 7)  # bfloat16's 8-bit significand
    assert ((got.float() - want.float()).abs() <= unit).all()
    assert (got == want).float().mean() > 0.99


def _products():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).bfloat16()
    a, b, bias = r(24, 300), r(300, 40), r(40)
    image, kernel = r(2, 3, 12, 12), r(5, 3, 3, 3)
    return {"mm": (torch.mm, (a, b)), "addmm": (torch.addmm, (bias, a, b)), "mv": (torch.mv, (a, b[:, 0])),
            "bmm": (torch.bmm, (a.view(4, 6, 300), b.expand(4, 300, 40))),
            "baddbmm": (torch.baddbmm, (bias.expand(4, 6, 40), a.view(4, 6, 300), b.expand(4, 300, 40))),
            "linear": (F.linear, (a, b.T, bias)), "conv2d": (F.conv2d, (image, kernel, bias[:5]))}


@pytest.mark.parametrize("name", list(_products()))
def test_each_product_and_its_gradients_are_torch_bfloat16_ones_computed_in_float32(name, computed):
    """Each result within one unit of torch's bfloat16 one, and of the float32 result of the same bfloat16
    values; but a convolution's gradients, which torch sums partly in bfloat16 (several units off the float32
    result here): covey's are nearer the float32 result than torch's."""
    op, args = _products()[name]

    def product_and_gradients(dtype=torch.bfloat16):
        inputs = [a.detach().to(dtype).requires_grad_() for a in args]
        out = op(*inputs)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).bfloat16().to(dtype))
        return [out.detach()] + [a.grad for a in inputs]

    want, exact = product_and_gradients(), product_and_gradients(torch.float32)
    assert computed == []
    with Float32Products():
        got = product_and_gradients()
    assert len(computed) >= 2  # the forward's product and the backward's, by covey (not torch's bfloat16 ones)
    for i, (g, w, e) in enumerate(zip(got, want, exact)):
        within_one_unit(g, e.bfloat16())
        if name == "conv2d" and i > 0:
            assert (g.float() - e).abs().max() <= (w.float() - e).abs().max()
        else:
            within_one_unit(g, w)


@pytest.mark.parametrize("shape", [(300, 24, 16), (24, 300, 16), (16, 24, 300)], ids=["rows", "summed", "columns"])
def test_a_large_product_is_computed_a_block_at_a_time_with_the_same_numbers(shape, monkeypatch, computed):
    """Past BLOCK_VALUES a product (N x K times K x M) is widened and computed a block at a time along its
    largest dimension: the numbers of torch's bfloat16 product, with addmm's bias, beta and alpha."""
    monkeypatch.setattr(device_module, "BLOCK_VALUES", 500)
    N, K, M = shape
    g = torch.Generator().manual_seed(3)
    a, b, bias = (torch.randn(*s, generator=g).bfloat16() for s in ((N, K), (K, M), (M,)))
    blocks = []
    float_ = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: blocks.append(t.numel()) or float_(t))
    with Float32Products():
        got = [torch.mm(a, b), torch.addmm(bias, a, b, beta=0.5, alpha=2.0), F.linear(a, b.T, bias)]
    assert max(blocks) < max(a.numel(), b.numel())  # the largest operand never widened whole
    monkeypatch.setattr(torch.Tensor, "float", float_)
    for g_, w in zip(got, [torch.mm(a, b), torch.addmm(bias, a, b, beta=0.5, alpha=2.0), F.linear(a, b.T, bias)]):
        within_one_unit(g_, w)


def test_float32_products_leave_every_other_operation_alone(computed):
    a = torch.randn(8, 8)
    with Float32Products():
        assert torch.equal(a @ a, torch.mm(a, a))  # float32 is not touched
        assert (a.bfloat16() + 1).dtype == torch.bfloat16
    assert computed == []


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_training_pass_computes_its_products_in_float32_and_gets_bfloat16s_numbers(monkeypatch, computed,
                                                                                      checkpointed):
    """The forward under covey's autocast, and the backward under ``float32_products`` as the trainer runs it
    (with gradient checkpointing the recomputed forward too): the log-probs and gradients of torch's own
    bfloat16 products."""
    model = make_model(40, seed=3, layers=2).train()
    if checkpointed:
        model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(1)
    batch = SequenceBatch(torch.randint(4, 40, (1, 5), generator=g).expand(3, 5), torch.ones(3, 5, dtype=torch.long),
                          torch.randint(4, 40, (3, 7), generator=g), torch.ones(3, 7, dtype=torch.long))

    def pass_(in_software: bool):
        products_in_software(monkeypatch, in_software)
        model.zero_grad()
        with autocast(CPU, True):
            logp, _ = completion_logprobs(model, batch, 0.9, with_entropy=False)
        forward = len(computed)
        with float32_products(CPU, True):
            logp.sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, forward

    want, want_grads, _ = pass_(False)
    assert computed == []  # torch's own bfloat16 products
    got, got_grads, forward = pass_(True)
    assert forward > 0 and len(computed) > 2 * forward  # the backward's two products of each forward one
    assert (got - want).abs().max() < 2e-2
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).abs().max() <= 2e-2 * grad.abs().max(), name


def test_the_fast_engine_multiplies_bfloat16_as_float32_copies_of_its_matrices(monkeypatch):
    """Where oneDNN has no bfloat16 linear, the lean decoder's bfloat16 matrices are float32 copies of their
    bfloat16 values, multiplied by oneDNN's float32 linear: the numbers of torch's bfloat16 F.linear."""
    real = decoder_module.onednn_linear
    monkeypatch.setattr(decoder_module, "onednn_linear", lambda dtype: None if dtype == torch.bfloat16 else real(dtype))
    products_in_software(monkeypatch, True)
    if real(torch.float32) is None:
        pytest.skip("this torch build has no oneDNN linear")
    pack, linear = decoder_module.prepacked_linear(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x, weight, bias = (torch.randn(*shape, generator=g) for shape in ((2, 5, 96), (64, 96), (64,)))
    x = x.bfloat16()
    within_one_unit(linear(x, pack(weight), bias.bfloat16()), F.linear(x, weight.bfloat16(), bias.bfloat16()))
    products_in_software(monkeypatch, False)
    assert decoder_module.prepacked_linear(torch.bfloat16) is None  # torch's own, where it has them


def test_a_bfloat16_run_takes_float32_products_in_every_pass(tmp_path, tokenizer, monkeypatch, computed):
    """A bf16 run with a reference model on such a CPU: the no-grad log-prob passes, the training forward and
    its backward all compute their products in float32, and the run trains as with torch's products."""
    from tests.test_trainer import ROWS, count_a, small_args

    def run(in_software: bool, name: str) -> list[dict]:
        products_in_software(monkeypatch, in_software)
        args = small_args(tmp_path / name, bf16=True, beta=0.1, max_steps=1, rollout_engine="hf", use_cpu=True)
        GRPOTrainer(model=make_model(len(tokenizer), seed=4), reward_funcs=[count_a], train_dataset=ROWS,
                    processing_class=tokenizer, args=args, quiet=True).train()
        with open(tmp_path / name / "run" / "metrics.jsonl") as f:
            return [json.loads(line) for line in f]

    want = run(False, "torch")
    assert computed == []
    got = run(True, "covey")
    passes = {(grad, backward) for _, grad, backward in computed}
    # sampling and the reference's pass (no grad), the training forward, its backward
    assert passes == {(False, False), (True, False), (False, True)}
    assert got[0]["completions/mean_length"] == want[0]["completions/mean_length"]
    assert abs(got[0]["kl"] - want[0]["kl"]) < 1e-2 and abs(got[0]["loss"] - want[0]["loss"]) < 1e-2
