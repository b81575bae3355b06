"""covey: GRPO training for language models.

    from covey import GRPOConfig, GRPOTrainer
    GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=[my_reward],
                args=GRPOConfig(max_steps=50), train_dataset=rows).train()
"""

from covey.config import GRPOConfig
from covey.errors import ConfigError, CoveyError
from covey.train.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "ConfigError", "CoveyError"]
__version__ = "0.1.0"
