"""rollout_engine: vllm (colocated) with a vision-language model: a TRL script with use_vllm=True trains a tiny
Idefics3 (SmolVLM's architecture) on prompts with pictures, vLLM's processor reading the pictures each
prompt carries; before training and after it (the trained weights pushed, the vision tower's too) vLLM
samples with the log-probs of the trainer's forward on the same pictures, and on text prompts, and in
episodes whose later turn follows a tool's message that shows a picture; and vLLM serves the trained model
as `covey export` writes it. In a process
of its own: a process holds one vLLM engine, and the session's other tests share theirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.tiny_vision import saved

SCRIPT = '''
import json, os, sys
sys.path.insert(0, os.getcwd())  # the repository's tests
import numpy as np
import torch
from datasets import Dataset
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from covey import GRPOConfig, GRPOTrainer
from tests.vllm.tool_pictures import end_turns_early, episode_gap, trainer_logprobs

MODEL, OUTPUT = sys.argv[1], sys.argv[2]


def reward_len(completions, **kwargs):
    return [-abs(5 - len(completion[0]["content"])) for completion in completions]


pictures = [Image.fromarray((np.random.RandomState(i).rand(40, 48, 3) * 255).astype("uint8")) for i in range(4)]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": [{"type": "image"},
                                                                    {"type": "text", "text": "What is it?"}]}],
                              "image": picture} for picture in pictures])
model = AutoModelForImageTextToText.from_pretrained(MODEL)
processor = AutoProcessor.from_pretrained(MODEL)
args = GRPOConfig(output_dir=OUTPUT + "/run", per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=6, learning_rate=1e-2, logging_steps=1, max_steps=2, report_to="none",
                  seed=0, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.02,
                  max_prompt_length=128)
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=dataset,
                      processing_class=processor)


def gap(engine, policy, ids, seed):
    """The largest difference between vLLM's log-prob of a sampled token and the trainer's, on the pictures."""
    params = trainer.parts.sampler.sampling
    rollout = engine.generate(ids, 2, params, seed=seed)  # the policy's weights pushed first
    want = trainer_logprobs(policy, [p for p in ids for _ in range(2)], rollout, params)
    mask = rollout.completion_mask_BT.bool()
    return float((rollout.sampling_logp_BT - want).abs()[mask].max()), int(mask.shape[0])


engine, ids = trainer.parts.sampler.engine, trainer.parts.prompts.ids[:2]
text = [trainer.tokenizer.apply_chat_template([{"role": "user", "content": "What is it?"}], tokenize=True,
                                              add_generation_prompt=True, return_dict=False)]
result = {"engine": type(engine).__name__, "text before": gap(engine, trainer.model, text, 2)[0],
          "pictures before": gap(engine, trainer.model, ids, 3)[0]}
trainer.train()
engine.policy_changed(trainer.model)  # the trained weights pushed at the next generation
result["text after"] = gap(engine, trainer.model, text, 4)[0]
result["pictures after"], result["rows"] = gap(engine, trainer.model, ids, 5)

end_turns_early(trainer.model.eval(), text[0], trainer.tokenizer.eos_token_id)
engine.policy_changed(trainer.model)
result["episodes"], result["rows with a later turn"] = episode_gap(
    engine, trainer.model, processor, ids, trainer.parts.sampler.sampling, trainer.parts.sampler.eos_ids, 6,
    pictures[3])
json.dump(result, open(OUTPUT + "/result.json", "w"))
'''

# vLLM serves the exported model: it samples a prompt with a picture with transformers' log-probs of that folder
SERVE = '''
import json, sys
import numpy as np
import torch
import vllm
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from covey.rollout.vllm_engine import vllm_memory


def main():
    folder, output = sys.argv[1], sys.argv[2]
    picture = Image.fromarray((np.random.RandomState(7).rand(40, 48, 3) * 255).astype("uint8"))
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    llm = vllm.LLM(model=folder, dtype="float32", max_model_len=256, seed=0, **vllm_memory(0.02))
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}},
                       vllm.SamplingParams(max_tokens=6, temperature=1.0, logprobs=0, seed=0))[0].outputs[0]
    ids = list(out.token_ids)
    sampled = [step[token].logprob for step, token in zip(out.logprobs, ids)]
    inputs = processor(text=[text], images=[[picture]], add_special_tokens=False, return_tensors="pt")
    P = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([ids])], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        logits = model(**inputs).logits[0, P - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    json.dump({"tokens": len(ids), "gap": float((torch.tensor(sampled) - want).abs().max())}, open(output, "w"))


if __name__ == "__main__":  # vLLM starts its engine's process by spawning
    main()
'''


def test_a_vision_language_model_trains_and_samples_with_vllm_colocated(tmp_path):
    folder = saved("idefics3", tmp_path / "tiny-smolvlm")
    script = tmp_path / "vlm_vllm.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), folder, str(tmp_path)], capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).parent.parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["engine"] == "VLLMEngine" and result["rows"] == 4
    print(result)
    # vLLM samples with the trainer's log-probs, on prompts with pictures and without, before training and after
    # the trained weights of the vision-language model were pushed
    for key in ("text before", "pictures before", "text after", "pictures after", "episodes"):
        assert result[key] < 1e-3, f"vLLM's log-probs differ from the trainer's: {result}"
    # the trained model exported (covey export) is one vLLM serves, with the processor and chat template beside it
    done = subprocess.run([sys.executable, "-m", "covey", "export", str(tmp_path / "run"), str(tmp_path / "exported")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (tmp_path / "serve.py").write_text(SERVE)
    done = subprocess.run([sys.executable, str(tmp_path / "serve.py"), str(tmp_path / "exported"),
                           str(tmp_path / "served.json")], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    served = json.loads((tmp_path / "served.json").read_text())
    print(served)
    assert served["tokens"] == 6 and served["gap"] < 1e-3
    # and in episodes whose later turn follows a tool's message that shows a picture
    assert result["rows with a later turn"] > 0, str(result)
