"""A vision-language model on Megatron-Core: GPTModel (multimodal RoPE) whose first
pipeline stage also holds the HF vision tower.

The tower is the transformers module of the family (`Family.vision_tower`), replicated on
every TP rank of the first stage: each rank encodes the micro-batch's images in full, and
since every TP rank sees the same images and gets the full gradient of the embeddings
(the sequence-parallel scatter happens after the merge), its gradients are the same on
every TP rank. docs/models.md says what this costs and how to change it.
"""

from __future__ import annotations

import importlib

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
    get_pos_emb_on_this_cp_rank,
)
from megatron.core.models.gpt import GPTModel

from megatron_agent.models.families import UnsupportedModelError, family_of
from megatron_agent.models.vision_inputs import merge_image_embeddings


def build_vision_tower(hf: dict, dtype: torch.dtype) -> torch.nn.Module:
    module, name = family_of(hf).vision_tower.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    return cls._from_config(cls.config_class(**hf["vision_config"]), dtype=dtype)


def interleaved_mrope_axes(mrope_section: list[int]) -> torch.Tensor:
    """The position axis (0 t, 1 h, 2 w) of each rotary frequency: they cycle t, h, w, and
    an axis whose section is used up gives its turns to t."""
    j = torch.arange(sum(mrope_section))
    axes = j % 3
    return torch.where((axes > 0) & (j < 3 * torch.tensor(mrope_section)[axes]), axes, 0)


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """Megatron's multimodal RoPE with Qwen3-VL's interleaved frequency layout."""

    def forward(self, position_ids, mrope_section, cp_group=None):
        freqs = position_ids.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq  # [3, b, s, half]
        axes = interleaved_mrope_axes(mrope_section).to(freqs.device)
        freqs = freqs.gather(0, axes.expand(1, *freqs.shape[1:]))[0]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, dim]
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


class VisionLanguageModel(GPTModel):
    """GPTModel plus `vision` (first stage only). `forward` takes the micro-batch's
    `pixel_values` and `image_grid_thw`; position ids are MRoPE's [3, b, s]."""

    def __init__(self, *args, hf: dict, **kwargs):
        # The embedding is scattered over sequence-parallel ranks here, after the images
        # are merged in, not inside the embedding layer.
        super().__init__(*args, scatter_embedding_sequence_parallel=False, **kwargs)
        self.image_token_id = hf["image_token_id"]
        self.vision = build_vision_tower(hf, self.config.params_dtype) if self.pre_process else None
        if family_of(hf).mrope_interleaved:
            old = self.rotary_pos_emb
            self.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=1.0, rotary_base=kwargs["rotary_base"])
            self.rotary_pos_emb.inv_freq = old.inv_freq
        self._deepstack: list[torch.Tensor] = []
        self._hook_deepstack(len(hf["vision_config"].get("deepstack_visual_indexes") or []))

    def _hook_deepstack(self, n: int) -> None:
        """Deepstack adds the i-th feature map at the image tokens after LM layer i < n:
        those layers must run where the vision tower does."""
        here = {layer.layer_number - 1 for layer in self.decoder.layers}
        wanted = set(range(n))
        if (self.pre_process and not wanted <= here) or (not self.pre_process and wanted & here):
            raise UnsupportedModelError(
                f"deepstack adds visual features after language-model layers 0-{n - 1}, which must sit on the "
                f"first pipeline stage with the vision tower; this layout puts layers {sorted(here)} on "
                f"{'that' if self.pre_process else 'another'} stage: give the first stage at least {n} layers")
        for layer in self.decoder.layers:
            if layer.layer_number - 1 < n:
                layer.register_forward_hook(lambda module, args, out, i=layer.layer_number - 1: (
                    (out[0] + self._deepstack[i], *out[1:]) if self._deepstack else out))

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *,
                pixel_values=None, image_grid_thw=None, image_mask=None, **kwargs):
        if position_ids is not None and position_ids.dim() == 2:  # text only: the same position on t, h, w
            position_ids = position_ids.expand(3, *position_ids.shape)
        if self.pre_process and decoder_input is None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=None)
            images, deepstack = None, []
            if pixel_values is not None:
                pixels = pixel_values.to(next(self.vision.parameters()).dtype)
                out = self.vision(pixels, grid_thw=image_grid_thw)
                images, deepstack = out.pooler_output, getattr(out, "deepstack_features", None) or []
            decoder_input = merge_image_embeddings(decoder_input, input_ids, images, self.image_token_id, image_mask)
            # Each deepstack map as a full [s, b, h] addend (zero off the image tokens).
            self._deepstack = [merge_image_embeddings(torch.zeros_like(decoder_input), input_ids, f,
                                                      self.image_token_id, image_mask) for f in deepstack]
            if self.config.sequence_parallel:
                scatter = tensor_parallel.scatter_to_sequence_parallel_region
                decoder_input, self._deepstack = scatter(decoder_input), [scatter(t) for t in self._deepstack]
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   labels=labels, **kwargs)
        finally:
            self._deepstack = []
