"""covey plan: the estimate's arithmetic on known shapes, the advice, the command, and covey train's check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from covey.cli import main
from covey.config import DEMO, GRPOConfig
from covey.plan import Device, estimate, make_plan, model_config, replan
from covey.plan.advice import advice
from covey.plan.memory import (Settings, activation_bytes, layer_bytes_per_token, lora_trainable, logprob_pass_bytes,
                                training_pass_bytes, weights_bytes)
from covey.plan.shapes import dense_shape, meta_shape, model_shape


def _config(model_type: str, tied: bool, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, **extra)


ARCHITECTURES = [("llama", True, {}), ("llama", False, {"attention_bias": True, "mlp_bias": True}),
                 ("qwen2", True, {}), ("qwen3", False, {"head_dim": 32}), ("mistral", False, {})]


@pytest.mark.parametrize("model_type,tied,extra", ARCHITECTURES)
def test_weights_are_the_parameters_of_the_model_built_from_the_config(model_type, tied, extra):
    from transformers import AutoModelForCausalLM

    config = _config(model_type, tied, **extra)
    model = AutoModelForCausalLM.from_config(config)
    numel = sum(p.numel() for p in model.parameters())
    shape = dense_shape(config)
    assert shape.params == numel
    linears = [m for name, m in model.get_decoder().layers[0].named_modules() if isinstance(m, torch.nn.Linear)]
    assert shape.layer_linear_params == sum(sum(p.numel() for p in m.parameters()) for m in linears)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        settings = Settings(micro_batch=4, generation_rows=4, num_generations=2, prompt_length=8,
                            completion_length=8, weight_bytes=size)
        held = sum(p.numel() * p.element_size() for p in model.to(dtype).parameters())
        assert weights_bytes(shape, settings) == held


def test_other_architectures_are_counted_on_the_meta_device():
    from transformers import AutoModelForCausalLM

    config = _config("gemma", True, head_dim=16)
    assert model_shape(config).counted_on_meta
    assert meta_shape(config).params == sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_lora_parameters_are_what_peft_trains():
    from transformers import AutoModelForCausalLM

    from covey.models import add_lora

    config = _config("qwen2", True)
    shape = dense_shape(config)
    for targets, r in ((("q_proj", "v_proj"), 4), (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"), 8)):
        policy = add_lora(AutoModelForCausalLM.from_config(config), r=r, alpha=2 * r, dropout=0.0,
                          target_modules=list(targets))
        trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        settings = Settings(micro_batch=4, generation_rows=4, num_generations=2, prompt_length=8, completion_length=8,
                            lora_targets=targets, lora_r=r)
        assert lora_trainable(shape, settings) == trained


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


QV = ("q_proj", "v_proj")


@pytest.mark.parametrize("bf16,lora", [(False, None), (True, None), (False, (QV, 0.05)), (True, (QV, 0.0)),
                                       (True, (ALL_LINEAR, 0.0)), (False, (ALL_LINEAR, 0.05))],
                         ids=["full", "full-bf16", "lora-qv-dropout", "lora-qv-bf16", "lora-all-bf16",
                              "lora-all-dropout"])
def test_activations_per_token_are_what_autograd_saves(bf16, lora):
    """The per-layer, per-token activation bytes against the tensors a Llama layer saves for its backward
    (parameters and autocast's weight copies left out), measured as the difference of 2 and 3 layers
    and of 96 and 192 tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from covey.models import add_lora

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=1, attn_implementation="sdpa")

    def saved(layers: int, tokens: int) -> int:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": layers}))
        if lora:
            model = add_lora(model, r=8, alpha=16, dropout=lora[1], target_modules=list(lora[0]))
        model.train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def keep(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=torch.randint(0, 300, (1, tokens)))
        return sum(storages.values())

    def per_layer(tokens):  # the first layer's input needs no gradient under LoRA: the second layer's
        return saved(3, tokens) - saved(2, tokens)

    measured = (per_layer(192) - per_layer(96)) / 96
    settings = Settings(micro_batch=1, generation_rows=1, num_generations=2, prompt_length=1, completion_length=1,
                        bf16_autocast=bf16, lora_targets=lora and lora[0], lora_r=8,
                        lora_dropout=bool(lora and lora[1]))
    assert layer_bytes_per_token(dense_shape(config), settings) == pytest.approx(measured, rel=0.03)


