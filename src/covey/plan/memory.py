"""The peak memory of one GRPO step per device, from a model's shapes and the run's settings.

Pure arithmetic: every function takes sizes and returns bytes. The parts:

- weights W, gradients G and AdamW's two states O (of the trained parameters), each divided over the
  processes under FSDP2 (and O alone under shard_optimizer_state);
- the reference R (beta > 0): a frozen copy of the weights, none under LoRA (the adapter is switched off);
- activations A: what autograd keeps of each decoder layer for the backward, per token (counted from
  the tensors a Llama-family layer saves, in float32 and under bfloat16 autocast); with gradient
  checkpointing only each layer's input, plus one layer recomputed in the backward;
- the log-prob pass: the logits of the micro-batch's completion tokens and their gradient (a chunk of
  them at a time where the pass is chunked, ``logprob_pass_bytes``);
- the engine: while it samples, its KV cache, the last position's logits and any copy of the weights
  it samples from; vLLM colocated keeps its share of the device (gpu_memory_utilization) throughout.

A step's phases do not overlap: sampling, then the training pass. Its peak is what stays (W, O, R, a
colocated vLLM's share) plus the larger phase. In the training pass the backward starts with every
activation, the logits and the head's gradient held; it then frees each layer's activations as it
makes that layer's gradients, and ends with the embedding's dense gradient E (V x H), so the peak is at
one end (``training_pass_bytes``): ``max(A + log-prob pass + head gradient, G + E where the head is tied)``
(under FSDP2, the root unit's whole gradients beside the shards G);
where a step accumulates micro-batches, the gradients G of the earlier ones are held beside either end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from covey.core import logprob_working_rows
from covey.plan.shapes import ModelShape

GiB = 2 ** 30
PACKED_FAMILIES = ("llama", "qwen2", "qwen3")  # where covey runs each prompt once and packs the completions


@dataclass(frozen=True)
class Settings:
    """What of a run the estimate needs (``covey.plan.settings_from_config`` reads them from a GRPOConfig)."""

    micro_batch: int  # completions per forward/backward (per_device_train_batch_size)
    generation_rows: int  # completions sampled per round in each process
    num_generations: int  # G: completions per prompt
    prompt_length: int  # P: max_prompt_length
    completion_length: int  # T: max_completion_length
    weight_bytes: int = 4  # of the model's dtype
    bf16_autocast: bool = False
    gradient_checkpointing: bool = False
    lora_targets: tuple[str, ...] | None = None  # None: full fine-tuning; else the linear layers LoRA wraps
    lora_r: int = 16
    lora_dropout: bool = True
    dora: bool = False
    quantization: str | None = None  # "4bit" or "8bit"
    reference: bool = False  # beta > 0
    processes: int = 1
    fsdp: str = ""  # "", "full_shard" or "shard_grad_op"
    shard_optimizer_state: bool = False
    engine: str = "fast"  # fast, hf, vllm (colocate), server
    rollout_bf16: bool = False
    bfloat16_copy_bytes: int = 2  # a value of the engine's bfloat16 copy (4: on a CPU without bfloat16 products)
    engine_copies_weights: bool = False  # the fast engine samples from its own float32 copy (no kernel here)
    vllm_share_bytes: int = 0  # gpu_memory_utilization x the device's memory (vllm colocated)
    eager_attention: bool = False
    head_in_float32: bool = False
    logprob_chunk: int | None = None  # tokens of the log-prob pass's chunk; None: all at once
    accumulating: bool = False  # several micro-batches a step: their gradients held from the first backward on
    entropy_bonus: bool = False  # the entropy carries a gradient (entropy_coef > 0)

    @property
    def trains_lora(self) -> bool:
        return self.lora_targets is not None

    @property
    def sharded(self) -> bool:
        return bool(self.fsdp) and self.processes > 1


@dataclass(frozen=True)
class Breakdown:
    """Bytes per device of each part, the phase each belongs to, and the step's peak."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logprob_pass: int
    reference: int
    engine: int  # while sampling (or, vLLM colocated, throughout)
    fsdp_gathered: int  # under FSDP2: the blocks' parameters gathered whole while they compute
    peak: int
    phase: str  # which phase sets the peak: "training pass" or "sampling"
    notes: tuple[str, ...] = field(default=())

    def parts(self) -> list[tuple[str, int]]:
        rows = [("weights", self.weights), ("gradients", self.gradients), ("optimizer state (AdamW)", self.optimizer),
                ("activations", self.activations), ("log-prob pass", self.logprob_pass),
                ("reference model", self.reference), ("engine", self.engine)]
        return rows + ([("FSDP2 gathered blocks", self.fsdp_gathered)] if self.fsdp_gathered else [])


