"""megatron-agent-convert: HF <-> Megatron checkpoints (a thin CLI over convert.py).

    megatron-agent-convert hf-to-mcore --hf DIR --out DIR [--dtype bf16|fp32|fp16] [--tp N --pp N --ep N --etp N]
    megatron-agent-convert mcore-to-hf --mcore DIR --out DIR [--hf-config DIR] [--dtype ...] [--base DIR]
                                       [--quantize fp8|nvfp4 [--calib FILE]]
    megatron-agent-convert lora-to-peft --mcore DIR --out DIR   # a LoRA checkpoint's adapters, for PEFT
    megatron-agent-convert verify --hf DIR --mcore DIR [--tp N --pp N --ep N] [--tolerance X]

The dtype defaults to the source checkpoint's own; a conversion that changes it says so.
hf-to-mcore's checkpoint loads at any layout: the layout flags only check that the model
divides at the layout it will be loaded at.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from megatron_agent.models.checkpoint import read_mcore_metadata


def _holds_lora(mcore_dir: str) -> bool:
    """A checkpoint of LoRA adapters (a path that is no checkpoint is left to the conversion's own checks)."""
    meta = Path(mcore_dir) / "megatron_agent.json"
    return meta.is_file() and "lora" in read_mcore_metadata(Path(mcore_dir))


def _layout_args(p):
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)


def _parallel(args):
    from megatron_agent.platform import ParallelConfig

    return ParallelConfig(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-agent-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint (torch_dist)")
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"],
                   help="default: the checkpoint's (config.json torch_dtype)")
    _layout_args(p)

    p = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors + config + tokenizer")
    p.add_argument("--mcore", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hf-config", default=None, help="where config/tokenizer come from (default: MCORE/hf)")
    p.add_argument("--base", default=None, metavar="DIR", help="a LoRA checkpoint's base model (default: the "
                   "directory it names); the adapters are merged into it")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="default: the checkpoint's")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--quantize", default=None, choices=["fp8", "nvfp4"],
                   help="write a ModelOpt-quantized checkpoint (the [quantize] extra; docs/models.md)")
    p.add_argument("--calib", default=None, metavar="FILE",
                   help="calibration texts for --quantize: one per line, or .jsonl with a \"text\" field "
                        "(default: a small shipped set)")

    p = sub.add_parser("lora-to-peft", help="a LoRA checkpoint's adapters -> a PEFT adapter for its HF base")
    p.add_argument("--mcore", required=True)
    p.add_argument("--out", required=True)

    p = sub.add_parser("verify", help="compare HF and Megatron logits on the same tokens")
    p.add_argument("--hf", required=True)
    p.add_argument("--mcore", required=True)
    p.add_argument("--tolerance", type=float, default=None,
                   help="max |logit diff| allowed (default 1e-4 for fp32, 5e-2 for bf16/fp16)")
    _layout_args(p)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)

    from megatron_agent.platform.launch import RankFailed
    from tools.checkpoint_convert import convert

    try:
        if args.command == "hf-to-mcore":
            convert.hf_to_mcore(args.hf, args.out, _parallel(args), dtype=args.dtype)
            print(f"wrote {args.out}")
        elif args.command == "mcore-to-hf" and args.quantize and _holds_lora(args.mcore):
            print(f"error: {args.mcore} holds LoRA adapters: merge them first (mcore-to-hf without --quantize), "
                  "then hf-to-mcore the merged model and quantize that", file=sys.stderr)
            return 2
        elif args.command == "mcore-to-hf" and args.quantize:
            from tools.checkpoint_convert import quantize

            quantize.mcore_to_quantized_hf(args.mcore, args.out, args.quantize, calib=args.calib,
                                           hf_config_dir=args.hf_config, dtype=args.dtype,
                                           max_shard_bytes=_size(args.max_shard_size))
            print(f"wrote {args.out}")
        elif args.command == "lora-to-peft":
            convert.lora_to_peft(args.mcore, args.out)
            print(f"wrote {args.out}")
        elif args.command == "mcore-to-hf":
            convert.mcore_to_hf(args.mcore, args.out, hf_config_dir=args.hf_config, dtype=args.dtype,
                                max_shard_bytes=_size(args.max_shard_size), base_dir=args.base)
            print(f"wrote {args.out}")
        else:
            result = convert.verify(args.hf, args.mcore, _parallel(args))
            tolerance = args.tolerance or (1e-4 if result["dtype"] == "fp32" else 5e-2)
            ok = result["max_abs_diff"] <= tolerance
            print(f"max |logit diff| {result['max_abs_diff']:.3e}  cosine {result['cosine']:.8f}  "
                  f"({result['dtype']}, tolerance {tolerance:g}): {'OK' if ok else 'FAIL'}")
            return 0 if ok else 1
    except RankFailed as err:
        print(f"error: {str(err).strip().splitlines()[-1]}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
