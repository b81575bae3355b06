"""Models: loading the policy, its tokenizer and the reference; the embedded default model; a LoRA
policy's merged weights; sharded models' parameters whole; where models live.

    verbosity   transformers' progress bars and log level while covey runs
    embedded    the embedded default model, converted once from GGUF into the cache
    loading     the policy and its tokenizer from a folder, a hub id or the embedded model
    device      the device, bfloat16 autocast (its products in float32 where the CPU has none), and the C
                library's handling of freed memory
    policy      the policy's parts: LoRA, a float32 head, dropout, the reference
    merging     a LoRA policy's weights merged into the plain model's
    sharded     FSDP2 models' parameters whole, a block at a time

Every name callers use is importable from ``covey.models`` itself.
"""

from covey.models.device import (Float32Products, autocast, bfloat16_products_in_software, default_device,
                                 float32_products, keep_freed_memory)
from covey.models.embedded import EMBEDDED_GGUF, cache_dir, embedded_model_folder, resolve_model_path
from covey.models.loading import (ModelLoading, check_quantization, eos_token_ids, load_policy, load_processing,
                                  load_tokenizer, prepare_tokenizer, quantization_settings, tokenizer_as_loaded)
from covey.models.merging import (QUANTIZED_PARAMETERS, adapted_shared_matrix, base_parameter_name, dequantized,
                                  lora_merge_blocker, merged_model, policy_weights)
from covey.models.policy import (Float32Head, Reference, add_lora, cache_keyword, disable_dropout, head_in_float32,
                                 is_peft_model, plain_model)
from covey.models.sharded import SHARDED_PASSES, gathered_parameters, is_sharded, parameters_whole
from covey.models.verbosity import LIBRARY_LOG_LEVEL, quiet_transformers, set_log_level

__all__ = [
    "EMBEDDED_GGUF", "Float32Head", "Float32Products", "LIBRARY_LOG_LEVEL", "ModelLoading", "QUANTIZED_PARAMETERS",
    "Reference", "SHARDED_PASSES", "adapted_shared_matrix", "add_lora", "autocast", "base_parameter_name",
    "bfloat16_products_in_software", "cache_dir", "cache_keyword", "check_quantization", "default_device",
    "dequantized", "disable_dropout", "embedded_model_folder", "eos_token_ids", "float32_products",
    "gathered_parameters", "head_in_float32", "is_peft_model", "is_sharded", "keep_freed_memory", "load_policy",
    "load_processing", "load_tokenizer", "lora_merge_blocker", "merged_model", "parameters_whole", "plain_model",
    "policy_weights", "prepare_tokenizer", "quantization_settings", "quiet_transformers", "resolve_model_path",
    "set_log_level", "tokenizer_as_loaded",
]
