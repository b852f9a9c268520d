"""Tiny HF-format models and tokenizers made on the spot (no model hub needed).

`write_tiny_model(family, out_dir)` writes config.json, safetensors weights drawn from a
seed, a byte-level BPE tokenizer trained here on a small built-in corpus, and a chat
template. `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and
`AutoTokenizer.from_pretrained(out_dir)` load it; so does the rest of this project.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Sizes per preset; family-specific fields are added in `hf_config_for`.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
}
# Tied or untied as the family's small real models are (Qwen2/3-0.6B tie, Llama and
# Qwen3-30B-A3B do not), so both layouts are exercised.
TIED_EMBEDDINGS = {"llama": False, "qwen2": True, "qwen3": True, "qwen3_moe": False}
MOE_FIELDS = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=0.0, output_router_logits=False)

# Vision-language families: the tiny vision tower (out_hidden_size is the LM's hidden
# size) and the image processor's patch size; tied as Qwen2.5-VL-7B, Qwen3-VL-4B and
# Qwen3-VL-30B-A3B are. The MoE's expert sizes are chosen so that H, I and 2I differ (the
# fused expert layouts can then be told apart).
VISION_FAMILIES: dict[str, dict] = {
    "qwen2_5_vl": dict(tied=False, vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                               patch_size=14, window_size=56, fullatt_block_indexes=[1])),
    "qwen3_vl": dict(tied=True, vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                            patch_size=16, num_position_embeddings=64,
                                            deepstack_visual_indexes=[0, 1])),
    "qwen3_vl_moe": dict(tied=False, vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 patch_size=16, num_position_embeddings=64,
                                                 deepstack_visual_indexes=[0, 1]),
                         text=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                   decoder_sparse_step=1, mlp_only_layers=[])),
}
# Images of 2x2 to 4x4 merged tokens (the processor resizes into this range).
IMAGE_TOKENS_RANGE = (4, 16)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Tags the environments' action formats use: one token each.
TAG_TOKENS = [f"<{'/' if close else ''}{tag}>" for tag in
              ("think", "action", "search", "answer", "information") for close in (False, True)]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# Content is a string or a list of parts ({"type": "image"} or {"type": "text", "text": ...});
# an image becomes one <|image_pad|>, which the processor repeats once per image token.
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


# Words the agent loop's prompts are made of; each becomes one token (alone and after a
# space), everything else falls back to byte-level pieces, so any text encodes.
VOCAB_WORDS = (
    "you are an agent in environment your task is to reach the goal current observation "
    "position target move left right up down action think answer search question information "
    "passage box wall floor player room push step reward valid invalid cards card formula equals "
    "number line hit stand dealer total points history previous turn the a of in it and or not "
    "with for on as by at from this that what which who when where how yes no system user "
    "assistant choose one next must only output format"
).split() + [str(n) for n in range(0, 101)]


def _bpe_pieces(text: str, ranks: dict) -> list[str]:
    """Encode one pre-token with BPE merges (lowest rank first), as `tokenizers` does."""
    pieces = list(text)
    while len(pieces) > 1:
        candidates = [(ranks[pair], i) for i, pair in enumerate(zip(pieces, pieces[1:])) if pair in ranks]
        if not candidates:
            break
        _, i = min(candidates)
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _byte_level_bpe(words: list[str]):
    """BPE vocab and merges built deterministically so that each word is one token.

    Each word is encoded with the merges so far and a new merge joins its first two
    pieces, until it is one piece. New merges rank after all earlier ones, so earlier
    words still encode to one token. (Training with `tokenizers` breaks ties between equally frequent pairs
    differently from run to run, so a seed would not fix the tokenizer.)
    """
    from tokenizers import pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        for text in (word, "\u0120" + word):  # \u0120 (Ġ) is the byte-level space
            pieces = _bpe_pieces(text, ranks)
            while len(pieces) > 1:
                ranks[(pieces[0], pieces[1])] = len(ranks)
                vocab.setdefault(pieces[0] + pieces[1], len(vocab))
                pieces = _bpe_pieces(text, ranks)  # the new merge may apply elsewhere too
    return vocab, sorted(ranks, key=ranks.get)


# The word-level vocabulary of the CPU default job (NumberLine): the words its prompts
# use and its two actions, one token each, so that a random policy says "+" or "-"
# often enough to learn from.
JOB_WORDS = ["Target", "Current", ":", "+", "-", "user", "assistant", "system"] + [str(n) for n in range(21)]
# Added to the word-level vocabulary of a vision-language model: VisualQuiz's choice names
# (its colours and shapes, one token each, so that a random policy names a choice often
# enough to learn from) and the nouns of its question.
VISION_JOB_WORDS = ["red", "green", "blue", "yellow", "purple", "orange",
                    "circle", "square", "triangle", "cross", "diamond", "ring",
                    "Which", "colour", "shape", "image", "Choices"]
TOKENIZER_KINDS = ("bpe", "words")


def build_tokenizer(kind: str = "bpe", vision: bool = False):
    """A tokenizer with chat special tokens (and with `vision`, the image tokens and a
    chat template that places them).

    "bpe": byte-level BPE, any text encodes and decodes back exactly (the default).
    "words": one token per word of JOB_WORDS (with `vision`, and of VISION_JOB_WORDS;
    unknown words are [UNK]; decoding joins words with spaces): a vocabulary of ~40
    (~60 with `vision`), for models trained from scratch on CPU.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":
        vocab, merges = _byte_level_bpe(VOCAB_WORDS)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        extra = {}
    elif kind == "words":
        words = ["[UNK]"] + list(dict.fromkeys(JOB_WORDS + (VISION_JOB_WORDS if vision else [])))
        tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        extra = {"unk_token": "[UNK]"}
    else:
        raise ValueError(f"tokenizer kind={kind!r}; choose one of {TOKENIZER_KINDS}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"] + (VISION_TOKENS if vision else []),
        **extra,
    )
    fast.add_tokens(TAG_TOKENS)
    fast.chat_template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    return fast