def test_the_chunked_logprob_pass_does_not_grow_with_the_completions():
    shape = dense_shape(_config("llama", True))
    short, long = (Settings(micro_batch=8, generation_rows=8, num_generations=4, prompt_length=16, completion_length=T,
                            logprob_chunk=128) for T in (256, 4096))
    assert logprob_pass_bytes(shape, short) == logprob_pass_bytes(shape, long)
    whole = dataclasses.replace(long, logprob_chunk=None)  # every logit at once: N x V, and its gradient
    assert logprob_pass_bytes(shape, whole) == 2 * 8 * 4096 * shape.vocab * 4


def _allocated_at_most(work) -> int:
    """The most bytes ``work`` holds at once of what it allocates, from the profiler's record of every CPU
    allocation and free, in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = most = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        most = max(most, live)
    return most


@pytest.mark.parametrize("accumulating", [False, True], ids=["first-micro-batch", "accumulating"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_backward_ends_with_the_embedding_gradient_beside_the_others(tied, accumulating):
    """The training pass's peak where the embedding's dense gradient decides it (a large vocabulary, few
    tokens): what the pass allocates at once, plus the gradients an earlier micro-batch left, against
    ``training_pass_bytes``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from covey.core import logprob_chunk_tokens
    from covey.train.head import head_logprobs

    config = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    P, T = 2, 2
    ids = torch.randint(0, config.vocab_size, (1, P + T))

    def training_pass():
        hidden = model.model(input_ids=ids).last_hidden_state[:, P - 1:-1].reshape(-1, config.hidden_size)
        logp, _ = head_logprobs(model, hidden, ids[:, P:].reshape(-1))
        (-logp.mean()).backward()

    if accumulating:
        training_pass()  # an earlier micro-batch of the step
    held = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    measured = held + _allocated_at_most(training_pass)
    shape = dense_shape(config)
    settings = Settings(micro_batch=1, generation_rows=1, num_generations=2, prompt_length=P, completion_length=T,
                        logprob_chunk=logprob_chunk_tokens(shape.vocab), accumulating=accumulating)
    estimated = training_pass_bytes(shape, settings, activation_bytes(shape, settings), logprob_pass_bytes(shape, settings))
    assert estimated == pytest.approx(measured, rel=0.1)


