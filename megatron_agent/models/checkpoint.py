"""Checkpoint primitives shared by the trainer, the tiny-model writer and the converter.

A Megatron checkpoint written by this project is a directory:

    <out>/                   dist_checkpointing files (reshardable to any TP/PP/EP on load)
    <out>/hf/                the source's config.json, generation config and tokenizer files
    <out>/megatron_agent.json  what wrote it: family, dtype, the layout it was saved at

Every writer works in a temporary sibling directory (`atomic_directory`) and renames it
at the end, so a failure leaves nothing half-written. The conversions themselves
(hf_to_mcore, mcore_to_hf, verify) are in tools/checkpoint_convert/convert.py.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
    "added_tokens.json", "preprocessor_config.json",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def hf_config_dtype(hf: dict) -> str | None:
    """The dtype an HF config.json declares (`torch_dtype`, or `dtype` in newer
    transformers) as a DTYPES name; None when it declares none we know."""
    declared = hf.get("torch_dtype") or hf.get("dtype")
    return DTYPE_NAMES.get(getattr(torch, declared, None)) if isinstance(declared, str) else None


@contextmanager
def atomic_directory(out_dir: str | Path):
    """Yield a temporary directory next to `out_dir`; rename it to `out_dir` on success."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_hf_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def read_mcore_metadata(mcore_dir: Path) -> dict:
    meta = mcore_dir / "megatron_agent.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{mcore_dir} has no megatron_agent.json: not written by hf-to-mcore or the trainer")
    return json.loads(meta.read_text())


def model_state(chunks: list) -> dict:
    """The sharded state of model chunks under labels that do not depend on the layout
    (dist_checkpointing matches tensors by their own global keys, not by these labels)."""
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def load_mcore_checkpoint(chunks: list, mcore_dir: str | Path) -> None:
    """Fill model chunks from a dist checkpoint, at whatever layout they were built."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(model_state(chunks), str(mcore_dir))
    for i, c in enumerate(chunks):
        c.load_state_dict(loaded[f"model{i}"])