# ---- parameters ---------------------------------------------------------------------------------------


def lora_trainable(shape: ModelShape, s: Settings) -> int:
    """Parameters of the LoRA adapter: A (r x in) and B (out x r) per wrapped linear layer (DoRA: and a
    magnitude per output)."""
    wrapped = [lin for lin in shape.layer_linears if lin.name in s.lora_targets]
    per_layer = sum(s.lora_r * (lin.inputs + lin.outputs) + (lin.outputs if s.dora else 0) for lin in wrapped)
    return shape.layers * per_layer


def trainable_params(shape: ModelShape, s: Settings) -> int:
    return lora_trainable(shape, s) if s.trains_lora else shape.params


def weights_bytes(shape: ModelShape, s: Settings) -> int:
    """The model's weights as loaded. Quantized, the decoder layers' linear matrices are packed (4 bits
    and a float32 scale per 64 weights; 8 bits and a float32 scale per row) and the rest is float32
    (peft's preparation for training); a LoRA adapter's matrices are float32 (peft keeps them so)."""
    if s.quantization == "4bit":
        base = shape.linear_params * (0.5 + 4 / 64) + (shape.params - shape.linear_params) * 4
    elif s.quantization == "8bit":
        rows = shape.layers * sum(lin.outputs for lin in shape.layer_linears)
        base = shape.linear_params + 4 * rows + (shape.params - shape.linear_params) * 4
    else:
        base = shape.params * s.weight_bytes
    adapter = lora_trainable(shape, s) * 4 if s.trains_lora else 0
    return int(base + adapter)


def trained_bytes(shape: ModelShape, s: Settings) -> int:
    """Bytes of the trained parameters (= of their gradients = of one AdamW state)."""
    return trainable_params(shape, s) * (4 if s.trains_lora else s.weight_bytes)


def gradients_bytes(shape: ModelShape, s: Settings) -> int:
    return trained_bytes(shape, s) // (s.processes if s.sharded else 1)


def optimizer_bytes(shape: ModelShape, s: Settings) -> int:
    """AdamW's two moments, in the parameters' dtype."""
    shared_by = s.processes if s.sharded or (s.shard_optimizer_state and s.processes > 1) else 1
    return 2 * trained_bytes(shape, s) // shared_by


def reference_bytes(shape: ModelShape, s: Settings) -> int:
    """A frozen copy of the weights for the KL term (none under LoRA: the policy with its adapter off)."""
    if not s.reference or s.trains_lora:
        return 0
    return shape.params * s.weight_bytes // (s.processes if s.sharded else 1)


# ---- activations --------------------------------------------------------------------------------------


