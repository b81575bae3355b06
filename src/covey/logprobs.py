"""The trainer's forward passes: per-token log-probs of completions under a model.

The completion tokens of each row follow its (left-padded) prompt. Only the logits that predict
completion tokens are computed (``logits_to_keep``), then divided by the sampling temperature so
the log-probs are those of the distribution the completions were drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from covey.core import selective_log_softmax, token_entropy


@dataclass
class SequenceBatch:
    """Prompt + completion token ids of a set of rows, ready for a forward pass."""

    prompt_ids_BP: torch.Tensor  # (B, P) left-padded
    prompt_mask_BP: torch.Tensor  # (B, P) 1 on prompt tokens
    completion_ids_BT: torch.Tensor  # (B, T) right-padded
    completion_mask_BT: torch.Tensor  # (B, T) 1 on trained tokens (EOS included)

    def rows(self, index: slice) -> "SequenceBatch":
        """A subset of rows with the padding columns they all share removed."""
        prompt_mask = self.prompt_mask_BP[index]
        completion_mask = self.completion_mask_BT[index]
        first = int((prompt_mask.sum(0) > 0).nonzero()[0]) if prompt_mask.any() else prompt_mask.shape[1]
        last = int(completion_mask.sum(1).max())
        return SequenceBatch(self.prompt_ids_BP[index, first:], prompt_mask[:, first:],
                             self.completion_ids_BT[index, :last], completion_mask[:, :last])


def completion_logprobs(model: torch.nn.Module, batch: SequenceBatch, temperature: float = 1.0,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_BT, entropy_BT or None) of the completion tokens; padding positions hold garbage
    and must be masked by the caller with ``batch.completion_mask_BT``."""
    input_ids = torch.cat([batch.prompt_ids_BP, batch.completion_ids_BT], dim=1)
    attention_mask = torch.cat([batch.prompt_mask_BP, batch.completion_mask_BT], dim=1)
    # positions count real tokens only, exactly as generate() numbers them under left padding
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    device = next(model.parameters()).device
    T = batch.completion_ids_BT.shape[1]
    logits_BTV = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                       position_ids=position_ids.to(device), logits_to_keep=T + 1, use_cache=False).logits
    logits_BTV = logits_BTV[:, :-1] / temperature  # position t predicts completion token t
    logp_BT = selective_log_softmax(logits_BTV, batch.completion_ids_BT.to(device))
    entropy_BT = None
    if with_entropy:
        with torch.no_grad():
            entropy_BT = token_entropy(logits_BTV.detach())
    return logp_BT, entropy_BT
