"""The real SGLang server (0.5.23, on CPU, from its own venv) serving a tiny Qwen3-VL,
against transformers' own model and image processor:

- `/generate` with `input_ids` holding one `<|image_pad|>` per image and `image_data`
  (PNG data URLs): SGLang expands each pad itself, so `meta_info.prompt_tokens` is the
  expanded length, and greedy logprobs of prompts with 0, 1 and 2 images equal a
  teacher-forced forward (1e-5);
- `/update_weights_from_distributed` (gloo, per tensor) under the checkpoint's own names,
  vision tower and language model: the server then equals transformers on the changed
  checkpoint, for the same images as before the update.

What the server needs for a vision model on CPU, which `rollout.engine_launch` adds for
one (besides the text model's flags): `--image-processor-backend pil` (transformers' default backend is torchvision's, a
placeholder here), `--mm-attention-backend sdpa` for the vision tower, and
`SGLANG_VLM_CACHE_SIZE_MB=0`: SGLang 0.5.23 caches vision embeddings by image hash and
neither a weight update nor /flush_cache clears that cache, so without it an image seen
before an update keeps its old embedding. One server, started once (about a minute).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.engine_client import EngineClient, http_json
from rollout.engine_launch import start_sglang_cpu_server
from rollout.processes import free_port
from rollout.vision import encode_image_data
from rollout.weight_group import destroy_weight_update_group, dtype_name, init_weight_update_group
from tests.integration.rollout.test_sglang import SERVER_ARGS, START_TIMEOUT_S, sglang_python  # noqa: F401
from tests.vlm_batch import perturbed_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sglang_cpu")]

FAMILY = "qwen3_vl"
IMAGE_SIZES = [(56, 56), (60, 120), (64, 40)]  # (height, width)
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_agent.models.tiny import write_tiny_vlm

    return write_tiny_vlm(FAMILY, tmp_path_factory.mktemp("sglang-vlm") / FAMILY)


@pytest.fixture(scope="module")
def server(sglang_python, model_dir, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    server = start_sglang_cpu_server(model_dir, python=sglang_python, extra_args=SERVER_ARGS,
                                     log_dir=tmp_path_factory.mktemp("sglang-vlm-logs"), timeout_s=START_TIMEOUT_S)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' model, tokenizer and image processor, loaded on their own."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    torch.set_num_threads(1)
    return (AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir))


def rows(tok, seed=7, images_per_row=(0, 1, 2)):
    """(ids with one pad per image, the images as arrays) per row."""
    rng = np.random.default_rng(seed)
    out = []
    for row, n in enumerate(images_per_row):
        parts = [{"type": "image"}] * n + [{"type": "text", "text": "what is in room " + " push" * (3 * row + 1)}]
        ids = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=True, add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        images = [rng.integers(0, 256, (*IMAGE_SIZES[(row + i) % 3], 3), dtype=np.uint8) for i in range(n)]
        out.append((list(ids), images))
    return out


def teacher_forced(reference, ids, images, output) -> tuple[int, torch.Tensor, list[int]]:
    """(expanded prompt length, logprobs of `output`, transformers' argmax at each output
    position): the processor's grid gives each pad's count, t*h*w / merge**2."""
    from PIL import Image

    model, tok, processor = reference
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    expanded, extra = ids, {}
    if images:
        out = processor(images=[Image.fromarray(im) for im in images], return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist())
        expanded = [t for i in ids for t in ([pad] * next(counts) if i == pad else [i])]
        extra = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    full = torch.tensor([expanded + output])
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), mm_token_type_ids=(full == pad).int(),
                       **extra).logits[0, len(expanded) - 1:-1].float()
    lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    return len(expanded), lps, logits.argmax(-1).tolist()


def generate(server, batch) -> list[dict]:
    body = {"input_ids": [ids for ids, _ in batch], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            "image_data": [[encode_image_data(im) for im in images] for _, images in batch]}
    status, outs = http_json("POST", server.url + "/generate", body, timeout_s=300)
    assert status == 200, outs
    return outs


def logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def assert_matches_reference(server, reference, batch) -> list[dict]:
    outs = generate(server, batch)
    for (ids, images), out in zip(batch, outs):
        assert len(out["output_ids"]) == NEW_TOKENS
        expanded_len, expected, argmax = teacher_forced(reference, ids, images, out["output_ids"])
        assert out["meta_info"]["prompt_tokens"] == expanded_len, (len(ids), len(images))
        torch.testing.assert_close(logprobs(out), expected, atol=1e-5, rtol=0)
        assert out["output_ids"] == argmax
    return outs


def load_from_disk(server, model_dir) -> None:
    status, answer = http_json("POST", server.url + "/update_weights_from_disk", {"model_path": str(model_dir)},
                               timeout_s=120)
    assert status == 200 and answer["success"], answer


def test_image_prompts_equal_transformers(server, reference):
    batch = rows(reference[1])
    outs = assert_matches_reference(server, reference, batch)
    two_images = outs[2]["meta_info"]["prompt_tokens"]
    assert two_images >= len(batch[2][0]) - 2 + 2 * 4  # each pad became >= 4 image tokens

    # the pixels reach the model: the same ids with other images score differently
    other = [(ids, [255 - im for im in images]) for ids, images in batch[1:]]
    for before, after in zip(outs[1:], assert_matches_reference(server, reference, other)):
        moved = float((logprobs(before) - logprobs(after)).abs().max())
        assert before["output_ids"] != after["output_ids"] or moved > 1e-4, moved

    # the project's client sends the same request and checks the expanded length
    client = EngineClient([server.url])
    try:
        via_client = client.generate(
            [ids for ids, _ in batch], {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            image_data=[[encode_image_data(im) for im in images] for _, images in batch],
            prompt_tokens=[o["meta_info"]["prompt_tokens"] for o in outs])
    finally:
        client.close()
    for out, got in zip(outs, via_client):
        assert got.output_ids == out["output_ids"]
        torch.testing.assert_close(torch.tensor(got.logprobs), logprobs(out), atol=1e-6, rtol=0)


def send_per_tensor(url: str, tensors: dict[str, torch.Tensor], version: str) -> None:
    """This process as rank 0 of a gloo weight-update group with the server: one
    /update_weights_from_distributed per tensor, inside begin/end_weight_update."""
    client = EngineClient([url])
    port, group = free_port(), "vlm-test"
    joined, world_size = client.init_weights_update_group("127.0.0.1", port, group, backend="gloo",
                                                          ranks_per_server=1)
    pg = init_weight_update_group("127.0.0.1", port, 0, world_size, group, timeout_s=120)
    try:
        assert all(a["success"] for a in joined.result()), joined.result()
        client.begin_weight_update()
        try:
            for name, t in tensors.items():
                answer = client.update_weights_from_distributed([name], [dtype_name(t.dtype)], [list(t.shape)], group,
                                                               weight_version=version)
                torch.distributed.broadcast(t.contiguous(), src=0, group=pg)
                assert all(a["success"] for a in answer.result()), (name, answer.result())
        finally:
            client.end_weight_update()
    finally:
        client.destroy_weights_update_group(group)  # the server outlives this sender
        destroy_weight_update_group(pg)
        client.close()


def test_weight_update_under_checkpoint_names(server, reference, model_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    changed = perturbed_checkpoint(model_dir, tmp_path / "perturbed")
    perturbed = AutoModelForImageTextToText.from_pretrained(tmp_path / "perturbed", dtype=torch.float32).eval()
    batch = rows(reference[1], seed=11)
    before = assert_matches_reference(server, reference, batch)
    try:
        send_per_tensor(server.url, changed, version="1")
        # the same images as before the update: their embeddings must be recomputed
        after = assert_matches_reference(server, (perturbed, *reference[1:]), batch)
        assert {o["meta_info"]["weight_version"] for o in after} == {"1"}
        for b, a in zip(before[1:], after[1:]):  # image rows: the vision tower's update shows
            moved = float((logprobs(b) - logprobs(a)).abs().max())
            assert b["output_ids"] != a["output_ids"] or moved > 1e-3, moved
    finally:  # back to the weights on disk
        load_from_disk(server, model_dir)
    assert_matches_reference(server, reference, batch)


def _visual_job(overrides: list[str]) -> list[dict]:
    from megatron_agent.driver import train
    from megatron_agent.run_config import load_run_config

    return train(load_run_config(overrides))


def test_visual_job_against_sglang(server, model_dir, tmp_path):
    """The visual CPU job with this server as its engine: images go as `image_data`, and
    after each weight sync the server's logprobs equal the actor's within 1e-4."""
    from megatron_agent.platform.launch import run_on_ranks

    load_from_disk(server, model_dir)  # the driver's first check holds the served weights to the disk's
    history = run_on_ranks(_visual_job, 1, ["+experiment=visual-quiz", f"run_dir={tmp_path / 'run'}",
                                            f"model_dir={model_dir}", f"engine.urls=['{server.url}']",
                                            "num_groups=2", "group_size=2", "iterations=2", "stop_success=null",
                                            "val_every=0", "save_every=0", "samples_every=0"], timeout_s=600)[0]
    assert [row["iteration"] for row in history] == [0, 1]
    for row in history:
        assert row["weight_sync/bytes"] > 0 and row["train/num_samples"] == 4
        assert row["check/rollout_logprob_max_abs_diff"] <= 1e-4, row
