"""Episodes of two turns whose later turn follows a tool's message that shows a picture, sampled by a vLLM
engine, and how far its log-probs are from the trainer's (which read the prompt's picture and the tool's)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from covey.agents.chat import tool_message_pictures
from covey.rollout import left_pad
from covey.rollout.engine import episodes_by_turns
from covey.train.forward import SequenceBatch, completion_logprobs
from covey.vision import ImagePromptIds, batch_images, images_of, with_pictures_shown


def end_turns_early(model, prompt_ids: list[int], eos: int) -> None:
    """Raise the end token's probability to about a tenth on ``prompt_ids``, so that turns end before the budget."""
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([list(prompt_ids)]), output_hidden_states=True).hidden_states[-1][0]
        logits = model.get_output_embeddings()(hidden)
        others = torch.cat([logits[:, :eos], logits[:, eos + 1:]], -1).logsumexp(-1)
        lift = float((others - logits[:, eos]).mean()) + float(np.log(1 / 9))
        direction = hidden.mean(0)
        model.get_output_embeddings().weight[eos] += lift * direction / direction.square().sum()


def episode_gap(engine, model, processor, prompt_ids: list, params, eos: list[int], seed: int, picture
                ) -> tuple[float, int]:
    """(the largest gap between the engine's log-prob of a sampled token and the trainer's, the rows with a
    turn after the tool's message) over episodes of ``prompt_ids`` (2 each) where the first turn is answered by
    a tool message that shows ``picture``."""
    rows = [p for p in prompt_ids for _ in range(2)]
    tool = [{"role": "tool", "name": "look", "content": [{"type": "image", "image": picture},
                                                         {"type": "text", "text": "the scene"}]}]

    def respond(row, turn_ids, room):
        if images_of(rows[row]).count > 1:  # answered once
            return None
        appended, end, shown = tool_message_pictures(processor, tool, eos)
        opened = turn_ids[-1] not in eos
        appended = [end] * opened + appended
        if len(appended) >= room:  # the tool's message does not fit: the episode ends without it
            return None
        images = with_pictures_shown(images_of(rows[row]), processor, shown, len(rows[row]) + len(turn_ids) + opened)
        rows[row] = ImagePromptIds(rows[row], images)
        return ImagePromptIds(appended, images)

    rollout = episodes_by_turns(engine, prompt_ids, 2, dataclasses.replace(params, max_new_tokens=60), seed,
                                respond, 0)
    want = trainer_logprobs(model, rows, rollout, params)
    sampled = rollout.sampled_mask_BT.bool()
    later = sampled & (rollout.sampled_mask_BT.cumsum(1) < torch.arange(1, sampled.shape[1] + 1))
    return float((rollout.sampling_logp_BT - want).abs()[sampled].max()), int(later.any(1).sum())


def trainer_logprobs(model, rows: list, rollout, params) -> torch.Tensor:
    """The trainer's log-prob of each token of ``rollout`` (one row per prompt of ``rows``, which carry their
    pictures), under the distribution of ``params``."""
    prompt_BP, mask_BP = left_pad(rows, 0)
    sequences = SequenceBatch(prompt_BP, mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT,
                              batch_images(rows))
    with torch.no_grad():
        return completion_logprobs(model.eval(), sequences, params.distribution)[0]