@pytest.mark.parametrize("head, budget_mib", [("trained", 128), ("frozen", 128), ("trained", 512)])
def test_the_logprob_pass_allocates_what_the_plan_counts(head, budget_mib):
    """The log-prob pass alone, forward and backward over two chunks (the last kept from the forward, the
    first computed again; a frozen head, as under LoRA, keeps per-token slopes instead), against
    ``logprob_pass_bytes``; the head weight's own gradient is counted with the gradients, not here. A budget
    above the default makes larger chunks, not larger working copies."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from covey.core import logprob_chunk_tokens
    from covey.train.head import head_logprobs

    config = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.lm_head.weight.requires_grad_(head == "trained")
    shape = dense_shape(config)
    chunk = logprob_chunk_tokens(shape.vocab, budget_mib * 2**20)
    N = chunk + chunk // 2
    hidden = torch.randn(N, config.hidden_size, requires_grad=True)
    ids = torch.randint(0, config.vocab_size, (N,))

    def the_pass():
        logp, _ = head_logprobs(model, hidden, ids, budget=budget_mib * 2**20)
        (logp * torch.linspace(0.5, 1.5, N)).sum().backward()

    weight_gradient = shape.vocab * config.hidden_size * 4 if head == "trained" else 0
    measured = _allocated_at_most(the_pass) - weight_gradient
    settings = Settings(micro_batch=1, generation_rows=1, num_generations=2, prompt_length=1, completion_length=N,
                        logprob_chunk=chunk, lora_targets=("q_proj",) if head == "frozen" else None)
    assert logprob_pass_bytes(shape, settings) == pytest.approx(measured, rel=0.1)
    if head == "trained":  # one chunk's logits and working copies of a quarter of the default budget's chunk
        working = logprob_chunk_tokens(shape.vocab) // 4
        assert measured == pytest.approx(4 * shape.vocab * (chunk + working), rel=0.1)


def _big_vocabulary(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def _sharded_pass_allocates(rank: int, port: int, out: str, tied: bool) -> None:
    """In one of two processes: a tiny model sharded as covey shards it, its training pass run once, then
    measured (``_allocated_at_most``); process 0 writes the bytes to ``out``."""
    from transformers import AutoModelForCausalLM

    from covey.train.head import head_logprobs
    from covey.train.sharding import Sharding, shard
    from tests.test_distributed import as_launched

    as_launched(rank, port)
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_big_vocabulary(tied))

    class Pass(torch.nn.Module):  # the pass around the model that covey shards
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            hidden = self.model.model(input_ids=ids).last_hidden_state[:, 1:-1].reshape(-1, 32)
            return head_logprobs(self.model, hidden, ids[:, 2:].reshape(-1))[0]

    sharded = shard(Pass(), Sharding(), bf16=False)
    ids = torch.randint(0, 32000, (1, 4))

    def training_pass():
        (-sharded(ids).mean()).backward()

    training_pass()  # FSDP2's first pass sets up its buffers
    model.zero_grad(set_to_none=True)
    measured = _allocated_at_most(training_pass)
    if rank == 0:
        with open(out, "w") as file:
            file.write(str(measured))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_under_fsdp2_the_root_unit_s_gradients_are_whole_at_the_backward_s_end(tmp_path, tied):
    """Two processes (gloo), FSDP2 full_shard: what the training pass allocates at once (the root unit
    gathered, its gradients whole and copied for the reduce-scatter, beside the shards) against the
    estimate's training phase."""
    from covey.core import logprob_chunk_tokens
    from covey.plan.memory import fsdp_gathered_bytes
    from tests.test_distributed import free_port, run_in_two_processes

    out = tmp_path / "measured"
    run_in_two_processes(_sharded_pass_allocates, (free_port(), str(out), tied), seconds=240)
    shape = dense_shape(_big_vocabulary(tied))
    settings = Settings(micro_batch=1, generation_rows=1, num_generations=2, prompt_length=2, completion_length=2,
                        logprob_chunk=logprob_chunk_tokens(shape.vocab), processes=2, fsdp="full_shard")
    estimated = fsdp_gathered_bytes(shape, settings) + training_pass_bytes(
        shape, settings, activation_bytes(shape, settings), logprob_pass_bytes(shape, settings))
    assert estimated == pytest.approx(int(out.read_text()), rel=0.1)


