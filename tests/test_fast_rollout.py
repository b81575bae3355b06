"""covey's fast engine: same tokens as transformers generate, exact log-probs, correct sampling."""

import pytest
import torch

from covey.rollout.fast import decode_kernel
from covey.rollout.fast.decoder import LeanDecoder, onednn_linear
from covey.rollout.fast.engine import FastEngine, process_logits
from covey.rollout import HFEngine, SamplingParams
from tests.conftest import make_model
from tests.test_rollout_and_logprobs import _always_emit, _full_forward_logprobs, _prompts


@pytest.fixture(params=["lean", "model"])
def decoder(request, monkeypatch):
    """Run a test with each of the fast engine's decoders (the lean one where it applies)."""
    if request.param == "model":
        monkeypatch.setattr(LeanDecoder, "supports", staticmethod(lambda model, dtype: False))
    return request.param


def engines(model, tokenizer):
    eos = [tokenizer.eos_token_id]
    return HFEngine(model, tokenizer.pad_token_id, eos), FastEngine(model, tokenizer.pad_token_id, eos, tokenizer)


@pytest.mark.parametrize("G", [1, 3])
def test_greedy_is_token_identical_to_transformers_generate(tokenizer, G, decoder):
    model = make_model(len(tokenizer), seed=4)
    hf, fast = engines(model, tokenizer)
    prompts = _prompts(tokenizer) + [tokenizer("a longer third prompt", add_special_tokens=False)["input_ids"]]
    params = SamplingParams(max_new_tokens=24, greedy=True)
    a, b = hf.generate(prompts, G, params), fast.generate(prompts, G, params)
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT)
    assert a.finish_reasons == b.finish_reasons
    assert torch.allclose(a.sampling_logp_BT, b.sampling_logp_BT, atol=1e-5)


def test_sampled_logprobs_match_a_full_forward(tokenizer, decoder):
    model = make_model(len(tokenizer), seed=1)
    _, fast = engines(model, tokenizer)
    prompts = _prompts(tokenizer)
    rollout = fast.generate(prompts, 4, SamplingParams(max_new_tokens=12, temperature=0.7), seed=0)
    for row in range(8):
        n = int(rollout.lengths_B[row])
        completion = rollout.completion_ids_BT[row, :n].tolist()
        want = _full_forward_logprobs(model, prompts[row // 4], completion, temperature=0.7)
        assert torch.allclose(rollout.sampling_logp_BT[row, :n], want, atol=1e-4)


def known_distribution_model(tokenizer, logits):
    """A model whose next-token logits are ``logits`` whatever the input."""
    model = make_model(len(tokenizer))
    head = torch.nn.Linear(model.config.hidden_size, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(logits)
    model.lm_head = head
    return model


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(max_new_tokens=1), [0.5, 0.3, 0.15, 0.05]),
    (SamplingParams(max_new_tokens=1, top_k=2), [0.625, 0.375, 0.0, 0.0]),
    (SamplingParams(max_new_tokens=1, top_p=0.8), [0.625, 0.375, 0.0, 0.0]),
    (SamplingParams(max_new_tokens=1, min_p=0.25), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
])
def test_sampling_frequencies_match_the_softmax(tokenizer, params, expected):
    V = len(tokenizer)
    tokens = [40, 41, 42, 43]
    logits = torch.full((V,), -1e4)
    for token, p in zip(tokens, [0.5, 0.3, 0.15, 0.05]):
        logits[token] = torch.log(torch.tensor(p))
    model = known_distribution_model(tokenizer, logits)
    _, fast = engines(model, tokenizer)
    N = 4000
    rollout = fast.generate(_prompts(tokenizer)[:1], N, params, seed=1234)
    first = rollout.completion_ids_BT[:, 0]
    for token, p in zip(tokens, expected):
        freq = (first == token).float().mean().item()
        assert abs(freq - p) <= 4 * (p * (1 - p) / N) ** 0.5 + 1e-9, (token, freq, p)
        if p > 0:  # the reported log-prob is that of the (renormalised) distribution sampled from
            assert torch.allclose(rollout.sampling_logp_BT[first == token, 0], torch.log(torch.tensor(p)), atol=1e-4)
    assert set(first.tolist()) <= set(tokens)


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_p=0.0), dict(top_k=-1), dict(min_p=1.0),
                                 dict(repetition_penalty=0.0), dict(max_new_tokens=0)])
