"""Checkpoint conversion against a plain copy of the same bytes, on a ~1 GB model made here.

Each measurement runs in a fresh process: a plain copy of the HF safetensors files into
another folder (read, write, fsync), `hf_to_mcore` and `mcore_to_hf` (whose outputs are
fsync'd too). The timed part of each starts after its imports (torch, Megatron-Core:
seconds of process start, reported on their own line). Each is run `--repeats` times and
the fastest run counts; the ratios are copy seconds / conversion seconds (1.0: as fast
as copying). Peak RSS is the process's own peak (VmHWM), imports included.

Run: `.venv/bin/python bench/convert_throughput.py [--layers 20] [--repeats 3]`; it says
at the start what that takes. `--quick`: the tiny preset, one layer, once (the script end
to end; measures nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_RUN_S = 90  # the whole script at its defaults, measured on 2 cores shared with another job (load ~2-3)
SIZES = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
             head_dim=64)

WRAPPER = """
import json, time
def peak_rss_mib():  # this process's own peak (ru_maxrss would carry the parent's over exec)
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024
t = time.perf_counter()
{setup}
imported = time.perf_counter() - t
rss_after_imports = peak_rss_mib()
t = time.perf_counter()
work()
print(json.dumps({{"s": time.perf_counter() - t, "imports_s": imported, "rss_after_imports": rss_after_imports,
                  "rss": peak_rss_mib()}}))
"""

COPY = """
import os
from pathlib import Path
def work():
    out = Path({out!r})
    out.mkdir(parents=True, exist_ok=True)
    for src in {files!r}:
        with open(src, "rb") as f, open(out / Path(src).name, "wb") as g:
            while block := f.read(64 << 20):
                g.write(block)
            g.flush()
            os.fsync(g.fileno())
"""

TO_MCORE = """
import megatron.core.models.gpt, megatron_agent.models.builder
from tools.checkpoint_convert.convert import hf_to_mcore
def work():
    hf_to_mcore({hf!r}, {out!r})
"""

TO_HF = """
import megatron.core.models.gpt, megatron_agent.models.builder
from tools.checkpoint_convert.convert import mcore_to_hf
def work():
    mcore_to_hf({mcore!r}, {out!r}, max_shard_bytes={shard})
"""


def run_measured(setup: str) -> dict:
    """Run `setup` (defining `work()`) in a fresh process; its timing and peak RSS (MiB)."""
    code = WRAPPER.format(setup=setup)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_model(root: Path, layers: int, shard: int, sizes: dict) -> Path:
    """A qwen3 model in fp32 (`sizes` over the tiny preset's), re-sharded like a hub checkpoint."""
    from megatron_agent.models.bridge import SafetensorsCheckpoint
    from megatron_agent.models.checkpoint import copy_hf_side_files
    from megatron_agent.models.safetensors_io import TensorSpec, write_streamed_shards
    from megatron_agent.models.tiny import write_tiny_model

    single = write_tiny_model("qwen3", root / "single", num_hidden_layers=layers, **sizes)
    hf_dir = root / "hf"
    hf_dir.mkdir()
    ckpt = SafetensorsCheckpoint(single)
    names = sorted(ckpt.file_of)
    specs = [TensorSpec(n, ckpt.entry(n, "bench").shape, ckpt.entry(n, "bench").dtype) for n in names]
    write_streamed_shards(specs, ((n, ckpt.get(n, "bench")) for n in names), hf_dir, shard)
    copy_hf_side_files(single, hf_dir)
    shutil.rmtree(single)
    return hf_dir


def main() -> None:
    from tools.checkpoint_convert.cli import _size

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--shard", default="256MB", help="shard size of the generated HF checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny preset, 1 layer, 1 repeat: measures nothing")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.repeats = 1, 1
    print(f"convert_throughput: {args.layers} layers, {args.repeats} repeat(s) of a copy and two conversions, each in "
          f"a fresh process; at the defaults (20 layers, 3 repeats) about {DEFAULT_RUN_S} s on 2 cores", flush=True)
    shard = _size(args.shard)
    root = Path(tempfile.mkdtemp(prefix="convert-bench-"))
    try:
        hf_dir = make_model(root, args.layers, shard, {} if args.quick else SIZES)
        files = sorted(str(f) for f in hf_dir.glob("*.safetensors"))
        total = sum(os.path.getsize(f) for f in files)
        largest = max(os.path.getsize(f) for f in files) / 2**20
        mcore_dir, back_dir, copy_dir = root / "mcore", root / "back", root / "copy"
        runs: dict[str, list[dict]] = {"plain copy": [], "hf -> mcore": [], "mcore -> hf": []}
        for _ in range(args.repeats):  # every output folder is new: no deleting inside a timed run
            runs["plain copy"].append(run_measured(COPY.format(out=str(copy_dir), files=files)))
            shutil.rmtree(copy_dir)
            shutil.rmtree(mcore_dir, ignore_errors=True)
            runs["hf -> mcore"].append(run_measured(TO_MCORE.format(hf=str(hf_dir), out=str(mcore_dir))))
            runs["mcore -> hf"].append(run_measured(TO_HF.format(mcore=str(mcore_dir), out=str(back_dir),
                                                                 shard=shard)))
            shutil.rmtree(back_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb, model_mib = total / 1e9, total / 2**20
    best = {name: min(r["s"] for r in rs) for name, rs in runs.items()}
    peak = {name: max(r["rss"] for r in rs) for name, rs in runs.items()}
    print(f"qwen3, {args.layers} layers, {gb:.2f} GB fp32 in {len(files)} shards (largest {largest:.0f} MiB), "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, best of {args.repeats}")
    print(f"{'':14}{'seconds':>9}{'GB/s':>7}{'x copy':>8}{'runs (s)':>24}{'imports s':>11}"
          f"{'peak RSS MiB':>14}{'x shard':>9}{'x model':>9}{'after imports':>15}")
    for name, rs in runs.items():
        s, rss = best[name], peak[name]
        after = max(r["rss_after_imports"] for r in rs)
        each = " ".join(f"{r['s']:.2f}" for r in rs)
        print(f"{name:14}{s:>9.2f}{gb / s:>7.2f}{best['plain copy'] / s:>8.2f}"
              f"{each:>24}{min(r['imports_s'] for r in rs):>11.2f}"
              f"{rss:>14.0f}{rss / largest:>9.2f}{rss / model_mib:>9.2f}{after:>15.0f}")
    r1, r2 = best["plain copy"] / best["hf -> mcore"], best["plain copy"] / best["mcore -> hf"]
    p = max(peak["hf -> mcore"], peak["mcore -> hf"])
    print(f"peak RSS of the conversions: {p / model_mib:.2f} of one model copy ({model_mib:.0f} MiB)")
    print(f"convert: hf-to-mcore {r1:.2f} of a plain copy, mcore-to-hf {r2:.2f} of a plain copy, "
          f"peak RSS {p / largest:.2f} x largest shard")


if __name__ == "__main__":
    main()