def layer_bytes_per_token(shape: ModelShape, s: Settings) -> float:
    """What autograd keeps of one decoder layer for its backward, per token, counted from the tensors a
    Llama-family layer saves (tested against them in float32 and under bfloat16 autocast, full and LoRA):

    - each RMSNorm: its float32 input, its normalised input where its weight trains, and its output for
      the linear layers after it that train (one copy; under autocast each casts its own to bfloat16);
    - attention: the rotated queries, the keys, the values and the output, and a log-sum-exp per head
      (under autocast, a LoRA adapter on o_proj casts its own copy of the output);
    - the MLP: gate, up and act(gate), and their product where down_proj trains;
    - LoRA: each adapter's A output, and with dropout its dropped input and mask.

    Matrix products give float32, or bfloat16 under autocast (or in a bfloat16 model)."""
    H, I, q, kv, heads = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim, shape.heads
    a = 2 if s.bf16_autocast or s.weight_bytes == 2 else 4  # bytes of a matrix product's output
    full = not s.trains_lora

    def trains(name: str) -> bool:
        return full or name in s.lora_targets

    def norm(consumers: tuple[str, ...]) -> int:
        trained = sum(trains(c) for c in consumers)
        output = trained * 2 * H if a == 2 else 4 * H * (trained > 0)
        return 4 * H + (4 * H if full else 0) + output + 4

    per_token = norm(("q_proj", "k_proj", "v_proj")) + norm(("gate_proj", "up_proj"))
    per_token += a * (2 * q + 2 * kv) + 4 * heads
    if s.trains_lora and a == 2 and trains("o_proj"):  # peft casts the adapter's input to float32, autocast back
        per_token += a * q
    per_token += 3 * a * I + (a * I if trains("down_proj") else 0)
    if s.trains_lora:
        for lin in shape.layer_linears:
            if lin.name in s.lora_targets:
                per_token += a * s.lora_r + ((a + 2) * lin.inputs if s.lora_dropout else 0)
    return per_token


def attention_bytes(shape: ModelShape, s: Settings, rows: int, queries: int, keys: int) -> int:
    """Eager attention keeps its probabilities, (rows, heads, queries, keys); SDPA keeps none."""
    return rows * shape.heads * queries * keys * 4 * 2 if s.eager_attention else 0


def shares_prompts(shape: ModelShape, s: Settings) -> bool:
    """Whether the training pass runs each prompt once for its group and packs the completions."""
    return (shape.model_type in PACKED_FAMILIES and not s.gradient_checkpointing and s.num_generations > 1
            and s.micro_batch > 1)


def activation_bytes(shape: ModelShape, s: Settings) -> int:
    """The activations of one micro-batch's training pass, at full length (every prompt P tokens, every
    completion T). Shared prompts: each prompt runs once and each completion row attends to a copy of
    its prompt's keys and values; otherwise every row runs prompt and completion in full."""
    B, P, T, L = s.micro_batch, s.prompt_length, s.completion_length, shape.layers
    bytes_ = 2 if (s.bf16_autocast or s.weight_bytes == 2) else 4
    if shares_prompts(shape, s):
        prompts = math.ceil(B / s.num_generations)
        tokens = prompts * P + B * T
        per_layer_extra = B * P * 2 * shape.kv_dim * bytes_ + attention_bytes(shape, s, B, T, P + T)
    else:
        tokens = B * (P + T)
        per_layer_extra = attention_bytes(shape, s, B, P + T, P + T)
    layer = tokens * layer_bytes_per_token(shape, s) + per_layer_extra
    # the embedding's output, the final norm's and the hidden states the head reads
    outside = tokens * 3 * shape.hidden * 4
    # autocast keeps a bfloat16 copy of each float32 weight matrix a layer multiplies by, until its backward
    casts = shape.layer_linear_params * 2 if s.bf16_autocast and s.weight_bytes == 4 and not s.quantization else 0
    if s.gradient_checkpointing:  # each layer's input, and one layer whole again in the backward
        return int(L * tokens * shape.hidden * bytes_ + layer + casts + outside)
    return int(L * (layer + casts) + outside)


def logits_bytes(s: Settings) -> int:
    return 4 if s.head_in_float32 or not (s.bf16_autocast or s.weight_bytes == 2) else 2


