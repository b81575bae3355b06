"""Sampling with transformers' ``generate`` on the policy itself (``rollout_engine: hf``)."""

from __future__ import annotations

import torch

from covey.core import completion_mask
from covey.models import autocast, plain_model
from covey.rollout.engine import EngineSettings, Rollout, SamplesWithPolicy, SamplingParams, left_pad
from covey.vision import batch_images, model_inputs, picture_errors


class HFEngine(SamplesWithPolicy):
    """Sampling with ``transformers`` ``generate`` on the policy itself."""

    takes_images = True  # a prompt's pictures ride on its ids (covey.vision.ImagePromptIds)

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int], bf16: bool = False):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.bf16 = bf16
        self.exact_logprobs = not bf16

    @classmethod
    def build(cls, settings: EngineSettings, policy: torch.nn.Module, tokenizer, eos_token_ids: list[int]) -> "HFEngine":
        return cls(policy, tokenizer.pad_token_id, eos_token_ids, settings.bf16)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout:
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        input_ids, attention_mask = left_pad(repeated, self.pad_token_id)
        device = next(self.model.parameters()).device
        if seed is not None:
            torch.manual_seed(seed)
        from transformers import GenerationConfig

        # A fresh generation config: settings saved with the model (repetition penalty, its own
        # temperature, ...) must not change the distribution the trainer believes it sampled from.
        if params.stop:
            raise ValueError("stop strings are supported by the 'fast' rollout engine only")
        sampling = {} if params.greedy else dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                                 min_p=params.min_p or None)
        images = batch_images(repeated)  # a vision-language model's prompts: their pictures
        pictures = {} if images is None else model_inputs(images, attention_mask)
        if params.suppress:  # a vision-language model's image tokens (as TRL): the distribution says so too
            sampling["suppress_tokens"] = list(params.suppress)
        generation_config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=not params.greedy, **sampling,
            pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_ids,
            repetition_penalty=params.repetition_penalty, output_scores=True, return_dict_in_generate=True,
            **dict(params.extra))
        # generate() fills unset values from the model's own config, so swap in an empty one
        holder = plain_model(self.model)
        was_training, saved_config = self.model.training, holder.generation_config
        self.model.eval()
        holder.generation_config = GenerationConfig()
        try:
            with autocast(device, self.bf16), picture_errors():
                out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                          generation_config=generation_config,
                                          **{key: value.to(device) for key, value in pictures.items()})
        finally:
            self.model.train(was_training)
            holder.generation_config = saved_config
        completion_ids_BT = out.sequences[:, input_ids.shape[1]:].cpu()
        # scores are the processed logits actually sampled from (temperature, top-k, top-p applied)
        scores_BTV = torch.stack(out.scores, dim=1).float().cpu()
        sampling_logp_BT = torch.log_softmax(scores_BTV, dim=-1).gather(-1, completion_ids_BT.unsqueeze(-1)).squeeze(-1)
        mask_BT = completion_mask(completion_ids_BT, self.eos_token_ids)
        completion_ids_BT = completion_ids_BT.masked_fill(mask_BT == 0, self.pad_token_id)
        sampling_logp_BT = sampling_logp_BT.masked_fill(mask_BT == 0, 0.0)
        ends_with_eos = torch.isin(completion_ids_BT, torch.tensor(self.eos_token_ids)) & (mask_BT == 1)
        finish_reasons = ["eos" if row.any() else "length" for row in ends_with_eos]
        return Rollout(completion_ids_BT, mask_BT, sampling_logp_BT, finish_reasons)
