"""The transformers rollout engine and the trainer's log-prob pass agree with plain forward passes."""

import pytest
import torch

from covey.core import completion_mask
from covey.train.forward import SequenceBatch, completion_logprobs
from covey.rollout import HFEngine, SamplingParams, left_pad


def _prompts(tokenizer):
    chats = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "2+2"}]]
    return [tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"] for c in chats]


def _full_forward_logprobs(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_greedy_rows_do_not_depend_on_padding_or_batch(tokenizer, tiny_model):
    engine = HFEngine(tiny_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_new_tokens=12, greedy=True)
    together = engine.generate(prompts, 1, params)
    for row, prompt in enumerate(prompts):
        alone = engine.generate([prompt], 1, params)
        n = int(alone.lengths_B[0])
        assert together.completion_ids_BT[row, :n].tolist() == alone.completion_ids_BT[0, :n].tolist()


def test_sampling_logprobs_match_a_full_forward_and_groups_are_contiguous(tokenizer, tiny_model):
    engine = HFEngine(tiny_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    prompts = _prompts(tokenizer)
    rollout = engine.generate(prompts, 3, SamplingParams(max_new_tokens=10, temperature=0.7), seed=0)
    assert rollout.completion_ids_BT.shape[0] == 6
    for row in range(6):
        n = int(rollout.lengths_B[row])
        completion = rollout.completion_ids_BT[row, :n].tolist()
        want = _full_forward_logprobs(tiny_model, prompts[row // 3], completion, temperature=0.7)
        assert torch.allclose(rollout.sampling_logp_BT[row, :n], want, atol=1e-4)
        assert (rollout.completion_ids_BT[row, n:] == tokenizer.pad_token_id).all()


def _always_emit(model, token: int, vocab: int):
    """Replace the head so that `token` is the only plausible next token."""
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-20.0)
        head.bias[token] = 20.0
    model.lm_head = head
    return model


def test_eos_ends_the_completion_inside_the_mask(tokenizer, tiny_model):
    eos = tokenizer.eos_token_id
    engine = HFEngine(_always_emit(tiny_model, eos, len(tokenizer)), tokenizer.pad_token_id, [eos])
    rollout = engine.generate(_prompts(tokenizer), 2, SamplingParams(max_new_tokens=4))
    assert rollout.finish_reasons == ["eos"] * 4
    assert rollout.lengths_B.tolist() == [1] * 4 and (rollout.completion_ids_BT[:, 0] == eos).all()


def test_length_finish_when_eos_never_comes(tokenizer, tiny_model):
    engine = HFEngine(_always_emit(tiny_model, 50, len(tokenizer)), tokenizer.pad_token_id, [tokenizer.eos_token_id])
    rollout = engine.generate(_prompts(tokenizer), 1, SamplingParams(max_new_tokens=5))
    assert rollout.finish_reasons == ["length", "length"] and rollout.lengths_B.tolist() == [5, 5]


def test_sampling_is_reproducible_with_a_seed(tokenizer, tiny_model):
    engine = HFEngine(tiny_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    params = SamplingParams(max_new_tokens=8)
    a = engine.generate(_prompts(tokenizer), 2, params, seed=5)
    b = engine.generate(_prompts(tokenizer), 2, params, seed=5)
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT)


def test_training_logprobs_equal_full_forward_under_left_padding(tokenizer, tiny_model):
    prompts = _prompts(tokenizer)
    completions = [[40, 41, 42, tokenizer.eos_token_id], [50, 51]]
    prompt_ids, prompt_mask = left_pad(prompts, tokenizer.pad_token_id)
    completion_ids = torch.full((2, 4), tokenizer.pad_token_id)
    for row, c in enumerate(completions):
        completion_ids[row, : len(c)] = torch.tensor(c)
    mask = completion_mask(completion_ids, [tokenizer.eos_token_id], torch.tensor([4, 2]))
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    batch = SequenceBatch(prompt_ids, prompt_mask, completion_ids, mask)
    with torch.no_grad():
        logp, entropy = completion_logprobs(tiny_model, batch, temperature=0.9, with_entropy=True)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        want = _full_forward_logprobs(tiny_model, prompt, completion, temperature=0.9)
        assert torch.allclose(logp[row, : len(completion)], want, atol=1e-5)
    assert (logp[mask == 1] <= 0).all() and (entropy >= 0).all()
    trimmed = batch.rows(slice(1, 2))
    assert trimmed.completion_ids_BT.shape[1] == 2 and trimmed.prompt_mask_BP.all()


def test_top_k_and_top_p_restrict_the_sampled_tokens(tokenizer, tiny_model):
    engine = HFEngine(tiny_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    prompt = _prompts(tokenizer)[:1]
    with torch.no_grad():
        first_logits = tiny_model(input_ids=torch.tensor(prompt)).logits[0, -1]
    top3 = set(first_logits.topk(3).indices.tolist())
    rollout = engine.generate(prompt, 32, SamplingParams(max_new_tokens=1, top_k=3), seed=0)
    assert set(rollout.completion_ids_BT[:, 0].tolist()) <= top3
    # the reported log-prob is that of the top-3 renormalised distribution, so it is >= the full one
    full = torch.log_softmax(first_logits, -1)[rollout.completion_ids_BT[:, 0]]
    assert (rollout.sampling_logp_BT[:, 0] >= full - 1e-6).all()
    nucleus = engine.generate(prompt, 32, SamplingParams(max_new_tokens=1, top_p=1e-6), seed=0)
    assert set(nucleus.completion_ids_BT[:, 0].tolist()) == {int(first_logits.argmax())}


def test_a_generation_config_saved_with_the_model_is_ignored(tokenizer, tiny_model):
    engine = HFEngine(tiny_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    prompt = _prompts(tokenizer)[:1]
    plain = engine.generate(prompt, 4, SamplingParams(max_new_tokens=6), seed=1)
    tiny_model.generation_config.repetition_penalty = 5.0
    tiny_model.generation_config.top_k = 2
    again = engine.generate(prompt, 4, SamplingParams(max_new_tokens=6), seed=1)
    assert torch.equal(plain.completion_ids_BT, again.completion_ids_BT)


def _tiny(architecture: str, vocab_size: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from tests.conftest import make_model

    small = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(2)
    if architecture == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**small)).eval()
    if architecture == "qwen3":  # q/k norms, explicit head_dim
        return Qwen3ForCausalLM(Qwen3Config(**small, head_dim=16)).eval()
    if architecture == "llama-lora":  # adapters on every linear layer, made non-zero so they count
        from covey.models import add_lora

        model = add_lora(make_model(vocab_size, seed=2), r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1)
        return model.eval()
    return make_model(vocab_size, seed=2)


@pytest.mark.parametrize("T, attention, packed, architecture", [
    (1, "sdpa", True, "llama"), (6, "sdpa", True, "llama"), (6, "eager", True, "llama"), (6, "sdpa", False, "llama"),
    (6, "sdpa", True, "qwen2"), (6, "sdpa", True, "qwen3"), (6, "sdpa", True, "llama-lora")])
def test_shared_prompt_forward_gives_the_same_logprobs_and_gradients(tokenizer, T, attention, packed, architecture):
    """Running each group's prompt once and sharing its keys/values, with the group's completions
    packed end to end (or padded, for models that take no packing mask), is exact, gradients
    included."""
    from covey.train import forward as logprobs

    model = _tiny(architecture, len(tokenizer))
    model.config._attn_implementation = attention
    assert logprobs._packable(model) == (attention in ("sdpa", "eager"))
    rows_fed = []
    model.get_decoder().register_forward_pre_hook(lambda m, a, kw: rows_fed.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)
    prompts = _prompts(tokenizer)
    repeated = [prompts[0]] * 3 + [prompts[1]] * 2 + [prompts[0]]  # groups of 3, 2 and 1 rows
    prompt_ids, prompt_mask = left_pad(repeated, tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(10, 90, (6, T), generator=g)
    lengths = torch.tensor([6, 3, 2, 1, 4, 5]).clamp(max=T)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    completion_ids[mask == 0] = tokenizer.pad_token_id
    batch = SequenceBatch(prompt_ids, prompt_mask, completion_ids, mask)
    assert batch.prompt_groups().tolist() == [0, 0, 0, 1, 1, 2]
    # a tied, trainable embedding looks up with sparse gradients in the packed pass (added into the head's)
    embedding = model.get_input_embeddings()
    lookups_sparse = []
    embedding.register_forward_pre_hook(lambda m, a: lookups_sparse.append(m.sparse))
    tied = embedding.weight is model.get_output_embeddings().weight and embedding.weight.requires_grad
    results = []
    for share in (False, True):
        model.zero_grad()
        rows_fed.clear()
        lookups_sparse.clear()
        logp, entropy = completion_logprobs(model, batch, temperature=0.8, with_entropy=True, share_prompt=share,
                                            pack=packed)
        (logp * mask).sum().backward()
        results.append((logp.detach(), entropy, [p.grad.clone() for p in model.parameters() if p.requires_grad]))
        assert set(lookups_sparse) == {share and packed and tied} and not embedding.sparse
        assert all(p.grad.layout == torch.strided for p in model.parameters() if p.requires_grad)
    (plain, plain_entropy, plain_grads), (shared, shared_entropy, shared_grads) = results
    # the prompts once (3 groups), then 4 packed rows (5 | 2+1 | 3 | 4 tokens fed) or 6 padded ones
    assert rows_fed == ([3] if T == 1 else [3, 4 if packed else 6])
    assert torch.allclose(plain[mask == 1], shared[mask == 1], atol=1e-5)
    assert torch.allclose(plain_entropy[mask == 1], shared_entropy[mask == 1], atol=1e-5)
    assert (shared[mask == 0] == 0).all()
    for a, b in zip(plain_grads, shared_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)



def test_each_rows_prompt_keys_and_values_come_through_index_select(tokenizer):
    """Whose backward adds the repeats of a shared prompt in a fixed order. Indexing (the cache's own
    batch_select_indices) accumulates them in parallel on CPU, in an order that varied between runs
    of the same training (gradients a few 1e-10 apart, so runs drifted apart)."""
    from covey.train.forward import _SharedPrompts

    model = _tiny("llama", len(tokenizer)).train()
    prompt_ids, prompt_mask = left_pad(_prompts(tokenizer), tokenizer.pad_token_id)
    batch = SequenceBatch(prompt_ids, prompt_mask, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    prompts = _SharedPrompts.run(model, batch, torch.tensor([0, 1]))
    prompts.select_rows(torch.tensor([0, 0, 1, 0]))
    for layer in prompts.cache.layers:
        assert layer.keys.shape[0] == layer.values.shape[0] == 4
        assert layer.keys.grad_fn.name() == layer.values.grad_fn.name() == "IndexSelectBackward0"

def test_packing_keeps_groups_apart_and_fills_rows_longest_first():
    from covey.train.forward import _first_fit

    rows, offsets, row_groups = _first_fit([5, 2, 1, 0, 3, 4, 2], [0, 0, 0, 0, 1, 1, 1], capacity=5)
    assert row_groups == [0, 0, 1, 1]
    assert rows[:3] == [0, 1, 1] and offsets[:3] == [0, 0, 2]  # the empty sequence takes no slot
    assert rows[4:] == [3, 2, 3] and offsets[4:] == [0, 0, 3]
    for row in range(len(row_groups)):
        assert sum(n for n, r in zip([5, 2, 1, 0, 3, 4, 2], rows) if r == row) <= 5


def test_packing_is_used_only_where_a_custom_mask_is_applied_as_given(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from covey.train.forward import _packable
    from tests.conftest import make_model

    llama = make_model(len(tokenizer))
    assert _packable(llama)
    llama.config._attn_implementation = "flex_attention"
    assert not _packable(llama)
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    assert _packable(Qwen2ForCausalLM(Qwen2Config(**small)))
    windowed = Qwen2Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert not _packable(Qwen2ForCausalLM(windowed))
    from transformers import BloomConfig, BloomForCausalLM  # ALiBi: builds its bias from the 2D mask

    assert not _packable(BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2)))


def test_log_prob_passes_attend_in_float32_under_bf16_autocast(tokenizer, monkeypatch):
    """On CPU the trainer's passes run SDPA in float32 (its bfloat16 backward is the slower one), with
    autocast or without, and the model's own attention setting is back as it was afterwards."""
    import transformers.integrations.sdpa_attention as sdpa_module

    from tests.conftest import make_model

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype, torch.is_autocast_enabled("cpu")))
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(sdpa_module.torch.nn.functional, "scaled_dot_product_attention", spy)
    model = make_model(len(tokenizer), seed=2)
    prompt_ids, prompt_mask = left_pad([_prompts(tokenizer)[0]] * 2, tokenizer.pad_token_id)
    completion_ids = torch.randint(10, 90, (2, 4), generator=torch.Generator().manual_seed(0))
    batch = SequenceBatch(prompt_ids, prompt_mask, completion_ids, torch.ones(2, 4, dtype=torch.long))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = completion_logprobs(model, batch)
        logp.sum().backward()
        assert model.config._attn_implementation == "sdpa"
        model(input_ids=prompt_ids, attention_mask=prompt_mask)  # the model's own forward: autocast decides again
    # two layers: the head's check (the model's forward and its decoder's, once per model), the prompt pass and
    # the packed pass; then the plain forward
    assert len(seen) == 2 * 4 + 2
    assert set(seen[:8]) == {(torch.float32, torch.float32, torch.float32, False)}
    assert seen[-1][2:] == (torch.bfloat16, True)  # bfloat16 values, autocast on: SDPA runs in bfloat16 there


def test_shared_prompt_forward_stays_exact_under_gradient_checkpointing(tokenizer):
    """Checkpointed layers drop the cache while gradients are on: the forward must not share then."""
    from tests.conftest import make_model

    model = make_model(len(tokenizer), seed=2)
    prompts = _prompts(tokenizer)
    prompt_ids, prompt_mask = left_pad([prompts[0]] * 3, tokenizer.pad_token_id)
    completion_ids = torch.randint(10, 90, (3, 4), generator=torch.Generator().manual_seed(1))
    batch = SequenceBatch(prompt_ids, prompt_mask, completion_ids, torch.ones(3, 4, dtype=torch.long))
    with torch.no_grad():
        want, _ = completion_logprobs(model, batch, share_prompt=False)
    model.gradient_checkpointing_enable()
    model.train()
    got, _ = completion_logprobs(model, batch)
    got.sum().backward()
    assert torch.allclose(got.detach(), want, atol=1e-5)


def test_generation_kwargs_reach_the_hf_and_vllm_samplers_and_are_refused_where_they_cannot(tiny_model, tokenizer):
    from covey import GRPOConfig
    from covey.errors import ConfigError
    from covey.rollout.fast import FastEngine
    from covey.rollout.wire import sampling_fields
    from covey.train.setup import sampling_params

    params = sampling_params(GRPOConfig(rollout_engine="hf", max_completion_length=6,
                                        generation_kwargs={"suppress_tokens": list(range(4, 30))}))
    engine = HFEngine(tiny_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    rollout = engine.generate([[5, 6, 7]], 8, params, seed=0)
    assert not ((rollout.completion_ids_BT >= 4) & (rollout.completion_ids_BT < 30)).any()  # suppressed
    vllm_params = sampling_params(GRPOConfig(rollout_engine="vllm", generation_kwargs={"presence_penalty": 0.5}))
    assert sampling_fields(vllm_params, 4, [3])["presence_penalty"] == 0.5  # vLLM's SamplingParams and server alike
    # keys that are covey's fields set them (the log-probs are computed with them too), as TRL scripts write them
    lifted = GRPOConfig(generation_kwargs={"temperature": 0.7, "top_k": 50, "do_sample": True, "max_new_tokens": 9})
    assert (lifted.temperature, lifted.top_k, lifted.max_completion_length, lifted.generation_kwargs,
            lifted.rollout_engine) == (0.7, 50, 9, None, "fast")
    with pytest.raises(ConfigError, match="generation_kwargs sets temperature=0.7 and temperature=0.9; give one"):
        GRPOConfig(temperature=0.9, generation_kwargs={"temperature": 0.7})
    with pytest.raises(ConfigError, match="generation_kwargs: do_sample is covey's temperature"):
        GRPOConfig(generation_kwargs={"do_sample": False})  # covey always samples in training
    # the others go to a sampler that takes them: transformers' generate, unless the config names an engine
    assert GRPOConfig(generation_kwargs={"presence_penalty": 0.5}).rollout_engine == "hf"
    with pytest.raises(ConfigError, match=r"generation_kwargs \['presence_penalty'\] are settings of transformers' "
                                          "generate or vLLM, and rollout_engine: fast samples with covey's fields"):
        GRPOConfig(rollout_engine="fast", generation_kwargs={"presence_penalty": 0.5})
    with pytest.raises(ConfigError, match="the fast engine samples with covey's settings only"):
        FastEngine(tiny_model, tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate([[5, 6]], 2, params)
