"""The image stage of covey verify, for prompts that show pictures: the image tokens the model sees are those
its processor writes, as many as the vision tower gives features, and the trainer's log-probs equal a plain
forward of the model with the pictures."""

from __future__ import annotations


import torch

from covey.data.text import encode_prompts
from covey.models import plain_model
from covey.train.batch import ScoredBatch
from covey.train.forward import SequenceBatch
from covey.train.parts import StepParts
from covey.verify.report import Report
from covey.vision import backbone, images_of, model_inputs
from covey.vision.fit import feature_count, image_token_id


def plain_inputs(model: torch.nn.Module, seq: SequenceBatch) -> dict[str, torch.Tensor]:
    """The keyword arguments of a plain forward of ``model`` over whole rows (prompt and completion): ids,
    attention mask, and either positions that count real tokens (as generation numbers them under left
    padding) or, for a model that derives them from the pictures (Qwen-VL's 3-D positions), none; and the
    rows' pictures."""
    input_ids = torch.cat([seq.prompt_ids_BP, seq.completion_ids_BT], 1)
    attention = torch.cat([seq.prompt_mask_BP, seq.completion_mask_BT], 1)
    inputs = dict(input_ids=input_ids, attention_mask=attention)
    if seq.images is None or not hasattr(backbone(plain_model(model)), "get_rope_index"):
        inputs["position_ids"] = (attention.cumsum(1) - 1).clamp(min=0)
    if seq.images is not None:
        inputs.update(model_inputs(seq.images, seq.prompt_mask_BP, seq.completion_ids_BT.shape[1]))
    device = next(model.parameters()).device
    return {key: value.to(device) for key, value in inputs.items()}


def check_images(report: Report, parts: StepParts, batch: ScoredBatch, indices: list[int]) -> None:
    """The image stage, where the sampled prompts show pictures (nothing to check otherwise)."""
    seq = batch.samples.sequences
    if seq.images is None:
        return
    model, processor = parts.policy.model, parts.sampler.processor
    token = image_token_id(plain_model(model).config)
    rows = [parts.prompts.rows[i] for i in indices]
    again = encode_prompts(parts.sampler.tokenizer, [row["prompt"] for row in rows], 10**9, "verify",
                           processor=processor)
    same = all(list(a) == list(parts.prompts.ids[i]) for a, i in zip(again, indices))
    report.add("images", "prompts are the processor's", same and processor is not None,
               f"{len(indices)} prompts re-encoded by {type(processor).__name__}",
               "the prompt ids differ from the processor's encoding of the same chat and pictures: see "
               "covey.vision.encode_image_prompt")
    counts = [(list(ids).count(token), feature_count(plain_model(model), images_of(ids).tensors))
              for ids in (parts.prompts.ids[i] for i in indices) if images_of(ids) is not None]
    report.add("images", "image tokens match the vision tower's features", all(t == f > 0 for t, f in counts),
               ", ".join(f"{t} tokens / {f} features" for t, f in counts),
               "each image token stands for one feature of the vision tower: the processor and the model do not "
               "belong together (give the model's own processor as processing_class)")
    with torch.no_grad():
        got, _ = parts.policy.pass_for(model)(seq, parts.sampler.sampling.distribution, False)  # the step's own pass
        logits = model(**plain_inputs(model, seq)).logits.float().cpu()
        P = seq.prompt_ids_BP.shape[1]
        reference = parts.sampler.sampling.distribution.logits(logits[:, P - 1:-1], seq.completion_ids_BT).log_softmax(-1)
        want = reference.gather(-1, seq.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
        blind = model(**{k: v for k, v in plain_inputs(model, seq).items() if k in _text_keys()}).logits.float().cpu()
    on = seq.completion_mask_BT == 1
    diff = float((got.float().cpu()[on] - want[on]).abs().max())
    report.add("images", "log-probs equal a plain forward with the pictures", diff < 1e-3, f"max diff {diff:.2g}",
               "the trainer's log-prob pass does not see the pictures the model sampled with: see "
               "covey.train.forward._every_row_with_images")
    seen = float((blind[:, P - 1:-1] - logits[:, P - 1:-1]).abs().max())
    report.add("images", "the pictures change the log-probs", seen > 1e-6, f"max logit change {seen:.2g}",
               "the model's output is the same with and without the pictures: its vision tower is not reached")


def _text_keys() -> set[str]:
    return {"input_ids", "attention_mask", "position_ids"}