def logprob_pass_bytes(shape: ModelShape, s: Settings) -> int:
    """The log-prob pass of a micro-batch's completion tokens N = B x T, from their final hidden states:
    chunked (``covey.train.head``, ``logprob_chunk`` tokens a chunk; the last chunk's softmax kept from the
    forward in float32, in place of its logits, which its backward turns into their gradient in place). At
    the worst moment, per vocabulary entry: in float32, one chunk's logits and a quarter of a chunk's rows
    of working copy (the log-softmax), or, for the entropy bonus, a chunk and its float32 p; under autocast,
    the kept float32 softmax beside the chunk's bfloat16 logits and two quarter-chunk float32 working
    copies, or a chunk computed again, its float32 copy and its gradient cast back (and the entropy bonus's
    p), with a copy of the head's weight in the compute dtype; all at once (an older pass), the logits of
    all N tokens and their gradient."""
    tokens = s.micro_batch * s.completion_length
    if s.logprob_chunk is None:
        return 2 * tokens * shape.vocab * logits_bytes(s)
    chunk = min(tokens, s.logprob_chunk)
    working = min(chunk, logprob_working_rows(s.logprob_chunk, shape.vocab, 4))  # covey.train.head's working rows
    cast_weight = shape.vocab * shape.hidden * 2 if logits_bytes(s) == 2 and s.weight_bytes == 4 else 0
    if logits_bytes(s) == 4:
        per_entry = 8 * chunk if s.entropy_bonus else 4 * chunk + 4 * working
    else:
        per_entry = 12 * chunk if s.entropy_bonus else max(6 * chunk + 8 * working, 8 * chunk)
    return per_entry * shape.vocab + cast_weight


def head_gradient_bytes(shape: ModelShape, s: Settings) -> int:
    """The output head's gradient, made at the start of the backward (the embedding's, when tied): the
    chunked pass sums it in float32 (under autocast, each chunk's product made in bfloat16 first), then
    casts it to the weight's dtype. Whole under FSDP2 too: a unit's
    gradient is made whole, then reduce-scattered into the shards."""
    if s.trains_lora:
        return 0
    summed = shape.vocab * shape.hidden * (4 + (s.weight_bytes if s.weight_bytes != 4 else 0))
    # under autocast each chunk's product comes in the compute dtype before it is added in
    return summed + (shape.vocab * shape.hidden * 2 if logits_bytes(s) == 2 else 0)


def embedding_gradient_bytes(shape: ModelShape, s: Settings) -> int:
    """The input embedding's gradient, made at the very end of the backward: dense (V x H, in the weight's
    dtype) whatever few tokens the micro-batch has; none where the embedding does not train (LoRA)."""
    return 0 if s.trains_lora else shape.vocab * shape.hidden * s.weight_bytes


def training_pass_bytes(shape: ModelShape, s: Settings, activations: int, logprob: int) -> int:
    """The training pass's peak, at one end of the backward:

    - its start: every activation, the log-prob pass and the head's gradient;
    - its end: the embedding's gradient made beside the others. With a tied head autograd holds the head's
      share of the shared matrix's gradient until the embedding's arrives and sums the two, so both exist
      at once: G + E. Untied, the embedding's is its own part of G.

    Under FSDP2 the root unit (embedding, head) reduce-scatters its gradients only once its backward is
    done, after the embedding's: they are whole beside the shards G, the embedding's and an untied head's,
    and again in the reduce-scatter's input, copied there before they are freed (tied: the head's share
    and the embedding's, before they are summed, take as much).

    Accumulating micro-batches, every gradient G is held already from the earlier ones, and each new one
    exists beside it until it is added in: G + the larger of the start and the end's new gradients (the
    embedding's, and the tied head's share waiting to be summed with it)."""
    gradients, embedding = gradients_bytes(shape, s), embedding_gradient_bytes(shape, s)
    start = activations + logprob + head_gradient_bytes(shape, s)
    tied_share = embedding if shape.tied else 0
    end_new = embedding + tied_share
    if s.sharded and embedding:  # the root unit's whole gradients, and their copy for the reduce-scatter
        end_new = 2 * (embedding + shape.head_params * s.weight_bytes)
    if s.accumulating:
        return gradients + max(start, end_new)
    return max(start, gradients + (end_new if s.sharded else tied_share))


# ---- the engine ---------------------------------------------------------------------------------------


