"""FP8 sequence padding follows the recipe: our token multiple equals megatron-core's own
`get_fp8_align_size` (fp8_utils.py) for every recipe we offer, and `layout_multiple` reads
the recipe from the TransformerConfig that `transformer_config_from_hf` builds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_agent.models.transformer_config import FP8_RECIPES
from megatron_agent.training.batch import sequence_multiple


def _megatron_align(recipe: str) -> int:
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    return get_fp8_align_size(Fp8Recipe(recipe))


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_padding_is_megatron_cores_alignment_for_the_recipe(recipe):
    align = _megatron_align(recipe)
    assert sequence_multiple(fp8=True, fp8_recipe=recipe) == align
    assert sequence_multiple(fp8=False, fp8_recipe=recipe) == 1
    # with sequence parallelism over 3 ranks and CP 2 (4 chunks): the lcm of all three
    assert sequence_multiple(tp=3, sequence_parallel=True, fp8=True, fp8_recipe=recipe, cp=2) == 3 * align


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_layout_multiple_reads_the_recipe_of_the_model_config(recipe):
    from megatron_agent.models.tiny import hf_config_for
    from megatron_agent.models.transformer_config import transformer_config_from_hf
    from megatron_agent.platform import ParallelConfig
    from megatron_agent.training.schedule import layout_multiple

    config = transformer_config_from_hf(dict(hf_config_for("qwen3"), model_type="qwen3"), ParallelConfig(),
                                        fp8_recipe=recipe)
    assert layout_multiple([SimpleNamespace(config=config)]) == _megatron_align(recipe)
    plain = transformer_config_from_hf(dict(hf_config_for("qwen3"), model_type="qwen3"), ParallelConfig())
    assert layout_multiple([SimpleNamespace(config=plain)]) == 1
