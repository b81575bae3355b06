"""The trainer's forward passes: per-token log-probs of completions under a model.

The completion tokens of each row follow its (left-padded) prompt. Only the logits that predict
completion tokens are computed, then divided by the sampling temperature so the log-probs are
those of the distribution the completions were drawn from.

The G completions of a group share one prompt, so by default the prompt is run once per group
and its keys and values are handed to each completion (gradients flow back through them into the
shared prefix): the same numbers as running every row in full, for a fraction of the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from covey.core import selective_log_softmax, token_entropy
from covey.models import cache_keyword


@dataclass
class SequenceBatch:
    """Prompt + completion token ids of a set of rows, ready for a forward pass."""

    prompt_ids_BP: torch.Tensor  # (B, P) left-padded
    prompt_mask_BP: torch.Tensor  # (B, P) 1 on prompt tokens
    completion_ids_BT: torch.Tensor  # (B, T) right-padded
    completion_mask_BT: torch.Tensor  # (B, T) 1 on generated tokens (EOS included)

    def rows(self, index: slice) -> "SequenceBatch":
        """A subset of rows with the padding columns they all share removed."""
        prompt_mask = self.prompt_mask_BP[index]
        completion_mask = self.completion_mask_BT[index]
        first = int((prompt_mask.sum(0) > 0).nonzero()[0]) if prompt_mask.any() else prompt_mask.shape[1]
        last = int(completion_mask.sum(1).max())
        return SequenceBatch(self.prompt_ids_BP[index, first:], prompt_mask[:, first:],
                             self.completion_ids_BT[index, :last], completion_mask[:, :last])

    def prompt_groups(self) -> torch.Tensor:
        """For each row, the index of its run of consecutive rows with the same prompt. (B,)"""
        same = (self.prompt_ids_BP[1:] == self.prompt_ids_BP[:-1]).all(1) & \
               (self.prompt_mask_BP[1:] == self.prompt_mask_BP[:-1]).all(1)
        return torch.cat([torch.zeros(1, dtype=torch.long), (~same).long().cumsum(0)])


def completion_logits(model: torch.nn.Module, batch: SequenceBatch, share_prompt: bool = True) -> torch.Tensor:
    """Logits at the positions that predict each completion token. (B, T, V)"""
    device = next(model.parameters()).device
    group_B = batch.prompt_groups()
    n_groups = int(group_B[-1]) + 1
    T = batch.completion_ids_BT.shape[1]
    # checkpointed layers drop the KV cache while gradients are on, so sharing would lose the prompt
    checkpointing = torch.is_grad_enabled() and model.training and any(
        getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    if not share_prompt or checkpointing or n_groups == len(group_B):
        input_ids = torch.cat([batch.prompt_ids_BP, batch.completion_ids_BT], dim=1)
        attention_mask = torch.cat([batch.prompt_mask_BP, batch.completion_mask_BT], dim=1)
        # positions count real tokens only, exactly as generation numbers them under left padding
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                       position_ids=position_ids.to(device), logits_to_keep=T + 1, use_cache=False).logits
        return logits[:, :-1]
    from transformers import DynamicCache

    first_row = torch.cat([torch.zeros(1, dtype=torch.long), (group_B[1:] != group_B[:-1]).nonzero().squeeze(1) + 1])
    prompt_ids, prompt_mask = batch.prompt_ids_BP[first_row], batch.prompt_mask_BP[first_row]
    prompt_positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    key = cache_keyword(model)
    # 1. each distinct prompt once; its last position predicts the first completion token
    first_logits = model(input_ids=prompt_ids.to(device), attention_mask=prompt_mask.to(device),
                         position_ids=prompt_positions.to(device), logits_to_keep=1, use_cache=True,
                         **{key: cache}).logits
    # 2. every completion attends to its group's prompt keys and values
    cache.batch_select_indices(group_B.to(device))
    attention_mask = torch.cat([prompt_mask[group_B], batch.completion_mask_BT], dim=1)
    positions = (prompt_mask.sum(1)[group_B].unsqueeze(1) + torch.arange(T).unsqueeze(0))
    first_logits = first_logits[group_B.to(device)]
    if T == 1:
        return first_logits
    rest = model(input_ids=batch.completion_ids_BT[:, :-1].to(device), attention_mask=attention_mask[:, :-1].to(device),
                 position_ids=positions[:, :-1].to(device), use_cache=True, **{key: cache}).logits
    return torch.cat([first_logits, rest], dim=1)


def completion_logprobs(model: torch.nn.Module, batch: SequenceBatch, temperature: float = 1.0,
                        with_entropy: bool = False, share_prompt: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_BT, entropy_BT or None) of the completion tokens; padding positions hold garbage
    and must be masked by the caller with ``batch.completion_mask_BT``."""
    device = next(model.parameters()).device
    logits_BTV = completion_logits(model, batch, share_prompt) / temperature
    logp_BT = selective_log_softmax(logits_BTV, batch.completion_ids_BT.to(device))
    entropy_BT = None
    if with_entropy:
        with torch.no_grad():
            entropy_BT = token_entropy(logits_BTV.detach())
    return logp_BT, entropy_BT