def kv_cache_bytes(shape: ModelShape, rows: int, length: int, bytes_: int) -> int:
    """Keys and values of every layer for ``rows`` sequences of ``length`` tokens."""
    return rows * length * shape.layers * 2 * shape.kv_dim * bytes_


def engine_bytes(shape: ModelShape, s: Settings) -> int:
    """While the engine samples: its KV cache for the round's rows at full length, the last position's
    logits (and the sampler's float32 work on them), and any copy of the weights it samples from; a
    colocated vLLM holds its share of the device throughout; a server's engine is elsewhere."""
    if s.engine == "server":
        return 0
    if s.engine == "vllm":
        return s.vllm_share_bytes
    rows, length = s.generation_rows, s.prompt_length + s.completion_length
    cache_bytes = 2 if s.rollout_bf16 or s.weight_bytes == 2 else 4
    total = kv_cache_bytes(shape, rows, length, cache_bytes) + 3 * rows * shape.vocab * 4
    if s.engine == "fast":
        matrices = shape.linear_params + shape.vocab * shape.hidden
        if s.rollout_bf16 and s.weight_bytes == 4:  # sampled from a bfloat16 copy of the matrices
            total += matrices * s.bfloat16_copy_bytes
        elif s.engine_copies_weights:  # its own copy of every matrix (a LoRA policy's merged ones among them)
            total += matrices * s.weight_bytes
        elif s.trains_lora:  # from the adapted layers merged into their base weights
            total += lora_merged_bytes(shape, s)
    if s.sharded:  # the engine samples from a whole copy of the sharded policy
        total += shape.params * s.weight_bytes
    return total


def lora_merged_bytes(shape: ModelShape, s: Settings) -> int:
    wrapped = [lin for lin in shape.layer_linears if lin.name in s.lora_targets]
    merged = shape.layers * sum(lin.inputs * lin.outputs for lin in wrapped)
    return merged * (s.bfloat16_copy_bytes if s.rollout_bf16 else 4)


def fsdp_gathered_bytes(shape: ModelShape, s: Settings) -> int:
    """Under FSDP2, what is gathered whole beyond a process's shards: the root unit (embedding, head,
    final norm) while the pass runs, and the block computing plus the next one fetched ahead
    (shard_grad_op: every block, from its forward to its backward)."""
    if not s.sharded:
        return 0
    layer = (shape.layer_linear_params + shape.layer_other_params) * s.weight_bytes
    root = (shape.params - shape.layers * layer // s.weight_bytes) * s.weight_bytes
    blocks = shape.layers * layer if s.fsdp == "shard_grad_op" else 2 * layer
    return int((root + blocks) * (s.processes - 1) / s.processes)


# ---- the step -----------------------------------------------------------------------------------------


def estimate(shape: ModelShape, s: Settings) -> Breakdown:
    """Every part, and the peak of a step per device (module docstring)."""
    shard = s.processes if s.sharded else 1
    weights = weights_bytes(shape, s) // shard
    gradients, optimizer = gradients_bytes(shape, s), optimizer_bytes(shape, s)
    activations, logprob = activation_bytes(shape, s), logprob_pass_bytes(shape, s)
    reference, engine, gathered = reference_bytes(shape, s), engine_bytes(shape, s), fsdp_gathered_bytes(shape, s)
    stays = weights + optimizer + reference + (engine if s.engine == "vllm" else 0)
    training = gathered + training_pass_bytes(shape, s, activations, logprob)
    sampling = 0 if s.engine == "vllm" else engine
    notes = []
    if s.logprob_chunk is None:
        notes.append("log-prob pass: all of the micro-batch's logits at once")
    if shape.counted_on_meta:
        notes.append(f"{shape.model_type}: parameters counted on the meta device; activations as a Llama-family layer's")
    return Breakdown(weights, gradients, optimizer, activations, logprob, reference, engine, gathered,
                     stays + max(training, sampling), "training pass" if training >= sampling else "sampling",
                     tuple(notes))
