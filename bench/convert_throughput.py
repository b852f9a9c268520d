"""Checkpoint conversion throughput on a ~1 GB model generated here.

HF -> Megatron and Megatron -> HF through megatron-agent-convert's functions, each as a
ratio of the time to simply read the same safetensors files (`safetensors.load_file`)
in the same run, plus peak resident memory of each conversion as a multiple of the
largest shard. Run: `.venv/bin/python bench/convert_throughput.py [--layers 20]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
             head_dim=64)


def run_measured(code: str) -> tuple[float, float]:
    """Run Python code in a fresh process; return (seconds of the timed part, peak RSS MiB)."""
    wrapper = (
        "import resource, time, json, sys\n"
        f"{code}\n"
        "t = time.perf_counter(); work(); dt = time.perf_counter() - t\n"
        "print(json.dumps({'s': dt, 'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n"
    )
    out = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["s"], result["rss"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--shard", default="256MB", help="shard size of the generated HF checkpoint")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="convert-bench-"))
    hf_dir, mcore_dir, back_dir = root / "hf", root / "mcore", root / "back"

    from megatron_agent.models.tiny import write_tiny_model

    single = write_tiny_model("qwen3", root / "single", num_hidden_layers=args.layers, **SIZES)
    # Re-shard the generated model like a hub checkpoint, through our own writer.
    from megatron_agent.models.bridge import SafetensorsCheckpoint
    from megatron_agent.models.checkpoint import copy_hf_side_files, write_safetensors_shards
    from tools.checkpoint_convert.cli import _size

    ckpt = SafetensorsCheckpoint(single)
    hf_dir.mkdir()
    write_safetensors_shards(((n, ckpt.get(n, "bench")) for n in sorted(ckpt.file_of)), hf_dir, _size(args.shard))
    copy_hf_side_files(single, hf_dir)
    files = sorted(hf_dir.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    largest = max(f.stat().st_size for f in files) / 2**20

    read_s, read_rss = run_measured(
        "from safetensors.torch import load_file\n"
        f"files = {[str(f) for f in files]}\n"
        "def work():\n    for f in files:\n        [t.clone() for t in load_file(f).values()]\n"
    )
    to_mcore_s, to_mcore_rss = run_measured(
        "import os; os.environ['WORLD_SIZE'] = '1'\n"
        "from tools.checkpoint_convert.convert import hf_to_mcore\n"
        "from megatron_agent.platform import ParallelConfig\n"
        f"def work():\n    hf_to_mcore({str(hf_dir)!r}, {str(mcore_dir)!r}, ParallelConfig(), dtype='fp32')\n"
    )
    to_hf_s, to_hf_rss = run_measured(
        "from tools.checkpoint_convert.convert import mcore_to_hf\n"
        f"def work():\n    mcore_to_hf({str(mcore_dir)!r}, {str(back_dir)!r}, max_shard_bytes={_size(args.shard)})\n"
    )
    gb = total / 1e9
    print(f"qwen3, {args.layers} layers, {gb:.2f} GB fp32 in {len(files)} shards (largest {largest:.0f} MiB), "
          f"{os.cpu_count()} cores")
    print(f"{'':18}{'seconds':>9}{'GB/s':>8}{'x read':>8}{'peak RSS MiB':>14}{'x largest shard':>17}")
    for name, s, rss in (("read safetensors", read_s, read_rss), ("hf -> mcore", to_mcore_s, to_mcore_rss),
                         ("mcore -> hf", to_hf_s, to_hf_rss)):
        print(f"{name:18}{s:>9.2f}{gb / s:>8.2f}{s / read_s:>8.1f}{rss:>14.0f}{rss / largest:>17.1f}")


if __name__ == "__main__":
    main()
