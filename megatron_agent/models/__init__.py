"""Models: HF config -> Megatron-Core GPTModel, families, tiny models made on the spot."""

from megatron_agent.models.builder import build_model, choose_layer_spec
from megatron_agent.models.families import FAMILIES, UnsupportedModelError, family_of
from megatron_agent.models.transformer_config import (
    padded_vocab_size,
    read_hf_config,
    transformer_config_from_hf,
    validate_layout_for_model,
)

__all__ = [
    "FAMILIES",
    "UnsupportedModelError",
    "build_model",
    "choose_layer_spec",
    "family_of",
    "padded_vocab_size",
    "read_hf_config",
    "transformer_config_from_hf",
    "validate_layout_for_model",
]