@pytest.fixture
def qwen_like(tmp_path):
    """A folder with only a config.json (no weights): the plan reads nothing else."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path / "qwen")
    return tmp_path / "qwen"


def small_device(gib: float) -> Device:
    return Device("a test device", "cpu", int(gib * 2 ** 30), int(gib * 2 ** 30))


def test_the_advice_makes_an_over_budget_run_fit(qwen_like):
    args = GRPOConfig(**{**DEMO, "max_completion_length": 1024, "per_device_train_batch_size": 16}, model=str(qwen_like))
    plan = make_plan(args, 1, small_device(6))
    assert not plan.fits
    suggestions = advice(plan)
    assert suggestions
    for suggestion in suggestions:
        again = replan(plan, suggestion.processes, **suggestion.changes)
        assert again.fits and again.needed == suggestion.needed
    # where no single change fits, the changes combine
    combined = advice(make_plan(args, 1, small_device(2.5)))
    assert len(combined) == 1 and len(combined[0].changes) > 1


def test_the_log_prob_budget_sizes_the_pass_and_the_plan_names_the_one_that_computes_no_logits_again(qwen_like):
    from covey.plan.report import plan_text

    args = GRPOConfig(**{**DEMO, "num_generations": 2, "max_completion_length": 1024, "per_device_train_batch_size": 2},
                      model=str(qwen_like))
    default = make_plan(args, 1, small_device(4))  # a micro-batch's logits (1.2 GB) over a quarter of the memory
    tokens = 2 * 1024  # the micro-batch's completion tokens, past the default's 220-token chunk
    whole_mib = -(-tokens * 151936 * 4 // 2**20)  # 1187
    assert default.settings.logprob_chunk == 220
    roomy = make_plan(args, 1, small_device(8))  # room for them: the budget left to covey holds them all
    assert roomy.settings.logprob_chunk >= tokens and "holds every logit" not in plan_text(roomy)
    assert f"logprob_budget_mib: {whole_mib} holds every logit" in plan_text(default)
    whole = replan(default, logprob_budget_mib=whole_mib)
    smaller = replan(default, logprob_budget_mib=whole_mib - 1)
    assert whole.settings.logprob_chunk >= tokens > smaller.settings.logprob_chunk
    # one chunk of logits and working rows of a quarter of the default's chunk (220 tokens), float32
    assert whole.breakdown.logprob_pass == 4 * 151936 * (tokens + 220 // 4)
    assert "holds every logit" not in plan_text(whole)
    assert "holds every logit" not in plan_text(replan(default, use_peft=True))  # a frozen head computes none again
    # a run over the device with a budget above the default is offered the default; one at it, no budget
    device = small_device((default.needed + whole.needed) / 2 / 2**30)
    tight = make_plan(dataclasses.replace(args, logprob_budget_mib=whole_mib), 1, device)
    assert not tight.fits and {"logprob_budget_mib": 128} in [s.changes for s in advice(tight)]
    assert not any("logprob_budget_mib" in s.changes for s in advice(make_plan(args, 1, small_device(1))))


def test_sharding_divides_the_state_over_processes(qwen_like):
    args = GRPOConfig(**DEMO, model=str(qwen_like), fsdp="full_shard")
    one, two = (make_plan(args, n, small_device(64)).breakdown for n in (1, 2))
    assert two.weights == one.weights // 2 and two.optimizer == one.optimizer // 2
    assert two.gradients == one.gradients // 2


def no_weights_load(monkeypatch, message: str) -> None:
    """Any model's weights loaded from here on fail the test (every load goes through PreTrainedModel's)."""
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail(message)))


def test_plan_reads_the_config_and_no_weights(qwen_like, capsys, monkeypatch):
    no_weights_load(monkeypatch, "the plan loaded the model")
    assert main(["plan", "--model", str(qwen_like), "--max-completion-length", "256", "--bf16", "true"]) == 0
    out = capsys.readouterr().out
    for part in ("weights", "gradients", "optimizer state (AdamW)", "activations", "log-prob pass",
                 "reference model", "engine", "peak (", "activations with gradient checkpointing", "fits:"):
        assert part in out, part
    assert "151,936" in out and "bf16 autocast" in out


def test_train_refuses_a_run_that_cannot_fit_before_loading_and_goes_ahead_when_told(qwen_like, tmp_path,
                                                                                      monkeypatch, capsys):
    import covey.plan.planning
    import covey.train.trainer

    monkeypatch.setattr(covey.plan.planning, "this_device", lambda *a, **k: small_device(4))
    no_weights_load(monkeypatch, "loaded before the check")
    run = tmp_path / "run"
    argv = ["train", "--model", str(qwen_like), "--output-dir", str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot fit" in err and "Settings that would fit" in err and "memory_check: false" in err
    assert not run.exists()

    started = []

    class Trainer:
        def __init__(self, args):
            started.append(args)

        def train(self):
            pass

    monkeypatch.setattr(covey.train.trainer, "GRPOTrainer", Trainer)
    assert main(argv + ["--memory-check", "false"]) == 0
    assert len(started) == 1 and started[0].memory_check is False


def test_a_run_that_fits_is_never_refused(qwen_like, monkeypatch):
    import covey.plan.planning
    from covey.plan import check_fits

    args = GRPOConfig(**DEMO, model=str(qwen_like))
    needed = make_plan(args, 1, small_device(1000)).needed
    # a device with less memory than the estimate, but more than 1/1.5 of it: the estimate may be 20% high
    monkeypatch.setattr(covey.plan.planning, "this_device", lambda *a, **k: Device("d", "cpu", int(needed / 1.45),
                                                                                 int(needed / 1.45)))
    assert check_fits(args, 1) is not None


def test_the_embedded_models_config_is_read_without_its_weights():
    config = model_config(GRPOConfig().model)
    shape = model_shape(config)
    assert (shape.vocab, shape.hidden, shape.layers) == (49152, 576, 30)
    assert estimate(shape, Settings(micro_batch=16, generation_rows=16, num_generations=8, prompt_length=512,
                                    completion_length=32)).peak > 0


def test_probe_trains_real_steps_and_times_the_run(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", str(tiny_model_dir), "--probe", "--max-steps", "7", "--max-completion-length", "8",
                 "--per-device-train-batch-size", "4", "--num-generations", "2", "--max-prompt-length", "32",
                 "--output-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "probe: a step took" in out and "7 steps" in out and "measured peak" in out
    assert not (tmp_path / "run").exists()  # the probe writes nowhere the run would


def test_the_check_takes_covey_s_default_prompt_limit_at_its_least(qwen_like):
    """max_prompt_length left at covey's default bounds prompts the data may make much shorter: the check
    refuses only what the completions, the micro-batch and the model (what the user asked for) need."""
    from covey.plan.check import least_the_user_asked_for

    args = GRPOConfig(**{**DEMO, "max_completion_length": 16}, model=str(qwen_like))
    plan = make_plan(args, 1, small_device(64))
    least = least_the_user_asked_for(plan)
    assert least.settings.prompt_length == 0 and least.needed < plan.needed
    given = make_plan(args.replace(max_prompt_length=512), 1, small_device(64))
    assert "max_prompt_length" in given.args.fields_given
    assert least_the_user_asked_for(given).needed == given.needed


def test_a_model_the_plan_cannot_read_is_left_to_the_trainer(tmp_path, capsys):
    """The check raises its note rather than printing it; the run's rules hand it back, and their phase shows it
    as a warning once no rule refuses the run (nothing is written by the rule itself)."""
    from covey.plan import MemoryCheckSkipped, check_fits
    from covey.rules import check
    from covey.train.run_rules import Handed, fits_the_device

    args = GRPOConfig(**DEMO, model=str(tmp_path / "no-such-model"))
    with pytest.raises(MemoryCheckSkipped, match="memory check was skipped"):
        check_fits(args, 1)
    note = fits_the_device(args, Handed(), lambda ok, message: pytest.fail(message))
    assert "memory check was skipped" in note and "no-such-model" in note
    with pytest.warns(UserWarning, match="memory check was skipped"):
        check((fits_the_device,), args, Handed())
    assert capsys.readouterr().err == ""


def test_the_probe_says_the_run_time_and_its_measured_peak_against_the_estimate(qwen_like):
    """What covey plan --probe prints from a probed step (the probe's training itself: the slow test above)."""
    from covey.plan.report import gib
    from covey.train.probe import Probe, measured_peak, probe_text

    plan = make_plan(GRPOConfig(**DEMO, model=str(qwen_like)), 1, small_device(64))
    hours = probe_text(plan, Probe(step_seconds=2.0, steps=3000, peak_bytes=3 * 2 ** 30, measured_on="a gauge"))
    assert "a step took 2.0 s; 3000 steps: about 1.7 h of training" in hours
    assert f"measured peak 3.00 GiB (a gauge) against the estimate {gib(plan.needed)}" in hours
    minutes = probe_text(plan, Probe(step_seconds=0.5, steps=120, peak_bytes=2 ** 20, measured_on="a gauge"))
    assert "120 steps: about 1.0 min of training" in minutes and "measured peak 1 MiB" in minutes
    peak, how = measured_peak()
    assert peak > 2 ** 20 and how  # this process holds torch: over a MiB, whichever way it was measured


@pytest.mark.parametrize("keep", [True, False])
def test_on_a_cpu_the_plan_says_the_memory_the_c_library_keeps_is_not_counted(qwen_like, keep):
    from covey.plan.report import KEPT_MEMORY_NOTE, plan_text

    args = GRPOConfig(model=str(qwen_like), max_completion_length=64, keep_freed_memory=keep, use_cpu=True)
    plan = make_plan(args)
    assert plan.device.kind == "cpu"
    assert (KEPT_MEMORY_NOTE in plan_text(plan)) == keep


def test_bfloat16_sampling_on_a_cpu_without_bfloat16_products_counts_a_float32_copy(qwen_like):
    """There the fast engine's bfloat16 copy holds float32 copies of the bfloat16 values (twice the bytes)."""
    args = GRPOConfig(**DEMO, model=str(qwen_like), rollout_bf16=True)
    shape = model_shape(model_config(str(qwen_like)))
    with_products, in_software = (make_plan(args, 1, dataclasses.replace(small_device(64), bfloat16_in_software=soft))
                                  for soft in (False, True))
    matrices = shape.linear_params + shape.vocab * shape.hidden
    assert in_software.breakdown.engine - with_products.breakdown.engine == 2 * matrices
