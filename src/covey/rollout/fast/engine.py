"""covey's own sampler: a batched decode loop with a KV cache over any Hugging Face causal LM.

What makes it faster than ``generate`` for GRPO:

- each prompt of a group is prefilled once and its cache shared by the G samples (read from one
  copy in covey's decode kernel, copied to each sample elsewhere);
- rows that finished (EOS, stop string) leave the batch, so the tail of a rollout costs only
  what is still running;
- no per-step logits processors beyond the ones asked for.

It returns, per token, the log-prob under the distribution actually sampled from (after
repetition penalty, temperature, top-k, top-p and min-p), like every engine.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from covey.core import completion_mask, length_mask
from covey.errors import ConfigError
from covey.models import autocast
from covey import core
from covey.rollout.engine import EngineSettings, Respond, Rollout, SamplesWithPolicy, SamplingParams, left_pad
from covey.rollout.fast.decoder import LeanDecoder, ModelDecoder


def process_logits(logits_BV: torch.Tensor, params: SamplingParams, history_BL: torch.Tensor | None) -> torch.Tensor:
    """The logits of the distribution to sample from, in the order transformers applies them:
    repetition penalty, temperature, top-k, top-p, min-p. Removed tokens get -inf."""
    logits_BV = logits_BV.float()
    if params.repetition_penalty != 1.0 and history_BL is not None and history_BL.numel():
        seen = torch.gather(logits_BV, 1, history_BL)
        seen = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
        logits_BV = logits_BV.scatter(1, history_BL, seen)
    if params.greedy:
        return logits_BV
    if params.temperature != 1.0:
        logits_BV = logits_BV / params.temperature
    if params.top_k or params.top_p < 1.0 or params.min_p:  # the trainer replays the same (core.TokenDistribution)
        logits_BV = logits_BV.masked_fill(core.truncated_away(logits_BV, params.top_k, params.top_p, params.min_p),
                                          -torch.inf)
    return logits_BV


# tokens per block of the sampler's two-level CDF
CDF_BLOCK = 1024


def _first_past(cdf_BN: torch.Tensor, target_B1: torch.Tensor, mass_BN: torch.Tensor) -> torch.Tensor:
    """Per row, the first entry whose CDF exceeds the target; where rounding puts the target on the far
    edge, the last entry with mass. (B,)"""
    index_B = torch.searchsorted(cdf_BN, target_B1, right=True).squeeze(1)
    last_with_mass_B = mass_BN.shape[1] - 1 - (mass_BN.flip(-1) > 0).int().argmax(-1)
    return torch.where(index_B < mass_BN.shape[1], index_B, last_with_mass_B)


def sample_categorical(probs_BV: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row by inverting the CDF with a single uniform number: the same distribution as
    ``torch.multinomial``, without its per-call exponential noise over the whole vocabulary. The CDF is
    inverted in two levels, so that no chain of additions runs along the vocabulary: the blocks of
    ``CDF_BLOCK`` tokens by their sums, then, in float64, the tokens of the block the draw falls in, in
    proportion to their share of it (a token's chance is then exact to float32's rounding of its block's
    sum). Never a token without mass. (B,)"""
    B, V = probs_BV.shape
    rows_B = torch.arange(B, device=probs_BV.device)
    blocks_BNK = (F.pad(probs_BV, (0, -V % CDF_BLOCK)) if V % CDF_BLOCK else probs_BV).view(B, -1, CDF_BLOCK)
    sums_BN = blocks_BNK.sum(-1)
    block_cdf_BN = sums_BN.double().cumsum(-1)
    u_B1 = torch.rand(B, 1, generator=generator, device=probs_BV.device, dtype=torch.float64)
    target_B1 = u_B1 * block_cdf_BN[:, -1:]
    block_B = _first_past(block_cdf_BN, target_B1, sums_BN)  # the block that u * total falls in
    before_B1 = torch.where(block_B > 0, block_cdf_BN[rows_B, (block_B - 1).clamp(min=0)], 0.0)[:, None]
    # then the first token of that block whose CDF there exceeds the same fraction of it
    block_BK = blocks_BNK[rows_B, block_B]
    cdf_BK = block_BK.double().cumsum(-1)
    fraction_B1 = (target_B1 - before_B1) / sums_BN[rows_B, block_B, None].double()
    return block_B * CDF_BLOCK + _first_past(cdf_BK, fraction_B1 * cdf_BK[:, -1:], block_BK)


