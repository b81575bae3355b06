"""covey: GRPO training for language models.

    from covey import GRPOConfig, GRPOTrainer
    GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=[my_reward],
                args=GRPOConfig(max_steps=50), train_dataset=rows).train()
"""

from covey.config import AsyncGRPOConfig, GRPOConfig
from covey.errors import ConfigError, CoveyError
from covey.rewards.probes import probe_rewards
from covey.train.trainer import AsyncGRPOTrainer, GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "AsyncGRPOConfig", "AsyncGRPOTrainer", "ConfigError", "CoveyError",
           "verify_trl", "probe_rewards"]
__version__ = "0.1.0"


def verify_trl(trainer, num_prompts: int = 2):
    """covey verify's stage checks on a ``trl.GRPOTrainer`` (covey.verify.trl); the report, which
    ``covey.verify.print_report`` prints."""
    from covey.verify.trl import verify_trl as check

    return check(trainer, num_prompts)