def test_sampling_settings_out_of_bounds_are_refused(bad):
    from covey.errors import ConfigError

    (name, _), = bad.items()
    with pytest.raises(ConfigError, match=f"{name} must be"):
        SamplingParams(**{"max_new_tokens": 4, **bad})


def test_processors_match_transformers(tokenizer):
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    history = torch.randint(0, 50, (3, 7))
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    want = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)):
        want = warper(history, want)
    got = process_logits(logits, params, history)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-6)


@torch.no_grad()
def _penalised_logprobs(model, prompts, G, rollout, params):
    """Log-probs of a rollout's tokens after transformers' own repetition penalty over prompt and
    completion so far (then top-k), from full forward passes."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

    logp_BT = torch.zeros_like(rollout.sampling_logp_BT)
    for row, n in enumerate(rollout.lengths_B.tolist()):
        prompt, completion = prompts[row // G], rollout.completion_ids_BT[row, :n].tolist()
        sequence = torch.tensor([prompt + completion])
        logits_TV = model(input_ids=sequence).logits[0, len(prompt) - 1: len(prompt) - 1 + n]
        for t in range(n):
            history = sequence[:, : len(prompt) + t]
            scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(history, logits_TV[t:t + 1].clone())
            if params.top_k and not params.greedy:
                scores = TopKLogitsWarper(params.top_k)(history, scores)
            logp_BT[row, t] = torch.log_softmax(scores, -1)[0, completion[t]]
    return logp_BT


def test_repetition_penalty_covers_the_prompt_as_in_transformers_and_vllm(tokenizer, tiny_model):
    # prompts of one length (no padding, which transformers would penalise too): the same tokens and log-probs
    prompts = [[40, 41, 42, 41, 43], [44, 44, 45, 46, 47]]
    hf, fast = engines(tiny_model, tokenizer)
    for params, seed in ((SamplingParams(max_new_tokens=8, greedy=True, repetition_penalty=8.0), None),
                         (SamplingParams(max_new_tokens=8, repetition_penalty=1.5, top_k=5), 3)):
        ours, theirs = fast.generate(prompts, 2, params, seed), hf.generate(prompts, 2, params, seed)
        assert torch.allclose(ours.sampling_logp_BT, _penalised_logprobs(tiny_model, prompts, 2, ours, params), atol=1e-5)
        if params.greedy:
            assert torch.equal(ours.completion_ids_BT, theirs.completion_ids_BT)
    # left padding is never penalised, by either engine: with the pad token the most likely one, a short
    # prompt padded beside a long one samples as it does alone
    logits = torch.zeros(len(tokenizer))
    logits[tokenizer.pad_token_id], logits[50] = 6.0, 5.0
    short, padded = [[44, 45]], [[44, 45], [40, 41, 42, 41, 43]]
    params = SamplingParams(max_new_tokens=1, greedy=True, repetition_penalty=8.0)
    for engine in engines(known_distribution_model(tokenizer, logits), tokenizer):
        alone, beside = engine.generate(short, 1, params), engine.generate(padded, 1, params)
        assert alone.completion_ids_BT.tolist() == beside.completion_ids_BT[:1].tolist() == [[tokenizer.pad_token_id]]
        assert torch.allclose(alone.sampling_logp_BT, beside.sampling_logp_BT[:1])


def test_prompt_is_prefilled_once_and_finished_rows_leave_the_batch(tokenizer, decoder):
    V = len(tokenizer)
    logits = torch.full((V,), -1e4)
    logits[tokenizer.eos_token_id] = 0.0
    logits[50] = 0.0  # EOS with probability 1/2 at every step
    model = known_distribution_model(tokenizer, logits)
    batch_sizes = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: batch_sizes.append(out.shape[0]))
    _, fast = engines(model, tokenizer)
    rollout = fast.generate(_prompts(tokenizer), 8, SamplingParams(max_new_tokens=12), seed=0)
    assert batch_sizes[0] == 2  # two prompts, each prefilled once for its 8 samples
    decode = batch_sizes[1:]
    assert decode == sorted(decode, reverse=True) and decode[-1] < 16
    for row, reason in enumerate(rollout.finish_reasons):
        n = int(rollout.lengths_B[row])
        assert (reason == "eos") == (rollout.completion_ids_BT[row, n - 1].item() == tokenizer.eos_token_id)


def test_stop_strings_end_a_completion(tokenizer, tiny_model):
    x = tokenizer("x", add_special_tokens=False)["input_ids"][0]
    model = _always_emit(tiny_model, x, len(tokenizer))
    fast = FastEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
    rollout = fast.generate(_prompts(tokenizer), 2, SamplingParams(max_new_tokens=10, stop=("xxx",)))
    assert rollout.finish_reasons == ["stop"] * 4 and rollout.lengths_B.tolist() == [3] * 4
    assert rollout.completion_mask_BT.sum(1).tolist() == [3] * 4
    assert rollout.completion_ids_BT.shape[1] == 3  # as wide as the longest completion, not max_new_tokens
    # a stop string longer than any fixed window of tokens
    rollout = fast.generate(_prompts(tokenizer), 1, SamplingParams(max_new_tokens=40, stop=("x" * 25,)))
    assert rollout.finish_reasons == ["stop"] * 2 and rollout.lengths_B.tolist() == [25] * 2


def test_a_stop_string_is_found_across_special_tokens(tokenizer):
    """Special tokens decode to nothing: a stop string split by several of them still ends the row."""
    fast = FastEngine(None, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer)
    a, b = (tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in "ab")
    tokens = [a] + [tokenizer.bos_token_id] * 3 + [b]
    assert tokenizer.decode(tokens, skip_special_tokens=True) == "ab"
    assert [fast._hits_stop(torch.tensor(tokens[:t]), ("ab",)) for t in range(1, 6)] == [False] * 4 + [True]


def test_seeded_sampling_is_reproducible(tokenizer, tiny_model):
    _, fast = engines(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    a = fast.generate(_prompts(tokenizer), 4, params, seed=7)
    b = fast.generate(_prompts(tokenizer), 4, params, seed=7)
    c = fast.generate(_prompts(tokenizer), 4, params, seed=8)
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT)
    assert not torch.equal(a.completion_ids_BT, c.completion_ids_BT)
    # sampling never touches torch's global random stream, seeded or not (dropout and user code draw from it)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    fast.generate(_prompts(tokenizer), 2, params)
    fast.generate(_prompts(tokenizer), 2, params, seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_fast_greedy_matches_transformers_on_the_default_model():
    from covey.sources import EMBEDDED_MODEL
    from covey.models import eos_token_ids, load_policy, load_tokenizer
    from covey.data.tasks import arithmetic
    from covey.data.text import encode_prompts

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    model = load_policy(EMBEDDED_MODEL).eval()
    eos = eos_token_ids(model, tokenizer)
    assert LeanDecoder.supports(model, torch.float32)  # the fast engine's own forward is what is compared
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in arithmetic("test")[:6]], 512)
    params = SamplingParams(max_new_tokens=24, greedy=True)
    a = HFEngine(model, tokenizer.pad_token_id, eos).generate(prompts, 1, params)
    b = FastEngine(model, tokenizer.pad_token_id, eos, tokenizer).generate(prompts, 1, params)
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT)
    assert torch.allclose(a.sampling_logp_BT, b.sampling_logp_BT, atol=1e-4)


def qwen2_with_biases(vocab_size: int):
    """A tiny Qwen2: q/k/v projections with biases, untied head (the other supported layout)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def decode_with(decoder, prompts, steps_BS, repeats):
    """Prefill ``prompts`` (left-padded), then feed the tokens of ``steps_BS`` one column at a time;
    the logits after the prompt and after each fed token. (B, S + 1, V)"""
    from covey.rollout import left_pad

    ids, mask = left_pad(prompts, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = [decoder.prefill(ids, mask, positions, repeats)]
    next_position = positions[:, -1].repeat_interleave(repeats) + 1
    for t in range(steps_BS.shape[1]):
        out.append(decoder.step(steps_BS[:, t], next_position + t))
    return torch.stack(out, 1)


@pytest.mark.parametrize("build", [lambda V: make_model(V, seed=5), qwen2_with_biases], ids=["llama", "qwen2"])
def test_lean_decoder_computes_the_models_logits(tokenizer, build):
    from covey.rollout.fast.decoder import ModelDecoder

    model = build(len(tokenizer))
    assert LeanDecoder.supports(model, torch.float32)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]  # the second is left-padded
    steps = torch.randint(4, len(tokenizer), (4, 6))
    lean = decode_with(LeanDecoder(model, torch.float32, max_length=16), prompts, steps, repeats=2)
    reference = decode_with(ModelDecoder(model), prompts, steps, repeats=2)
    assert torch.allclose(lean, reference, atol=1e-4)
    # and the full forward of each row, without any cache
    for row in range(4):
        ids = torch.tensor([prompts[row // 2] + steps[row].tolist()])
        with torch.no_grad():
            full = model(input_ids=ids).logits[0, len(prompts[row // 2]) - 1:]
        assert torch.allclose(lean[row], full, atol=1e-4)


def test_lean_decoder_refuses_more_positions_than_its_cache(tokenizer, tiny_model):
    decoder = LeanDecoder(tiny_model, torch.float32, max_length=4)
    with pytest.raises(ValueError, match="holds 4 positions"):
        decode_with(decoder, [[5, 6, 7]], torch.tensor([[8, 9]]), repeats=1)


def test_bf16_lean_decoder_stays_close_to_float32_and_is_marked_inexact(tokenizer):
    model = make_model(len(tokenizer), seed=2, layers=3)
    prompts, steps = [[5, 6, 7, 8], [9, 10]], torch.randint(4, len(tokenizer), (2, 8))
    exact = decode_with(LeanDecoder(model, torch.float32, max_length=16), prompts, steps, repeats=1)
    bf16 = decode_with(LeanDecoder(model, torch.bfloat16, max_length=16), prompts, steps, repeats=1)
    diff = (torch.log_softmax(bf16, -1) - torch.log_softmax(exact, -1)).abs()
    assert 0 < diff.max() < 0.05  # bfloat16 products: close, not equal
    assert FastEngine(model, 0, [3], bf16=True).exact_logprobs is False


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_lean_decoder_casts_the_embedding_only_as_a_tied_head(tokenizer, monkeypatch, tied):
    """The embedding lookup reads the model's own table: an untied model's embedding is never cast to
    bfloat16 (nor tiled for the kernel), only its head; a tied one is cast once, as the head."""
    from covey.rollout.fast import decode_kernel

    model = make_model(len(tokenizer), seed=2) if tied else qwen2_with_biases(len(tokenizer))
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (embedding is head) == tied
    cast = []  # the matrices cast to bfloat16, by pointer, whichever way
    to, tile = torch.Tensor.to, decode_kernel.tile_bf16

    def spy_to(t, *args, **kwargs):
        if torch.bfloat16 in args or kwargs.get("dtype") == torch.bfloat16:
            cast.append(t.data_ptr())
        return to(t, *args, **kwargs)

    def spy_tile(t):
        cast.append(t.data_ptr())
        return tile(t)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    monkeypatch.setattr(decode_kernel, "tile_bf16", spy_tile)
    LeanDecoder(model, torch.bfloat16, max_length=16)
    assert cast.count(head.data_ptr()) == 1
    assert cast.count(embedding.data_ptr()) == (1 if tied else 0)


def _skip_unless_it_runs(products: str, dtype: torch.dtype) -> None:
    from covey.rollout.fast.decoder import prepacked_linear
    from tests.test_decode_kernel import skip_without_kernel

    if products == "prepacked" and prepacked_linear(dtype) is None:
        pytest.skip(f"this torch build has no oneDNN {dtype} linear")
    if products == "kernel":
        skip_without_kernel(dtype)


@pytest.mark.parametrize("products, dtype, tolerance", [("prepacked", torch.bfloat16, 1e-3),
                                                        ("prepacked", torch.float32, 1e-5),
                                                        ("kernel", torch.float32, 1e-5),
                                                        ("kernel", torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("build", [lambda V: make_model(V, seed=5), qwen2_with_biases], ids=["llama", "qwen2"])
def test_lean_decoder_on_faster_products_matches_plain_ones(tokenizer, build, products, dtype, tolerance):
    from covey.rollout.fast.decode_kernel import MAX_ROWS
    from covey.rollout.fast.decoder import PREPACKED_FLOAT32_FROM_ROWS

    _skip_unless_it_runs(products, dtype)
    model = build(len(tokenizer))
    faster = LeanDecoder(model, dtype, max_length=16, multiply=products)
    plain = LeanDecoder(model, dtype, max_length=16, multiply="plain")
    assert {p.kind for _, p in plain.products} == {"plain"}
    # which rows each way serves: the kernel decode steps, the prepacked copy float32 steps of many rows
    serves = {("prepacked", torch.float32): {PREPACKED_FLOAT32_FROM_ROWS - 1: "plain", 64: "prepacked"},
              ("prepacked", torch.bfloat16): {1: "prepacked", 64: "prepacked"},
              ("kernel", torch.float32): {1: "kernel", MAX_ROWS: "kernel", MAX_ROWS + 1: "plain"},
              ("kernel", torch.bfloat16): {1: "kernel", 64: "kernel"}}[products, dtype]
    assert {rows: faster.products_for(rows).kind for rows in serves} == serves
    # 2 prompts x 2 rows and 1 prompt x 1 row, each after a prefill (in float32 through other products
    # than the steps: all write the same cache)
    for prompts, repeats in (([[5, 6, 7, 8], [9, 10]], 2), ([[5, 6, 7, 8]], 1)):
        steps = torch.randint(4, len(tokenizer), (len(prompts) * repeats, 8))
        faster_logits = decode_with(LeanDecoder(model, dtype, max_length=16, multiply=products), prompts, steps, repeats)
        plain_logits = decode_with(LeanDecoder(model, dtype, max_length=16, multiply="plain"), prompts, steps, repeats)
        assert torch.allclose(faster_logits, plain_logits, atol=tolerance)


def test_float32_decode_steps_take_the_fastest_products_that_run_here(tiny_model):
    from covey.rollout.fast import decode_kernel
    from covey.rollout.fast.decoder import onednn_linear

    decoder = LeanDecoder(tiny_model, torch.float32, max_length=16)
    expected = "kernel" if decode_kernel.available() else "prepacked" if onednn_linear(torch.float32) else "plain"
    assert decoder.products_for(8).kind == expected
    with pytest.raises(ValueError, match="multiply must be one of"):
        LeanDecoder(tiny_model, torch.float32, max_length=16, multiply="fast")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_lora_policy_samples_with_its_merged_weights(tokenizer, dtype, tolerance):
    from covey.models import add_lora

    policy = add_lora(make_model(len(tokenizer), seed=6), r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)  # a trained adapter: B != 0
    assert LeanDecoder.supports(policy, dtype)
    before = {name: p.clone() for name, p in policy.named_parameters()}
    prompts, steps = [[5, 6, 7, 8]], torch.randint(4, len(tokenizer), (1, 5))
    lean = decode_with(LeanDecoder(policy, dtype, max_length=16), prompts, steps, repeats=1)
    ids = torch.tensor([prompts[0] + steps[0].tolist()])
    with torch.no_grad():
        adapted = policy(input_ids=ids).logits[0, 3:]
        with policy.disable_adapter():
            base = policy(input_ids=ids).logits[0, 3:]
    assert (lean[0] - adapted).abs().max() < tolerance * (base - adapted).abs().max()
    assert all(torch.equal(p, before[name]) for name, p in policy.named_parameters())  # the policy is untouched


def _peft_config(kind: str):
    from peft import IA3Config, LoraConfig

    if kind == "ia3":
        return IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    options = {"head": dict(target_modules=["q_proj", "lm_head"]),  # the tied head's own adapter
               "embedding": dict(target_modules=["q_proj", "embed_tokens"]),  # the tied embedding's
               "lora_bias": dict(target_modules=["q_proj", "v_proj"], lora_bias=True),
               "trainable_tokens": dict(target_modules=["q_proj"], trainable_token_indices=[5, 9, 12])}[kind]
    return LoraConfig(r=4, lora_alpha=8, **options)


@pytest.mark.parametrize("kind, lean", [("head", True), ("embedding", True), ("lora_bias", False),
                                        ("trainable_tokens", False), ("ia3", False)])
def test_adapters_beyond_plain_weights_sample_from_what_the_policy_computes(tokenizer, kind, lean):
    """The lean decoder where it merges the adapter exactly, the model's own forward elsewhere: either
    way the tokens and log-probs of what the adapted policy computes, not of its base."""
    from peft import get_peft_model

    policy = get_peft_model(make_model(len(tokenizer), seed=6), _peft_config(kind))
    with torch.no_grad():  # a trained adapter: every part that starts as a no-op moved
        for name, param in policy.named_parameters():
            if any(part in name for part in ("lora_B", "lora_embedding_", "trainable_tokens_delta", "ia3_l")):
                param.normal_(1.0 if "ia3_l" in name else 0.0, 0.3)
    assert LeanDecoder.supports(policy, torch.float32) == lean
    prompts = [[5, 6, 7, 8], [9, 10, 12]]
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    fast = FastEngine(policy, tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(prompts, 2, greedy)
    hf = HFEngine(policy, tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(prompts, 2, greedy)
    assert torch.equal(fast.completion_ids_BT, hf.completion_ids_BT)
    assert torch.allclose(fast.sampling_logp_BT, hf.sampling_logp_BT, atol=1e-5)
    with policy.disable_adapter():  # and the adapter does change what is sampled
        base = HFEngine(policy, tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(prompts, 2, greedy)
    assert not torch.allclose(base.sampling_logp_BT, hf.sampling_logp_BT, atol=1e-3)


def test_float32_lora_policy_samples_without_a_second_copy_of_its_weights(tokenizer):
    from covey.models import add_lora

    policy = add_lora(make_model(len(tokenizer), seed=6), r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    for products in ("prepacked", "fastest"):
        decoder = LeanDecoder(policy, torch.float32, max_length=16, multiply=products)
        kinds = {p.kind for _, p in decoder.products}
        # one copy, whatever the rows: the merged matrices laid out for oneDNN in their place, or (where covey's
        # kernel runs) multiplied as they are; a full model adds a prepacked copy beside its own matrices
        assert not {"plain", "prepacked"} <= kinds, kinds
        kernel = products == "fastest" and decode_kernel.available(torch.float32)
        if onednn_linear(torch.float32) is not None and not kernel:
            assert kinds == {"prepacked"}, kinds


def test_inverse_cdf_sampling_draws_each_token_at_its_probability_across_blocks():
    """A vocabulary of several CDF blocks (the last one padded): heavy tokens on the blocks' edges and the
    rest spread thinly, drawn at their probabilities (chi-square over six groups, fixed seed)."""
    from covey.rollout.fast.engine import CDF_BLOCK, sample_categorical

    V = 2 * CDF_BLOCK + 452
    probs = torch.full((V,), 0.25 / (V - 3))
    heavy = [CDF_BLOCK - 1, CDF_BLOCK, V - 1]  # the last of the first block, the first of the next, the very last
    probs[heavy] = torch.tensor([0.3, 0.2, 0.25])
    generator = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_categorical(probs.expand(2000, V), generator) for _ in range(20)])
    block = torch.arange(V) // CDF_BLOCK
    groups = [torch.arange(V) == h for h in heavy]
    groups += [(block == b) & ~torch.isin(torch.arange(V), torch.tensor(heavy)) for b in range(3)]
    observed = torch.tensor([float(g[draws].sum()) for g in groups])
    expected = torch.tensor([float(probs[g].sum()) for g in groups]) * len(draws)
    assert observed.sum() == len(draws)
    assert float(((observed - expected) ** 2 / expected).sum()) < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


def test_inverse_cdf_sampling_never_picks_a_token_without_mass(monkeypatch):
    from covey.rollout.fast.engine import sample_categorical

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.2, 0.0, 0.8, 0.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_categorical(probs, generator) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0, 2}
    # u = 1 (the far edge of the CDF, which rounding can reach) falls back to the last token with mass
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(a[0], a[1], dtype=torch.float64))
    assert sample_categorical(probs, generator).tolist() == [3, 2]