def decoding_way(decoder: LeanDecoder | ModelDecoder) -> str:
    """How ``decoder`` runs a decode step, in words (``covey verify`` shows it)."""
    if isinstance(decoder, ModelDecoder):
        return "the model's own forward"
    return {"kernel": "covey's decode kernel", "prepacked": "oneDNN's prepacked products",
            "plain": "torch's matrix products"}[decoder.products_for(1).kind] + f" ({str(decoder.dtype)[6:]}, lean decoder)"


class FastEngine(SamplesWithPolicy):
    """Batched KV-cache sampling with shared prompt prefill and early exit of finished rows.

    ``bf16``: matrix products in bfloat16 (a bfloat16 copy of the weights for Llama-family models,
    autocast otherwise); the sampling log-probs then differ slightly from the trainer's float32
    forward, and the trainer applies the engine/trainer importance-sampling correction.
    ``multiply``: how the lean decoder multiplies (``decoder.WAYS_TO_MULTIPLY``; the benchmarks compare them)."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int], tokenizer=None,
                 bf16: bool = False, multiply: str = "fastest"):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer  # only needed for stop strings
        self.bf16 = bf16
        self.multiply = multiply
        self.exact_logprobs = not bf16
        self.decoded_with: str | None = None  # how the last batch's decode steps ran (``decoding_way``)

    @classmethod
    def build(cls, settings: EngineSettings, policy: torch.nn.Module, tokenizer, eos_token_ids: list[int]) -> "FastEngine":
        return cls(policy, tokenizer.pad_token_id, eos_token_ids, tokenizer, settings.bf16)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The tokenizer's special tokens, which decode to nothing."""
        return frozenset(self.tokenizer.all_special_ids)

    def _decoder(self, max_length: int) -> LeanDecoder | ModelDecoder:
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        if LeanDecoder.supports(self.model, dtype):
            return LeanDecoder(self.model, dtype, max_length, self.multiply)
        return ModelDecoder(self.model)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout:
        return self._sample(prompt_ids, num_generations, params, seed, None)

    def generate_episodes(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                          seed: int | None, respond: Respond) -> Rollout:
        """Episodes in one decode loop: a row whose turn ends stays in the batch with its KV cache, and
        the tokens ``respond`` appends are fed through it one step at a time (never recomputing the
        episode), while the other rows go on sampling."""
        return self._sample(prompt_ids, num_generations, params, seed, respond)

    @torch.no_grad()
    def _sample(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams, seed: int | None,
                respond: Respond | None) -> Rollout:
        if params.extra:
            raise ConfigError(f"the fast engine samples with covey's settings only, not {dict(params.extra)} "
                              "(generation_kwargs); use rollout_engine: hf or vllm for those")
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        generator = torch.Generator(device=device)
        # unseeded: a fresh seed of its own, leaving torch's global random stream as it was
        generator.manual_seed(seed) if seed is not None else generator.seed()
        G = num_generations
        ids_NP, mask_NP = left_pad(prompt_ids, self.pad_token_id)
        ids_NP, mask_NP = ids_NP.to(device), mask_NP.to(device)
        positions_NP = (mask_NP.cumsum(1) - 1).clamp(min=0)
        try:
            decoder = self._decoder(ids_NP.shape[1] + params.max_new_tokens)
            self.decoded_with = decoding_way(decoder)
            # the lean decoder has its own bfloat16 weights; the model's forward needs autocast
            with autocast(device, self.bf16 and isinstance(decoder, ModelDecoder)):
                # prefill each distinct prompt once, then give every sample of its group a copy
                logits_BV = decoder.prefill(ids_NP, mask_NP, positions_NP, G)
                # the repetition penalty's tokens: the prompt's (its padding made a repeat of its last token)
                prompt_BP = ids_NP.where(mask_NP.bool(), ids_NP[:, -1:]).repeat_interleave(G, dim=0).cpu()
                rollout = self._decode(decoder, logits_BV, positions_NP[:, -1].repeat_interleave(G) + 1, params,
                                       generator, device, prompt_BP, respond)
        finally:
            model.train(was_training)
        return rollout

    def _decode(self, decoder, logits_BV, next_position_B, params, generator, device, prompt_BP,
                respond: Respond | None) -> Rollout:
        B, T = logits_BV.shape[0], params.max_new_tokens
        tokens_BT = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        logp_BT = torch.zeros(B, T)
        lengths_B = torch.zeros(B, dtype=torch.long)
        reasons = ["length"] * B
        active = torch.arange(B)  # original row of each row still in the batch
        eos = torch.tensor(self.eos_token_ids, device=device)
        # episodes: the tokens still to feed of what the environment appended, by row; where each row's
        # current turn began; and which tokens the model sampled
        appended: dict[int, list[int]] = {}
        turn_start = [0] * B
        sampled_BT = torch.zeros(B, T, dtype=torch.long)
        for t in range(T):
            history = None
            if params.repetition_penalty != 1.0:  # penalised: every token of the prompt and of the completion so far
                history = torch.cat([prompt_BP[active], tokens_BT[active, :t]], 1).to(device)
            processed_BV = process_logits(logits_BV, params, history)
            logp_BV = torch.log_softmax(processed_BV, -1)
            next_B = processed_BV.argmax(-1) if params.greedy else sample_categorical(logp_BV.exp(), generator)
            logp_B = logp_BV.gather(1, next_B[:, None]).squeeze(1)
            forced = {row for row in active.tolist() if row in appended} if appended else set()
            for j, row in enumerate(active.tolist() if forced else ()):  # the environment's tokens, not a draw
                if row in forced:
                    next_B[j], logp_B[j] = appended[row].pop(0), 0.0
                    if not appended[row]:
                        del appended[row]
                        turn_start[row] = t + 1
            tokens_BT[active, t] = next_B.cpu()
            logp_BT[active, t] = logp_B.float().cpu()
            lengths_B[active] = t + 1
            sampled_BT[active, t] = 1
            finished_B = torch.isin(next_B, eos).cpu()
            for row, done in zip(active.tolist(), finished_B.tolist()):
                if row in forced:
                    sampled_BT[row, t] = 0
                    continue
                if done:
                    end = "eos"
                elif params.stop and self._hits_stop(tokens_BT[row, turn_start[row]: t + 1], params.stop):
                    end = "stop"
                else:
                    continue
                if respond is not None:  # the turn ended: the environment answers, or the episode is over
                    room = T - (t + 1)
                    more = respond(row, tokens_BT[row, turn_start[row]: t + 1].tolist(), room)
                    if more is not None and 0 < len(more) < room:
                        appended[row] = list(more)
                        continue
                reasons[row] = end
            keep_B = torch.tensor([reasons[row] == "length" for row in active.tolist()])
            if t == T - 1 or not keep_B.any():
                break
            if not keep_B.all():  # finished rows leave the batch and the cache
                keep_idx = keep_B.nonzero().squeeze(1).to(device)
                decoder.keep(keep_idx)
                active, next_B, next_position_B = active[keep_idx.cpu()], next_B[keep_idx], next_position_B[keep_idx]
            logits_BV = decoder.step(next_B, next_position_B)
            next_position_B = next_position_B + 1
        width = int(lengths_B.max())  # as wide as the longest completion, like generate's output
        tokens_BT, logp_BT = tokens_BT[:, :width], logp_BT[:, :width]
        # an episode holds EOS tokens inside it, at the ends of its earlier turns
        mask_BT = completion_mask(tokens_BT, self.eos_token_ids, lengths_B) if respond is None else \
            length_mask(lengths_B, width)
        tokens_BT = tokens_BT.masked_fill(mask_BT == 0, self.pad_token_id)
        return Rollout(tokens_BT, mask_BT, logp_BT.masked_fill(mask_BT == 0, 0.0), reasons,
                       sampled_BT[:, :width] * mask_BT)

    def _hits_stop(self, tokens_T: torch.Tensor, stop: tuple[str, ...]) -> bool:
        # a stop string spans at most one token per byte of it, plus the token it may begin inside;
        # special tokens decode to nothing, so they do not count towards that window
        window = max(len(s.encode()) for s in stop) + 1
        start = len(tokens_T)
        while start > 0 and window > 0:  # back over the tokens, a window's worth at a time
            start, end = max(0, start - window), start
            window -= sum(token not in self.special_ids for token in tokens_T[start:end].tolist())
        text = self.tokenizer.decode(tokens_T[start:].tolist(), skip_special_tokens=True)
        return any(s in text for s in stop)
