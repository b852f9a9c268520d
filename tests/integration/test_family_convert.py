"""The config of issue 32 through the converter: a Qwen2.5-VL config.json carrying
head_dim 32 beside hidden 96 over 6 heads (which transformers' Qwen2.5-VL attention
ignores: 16 per head) failed hf-to-mcore with a shape error. transformers writes the
model from that config; it converts, and the Megatron checkpoint's logits are
transformers'. (Every family's reading, without converting: tests/unit/test_family_config_reading.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit.test_family_config_reading import CONFIGS, transformers_model

CONVERT_AND_VERIFY = """
import json, sys
from tools.checkpoint_convert.convert import hf_to_mcore, verify
from megatron_agent.platform.parallel import ParallelConfig
if __name__ == "__main__":
    hf_to_mcore(sys.argv[1], sys.argv[2])
    print(json.dumps(verify(sys.argv[1], sys.argv[2], ParallelConfig())))
"""


def test_a_qwen2_5_vl_config_with_a_stray_head_dim_converts_to_transformers_logits(tmp_path):
    model = transformers_model(CONFIGS["qwen2_5_vl"])
    model.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["head_dim"] == 32 and model.model.language_model.layers[0].self_attn.head_dim == 16
    out = subprocess.run([sys.executable, "-c", CONVERT_AND_VERIFY, str(tmp_path / "hf"), str(tmp_path / "mcore")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    logits = json.loads(out.stdout.strip().splitlines()[-1])
    assert logits["max_abs_diff"] < 1e-4 and logits["cosine"] > 0.9999, logits