def embedding_rows(tokenizer) -> int:
    """Like real checkpoints, the embedding has more rows than the tokenizer has tokens (a
    multiple of 64, so any TP size up to 64 splits it without padding)."""
    return -(-len(tokenizer) // 64) * 64


def hf_config_for(family: str, preset: str = "tiny", vocab_size: int = 1024, **overrides) -> dict:
    if family not in TIED_EMBEDDINGS:
        raise ValueError(f"family={family!r}; choose one of {sorted(TIED_EMBEDDINGS)}")
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}; choose one of {sorted(PRESETS)}")
    fields = dict(PRESETS[preset], vocab_size=vocab_size, tie_word_embeddings=TIED_EMBEDDINGS[family],
                  max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.02,
                  hidden_act="silu")
    if family == "qwen3_moe":
        fields.update(MOE_FIELDS, moe_intermediate_size=fields["intermediate_size"] // 2)
    fields.update(overrides)
    return fields


def vision_config_for(family: str, tokenizer, preset: str = "tiny", **overrides) -> dict:
    """A vision-language config in transformers 5's nested form (text_config, vision_config)."""
    spec = VISION_FAMILIES[family]
    text = dict(PRESETS[preset], vocab_size=embedding_rows(tokenizer), max_position_embeddings=2048,
                rms_norm_eps=1e-6, initializer_range=0.02, hidden_act="silu", **spec.get("text", {}),
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    text.update(overrides)
    half = text["head_dim"] // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}
    if family != "qwen2_5_vl":
        text["rope_parameters"]["mrope_interleaved"] = True
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        text_config=text,
        vision_config=dict(spec["vision"], out_hidden_size=text["hidden_size"], spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=spec["tied"],
    )


def image_processor_for(hf: dict):
    """Qwen2-VL's image processor (the PIL one: no torchvision needed) for this tower."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = hf["vision_config"]
    unit = vision["patch_size"] * vision["spatial_merge_size"]
    low, high = IMAGE_TOKENS_RANGE
    mean_std = {} if vision["patch_size"] == 14 else dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        size={"shortest_edge": low * unit * unit, "longest_edge": high * unit * unit}, **mean_std,
    )


def _fused_experts_to_hub_layout(path: Path) -> None:
    """transformers 5 writes a fresh model's fused experts as it keeps them in memory,
    gate_up_proj [E, 2I, H] and down_proj [E, H, I]; published Qwen3-VL-MoE checkpoints
    hold [E, H, 2I] and [E, I, H]. Write the published layout (transformers reads both)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = t.transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


@contextmanager
def progress_bars_off():
    """transformers' progress bars off for the block ("Writing model shards" for a model
    of one shard would be drawn inside the caller's own bar), as they were after it."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def write_tiny_vlm(family: str, out_dir: str | Path, *, preset: str = "tiny", seed: int = 0,
                   dtype: torch.dtype = torch.float32, tokenizer: str = "bpe", **overrides) -> Path:
    """A tiny vision-language model: config.json, weights under the checkpoint's own names
    (what `save_pretrained` writes), preprocessor_config.json and the tokenizer (a kind
    from TOKENIZER_KINDS)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    out_dir = Path(out_dir)
    tokenizer_kind = tokenizer
    tokenizer = build_tokenizer(tokenizer_kind, vision=True)
    fields = vision_config_for(family, tokenizer, preset, **overrides)
    config = AutoConfig.for_model(family, **fields)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        with torch.no_grad():  # no zero pad row (see write_tiny_model)
            model.get_input_embeddings().weight[tokenizer.pad_token_id].normal_(0.0, 0.02)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    from megatron_agent.models.checkpoint import atomic_directory

    with atomic_directory(out_dir) as tmp:
        with progress_bars_off():
            model.save_pretrained(tmp, safe_serialization=True)
        if "num_experts" in fields["text_config"]:
            _fused_experts_to_hub_layout(tmp / "model.safetensors")
        tokenizer.save_pretrained(tmp)
        image_processor_for(fields).save_pretrained(tmp)
        (tmp / "megatron_agent.json").write_text(json.dumps(
            {"family": family, "preset": preset, "seed": seed, "tokenizer": tokenizer_kind, "overrides": overrides},
            indent=2))
    log.info("wrote %s %s (%d parameters) to %s", family, preset, sum(p.numel() for p in model.parameters()), out_dir)
    return out_dir


def write_tiny_model(
    family: str,
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: str = "bpe",
    **overrides,
) -> Path:
    """Write an HF model directory; atomic (a temporary directory renamed at the end).
    `tokenizer` is a kind from TOKENIZER_KINDS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if family in VISION_FAMILIES:
        return write_tiny_vlm(family, out_dir, preset=preset, seed=seed, dtype=dtype, tokenizer=tokenizer,
                              **overrides)

    out_dir = Path(out_dir)
    tokenizer_kind = tokenizer
    tokenizer = build_tokenizer(tokenizer_kind)
    overrides.setdefault("vocab_size", embedding_rows(tokenizer))
    fields = hf_config_for(family, preset, **overrides)
    config = AutoConfig.for_model(
        family,
        **fields,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # transformers zeroes the pad token's embedding row (nn.Embedding padding_idx);
        # a zero row makes RMSNorm's gradient ~1/sqrt(eps) in Megatron, which has no
        # padding_idx, whenever the token shows up in a response. Trained checkpoints
        # have no zero rows either.
        with torch.no_grad():
            model.get_input_embeddings().weight[tokenizer.pad_token_id].normal_(0.0, config.initializer_range)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    from megatron_agent.models.checkpoint import atomic_directory

    with atomic_directory(out_dir) as tmp:
        with progress_bars_off():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "megatron_agent.json").write_text(
            json.dumps({"family": family, "preset": preset, "seed": seed, "tokenizer": tokenizer_kind,
                        "overrides": overrides}, indent=2)
        )
    n_params = sum(p.numel() for p in model.parameters())
    log.info("wrote %s %s (%d parameters) to %s", family, preset, n_params, out_dir)
    return out_dir
