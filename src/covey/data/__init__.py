"""Datasets: where prompts come from (built-in tasks, files, the Hugging Face hub), what a valid row is,
the order prompts are used in, and the text between rows and token ids."""

from covey.data.rows import EMPTY_PROMPT, extra_columns, heldout_rows, is_conversational, load_rows, shared_prompts
from covey.data.sampler import PromptSampler
from covey.data.stream import RowStream, StreamOrder, first_rows, is_stream

__all__ = ["EMPTY_PROMPT", "extra_columns", "heldout_rows", "is_conversational", "load_rows", "shared_prompts", "PromptSampler",
           "RowStream", "StreamOrder", "first_rows", "is_stream"]
