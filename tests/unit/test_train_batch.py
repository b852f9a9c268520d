"""TrainBatch packing and token-budget micro-batching, worked by hand."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.training.batch import (
    TrainBatch,
    micro_batches_by_tokens,
    padded_length,
    sequence_multiple,
)


def test_from_sequences_places_response_tokens_on_target_positions():
    batch = TrainBatch.from_sequences([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0,
                                      advantages=[0.5, -1.0], rollout_logprobs=[[-0.1, -0.2], [-1, -2, -3]])
    # row 0: tokens 5 6 7 1 2 ; targets (positions 0..3) 6 7 1 2 -> response at positions 2, 3
    # row 1: tokens 8 3 4 9 0 ; targets 3 4 9 0 -> response at positions 0, 1, 2
    assert batch.tokens.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert torch.allclose(batch.rollout_logprobs, torch.tensor([[0, 0, -0.1, -0.2], [-1, -2, -3, 0]]))
    assert batch.lengths.tolist() == [5, 4]
    assert batch.advantages.tolist() == [0.5, -1.0]
    picked = batch.select([1])
    assert picked.tokens.tolist() == [[8, 3, 4, 9, 0]] and picked.temperature == batch.temperature


def test_bad_sequences_are_named():
    with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
        TrainBatch.from_sequences([[1], []], [[2], [3]])
    with pytest.raises(ValueError, match="sequence 0: 1 rollout logprobs for 2 tokens"):
        TrainBatch.from_sequences([[1]], [[2, 3]], rollout_logprobs=[[-1.0]])


def test_micro_batches_respect_the_token_budget():
    lengths = torch.tensor([10, 3, 8, 4, 9, 2])
    groups = micro_batches_by_tokens(lengths, max_tokens=20)
    # longest first: 10, 9 -> 2 x 10 = 20 fits; 8, 4, 3 -> 3 x 8 = 24 does not: 8, 4 (16); 3, 2 (6)
    assert groups == [[0, 4], [2, 3], [1, 5]]
    for g in groups:
        assert len(g) * int(lengths[g].max()) <= 20
    assert sorted(i for g in groups for i in g) == list(range(6))


def test_micro_batches_split_for_pipeline_stages_and_refuse_oversize():
    groups = micro_batches_by_tokens(torch.tensor([4, 4, 4, 4]), max_tokens=100, min_count=2)
    assert len(groups) == 2 and sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="a sequence of 30 tokens exceeds the micro-batch budget 20"):
        micro_batches_by_tokens(torch.tensor([30]), max_tokens=20)


@pytest.mark.parametrize(
    "layout, multiple",
    [
        (dict(), 1),
        (dict(tp=2), 1),  # TP alone splits hidden sizes, not the sequence
        (dict(tp=2, sequence_parallel=True), 2),
        (dict(tp=4, sequence_parallel=True), 4),
        (dict(fp8=True), 16),
        (dict(tp=2, sequence_parallel=True, fp8=True), 16),  # lcm(2, 16)
        (dict(tp=3, sequence_parallel=True, fp8=True), 48),  # lcm(3, 16)
        (dict(cp=2), 4),  # 2 * cp chunks
        (dict(cp=3, tp=2, sequence_parallel=True), 6),  # lcm(2, 6)
        (dict(cp=4, tp=8, sequence_parallel=True, fp8=True), 16),  # lcm(8, 16, 8)
        (dict(cp=3, tp=4, sequence_parallel=True, fp8=True), 48),  # lcm(4, 16, 6)
    ],
)
def test_sequence_multiple_is_the_lcm_of_what_the_layout_needs(layout, multiple):
    assert sequence_multiple(**layout) == multiple


def test_padded_length_rounds_up():
    assert [padded_length(n, 4) for n in (1, 3, 4, 5, 8, 9)] == [4, 4, 4, 8, 8, 12]
    assert [padded_length(n, 1) for n in (1, 7)] == [1, 7]
    assert padded_length(17, 16) == 32


def test_micro_batch_budget_counts_the_padding():
    lengths = torch.tensor([10, 9, 8])
    # unpadded: 10 x 2 = 20 fits; padded to 16 input columns, a sequence costs 17 tokens
    assert micro_batches_by_tokens(lengths, max_tokens=20) == [[0, 1], [2]]
    assert micro_batches_by_tokens(lengths, max_tokens=20, multiple=16) == [[0], [1], [2]]
    # multiple 2: 10 tokens -> 9 columns -> 10 columns + 1 = 11 tokens each; 3 x 11 = 33
    assert micro_batches_by_tokens(lengths, max_tokens=33, multiple=2) == [[0, 1, 2]]
    assert micro_batches_by_tokens(lengths, max_tokens=32, multiple=2) == [[0, 1], [2]]
    # a sequence within the budget is never refused for its padding
    assert micro_batches_by_tokens(torch.tensor([20]), max_tokens=20, multiple=16) == [[0]]


def test_model_inputs_are_padded_on_the_right_with_counting_positions():
    from megatron_agent.training.schedule import language_model_micro_batch, pad_model_inputs

    mb = language_model_micro_batch(torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]))  # 3 input columns
    ids, positions, labels = pad_model_inputs(mb, 8)
    assert ids.tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert positions.tolist() == [list(range(8))] * 2
    assert labels.tolist() == [[6, 7, 8, 0, 0, 0, 0, 0], [2, 3, 4, 0, 0, 0, 0, 0]]
    same = pad_model_inputs(mb, 3)
    assert same[0] is mb["input_ids"] and same[2] is mb["labels"]
    no_labels = pad_model_inputs({"input_ids": mb["input_ids"], "position_ids": mb["position_ids"]}, 4)
    assert no_labels[2] is None and no_labels[0].shape == (2, 4)


def test_layout_multiple_reads_the_model_config():
    from types import SimpleNamespace

    from megatron_agent.training.schedule import layout_multiple

    def model(**config):
        fields = dict(tensor_model_parallel_size=1, sequence_parallel=False, fp8=None, fp8_recipe="delayed",
                      context_parallel_size=1)
        return SimpleNamespace(config=SimpleNamespace(**{**fields, **config}))

    assert layout_multiple([model()]) == 1
    assert layout_multiple([model(tensor_model_parallel_size=4, sequence_parallel=True)]) == 4
    assert layout_multiple([model(tensor_model_parallel_size=2, sequence_parallel=True, fp8="hybrid")]) == 16


def _three_samples():
    return TrainBatch.from_sequences([[5, 6], [7], [8, 9, 1]], [[1, 2], [3], [4, 4]], pad_id=0,
                                     advantages=[0.5, -1.0, 2.0], rollout_logprobs=[[-0.1, -0.2], [-1], [-2, -3]])


def test_dp_shards_take_every_dp_th_sample_cut_to_their_longest():
    from megatron_agent.training.batch import shard_rows

    whole = _three_samples()
    first, second = whole.dp_shards(2)
    assert shard_rows(3, 0, 2) == [0, 2] and shard_rows(3, 1, 2) == [1]
    assert first.sample_index.tolist() == [0, 2] and first.whole_size == 3 and first.is_shard
    assert torch.equal(first.tokens, whole.tokens[[0, 2]])
    assert second.tokens.tolist() == [[7, 3]]  # cut from 5 columns to its own 2
    assert second.response_mask.shape == (1, 1) and second.rollout_logprobs.tolist() == [[-1.0]]
    assert second.advantages.tolist() == [-1.0] and second.positions().tolist() == [1]
    assert not whole.is_shard and whole.positions().tolist() == [0, 1, 2] and whole.whole_batch_size() == 3
    with pytest.raises(ValueError, match="cuts a whole batch"):
        first.dp_shard(0, 2)


def test_a_shard_travels_as_tensors_and_comes_back_the_same():
    shard = _three_samples().dp_shard(0, 2)
    back = TrainBatch.from_tensors(shard.tensors())
    for name in ("tokens", "response_mask", "advantages", "rollout_logprobs", "lengths", "sample_index"):
        assert torch.equal(getattr(back, name), getattr(shard, name)), name
    assert back.temperature == shard.temperature and back.whole_size == 3 and back.old_logprobs is None


def test_more_dp_ranks_than_samples_leaves_empty_shards():
    shards = TrainBatch.from_sequences([[1]], [[2]]).dp_shards(2)
    assert shards[0].size == 1 and shards[1].size == 0 and shards[1].whole_size == 1


# --- batches with images -------------------------------------------------------------------

IMAGE = 9  # the image token id of these hand-made batches


def _image_samples():
    """Three samples with 0, 1 and 2 images; patch row k of the whole batch holds the value k.
    Sample 1: one image of grid (1, 2, 2) (4 patches, 1 token at merge 2); sample 2: grids
    (1, 2, 2) and (1, 2, 4) (4 + 8 patches, 1 + 2 tokens)."""
    rows = torch.arange(16, dtype=torch.float32).unsqueeze(1).expand(16, 2)
    images = [None, (rows[:4], torch.tensor([[1, 2, 2]])), (rows[4:], torch.tensor([[1, 2, 2], [1, 2, 4]]))]
    prompts = [[5, 6], [5, IMAGE, 6], [5, IMAGE, 6, IMAGE, IMAGE, 7]]
    return TrainBatch.from_sequences(prompts, [[1, 2], [3], [4, 4]], pad_id=0, advantages=[0.5, -1.0, 2.0],
                                     images=images)


def _patch_ids(batch):
    return batch.pixel_values[:, 0].long().tolist()


def test_images_are_packed_sample_after_sample_and_masked_out_of_the_loss():
    batch = _image_samples()
    assert batch.has_images and batch.images_per_sample.tolist() == [0, 1, 2]
    assert batch.lengths.tolist() == [4, 4, 8]  # image tokens count: the token budget sees them
    assert batch.image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 2], [1, 2, 4]]
    assert _patch_ids(batch) == list(range(16))
    targets = batch.tokens[:, 1:]
    assert int((targets == IMAGE).sum()) == 4 and not batch.response_mask[targets == IMAGE].any()
    text = _three_samples()
    assert not text.has_images and not set(text.tensors()) & {"pixel_values", "image_grid_thw",
                                                               "images_per_sample"}


def test_each_sample_keeps_its_own_images_through_select_shards_and_tensors():
    batch = _image_samples()
    picked = batch.select([2, 0])
    assert picked.images_per_sample.tolist() == [2, 0] and _patch_ids(picked) == list(range(4, 16))
    assert picked.image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 4]]
    first, second = batch.dp_shards(2)  # rows [0, 2] and [1]
    assert first.images_per_sample.tolist() == [0, 2] and _patch_ids(first) == list(range(4, 16))
    assert second.images_per_sample.tolist() == [1] and _patch_ids(second) == [0, 1, 2, 3]
    assert second.image_grid_thw.tolist() == [[1, 2, 2]] and second.tokens.tolist() == [[5, IMAGE, 6, 3]]
    back = TrainBatch.from_tensors(first.tensors())
    for name in ("pixel_values", "image_grid_thw", "images_per_sample", "tokens", "sample_index"):
        assert torch.equal(getattr(back, name), getattr(first, name)), name
    empty = TrainBatch.from_sequences([[1]], [[2]], images=[(torch.ones(4, 2), torch.tensor([[1, 2, 2]]))])
    nothing = empty.dp_shards(2)[1]
    assert nothing.size == 0 and nothing.pixel_values.shape == (0, 2) and nothing.image_grid_thw.shape == (0, 3)


def test_micro_batch_images_give_mrope_positions_and_only_their_samples_images():
    from megatron_agent.training.batch import micro_batch_images

    batch = _image_samples()
    hf = {"image_token_id": IMAGE, "vision_config": {"spatial_merge_size": 2}}
    rows = torch.tensor([2, 1])
    ids = batch.tokens[rows, :7]
    mb = micro_batch_images(batch, rows, ids, hf)
    assert mb["pixel_values"][:, 0].long().tolist() == list(range(4, 16)) + [0, 1, 2, 3]
    assert mb["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 2]]
    # row 2: 5 | image (1x1 merged) at 1 | 6 at 2 | image 1x2 at 3: (3,3,3), (3,3,4) | 7 at 5 ...
    assert mb["position_ids"][:, 0].tolist() == [[0, 1, 2, 3, 3, 5, 6], [0, 1, 2, 3, 3, 5, 6],
                                                 [0, 1, 2, 3, 4, 5, 6]]
    assert mb["position_ids"][:, 1].tolist() == [[0, 1, 2, 3, 4, 5, 6]] * 3  # 1x1 image: like text
    assert mb["image_mask"].tolist() == [[False, True, False, True, True, False, False],
                                         [False, True, False, False, False, False, False]]
    text_only = micro_batch_images(batch, torch.tensor([0]), batch.tokens[[0], :3], hf)
    assert set(text_only) == {"position_ids", "image_mask"} and not text_only["image_mask"].any()
    assert text_only["position_ids"].tolist() == [[[0, 1, 2]]] * 3
    with pytest.raises(ValueError, match="not a vision-language model"):
        micro_batch_images(batch, rows, ids, {})


def test_image_tokens_the_policy_generated_are_text():
    """A tiny policy trained from scratch samples the image token now and then; the engine
    embedded it as a text token at a text position, so the trainer must too."""
    from megatron_agent.training.batch import micro_batch_images

    grid = torch.tensor([[1, 2, 2]])
    batch = TrainBatch.from_sequences([[5, IMAGE, 6], [5, 6]], [[IMAGE, 3], [IMAGE]], pad_id=0,
                                      images=[(torch.ones(4, 2), grid), None])
    hf = {"image_token_id": IMAGE, "vision_config": {"spatial_merge_size": 2}}
    rows = torch.tensor([0, 1])
    mb = micro_batch_images(batch, rows, batch.tokens[rows, :4], hf)
    assert mb["image_mask"].tolist() == [[False, True, False, False], [False, False, False, False]]
    assert mb["position_ids"][0].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]  # the generated one counts on as text
    assert mb["image_grid_thw"].tolist() == [[1, 2, 2]]


def test_bad_images_are_named():
    grid = torch.tensor([[1, 2, 2]])
    with pytest.raises(ValueError, match=r"sample 0: 3 pixel rows for image grids \[\[1, 2, 2\]\] \(4 patches\)"):
        TrainBatch.from_sequences([[1]], [[2]], images=[(torch.ones(3, 2), grid)])
    with pytest.raises(ValueError, match="images given for 1 samples, the batch has 2"):
        TrainBatch.from_sequences([[1], [1]], [[2], [2]], images=[(torch.ones(4, 2), grid)])
    with pytest.raises(ValueError, match="needs all of"):
        TrainBatch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1), pixel_values=torch.ones(4, 2))
    with pytest.raises(ValueError, match="images_per_sample counts 2 images, image_grid_thw has 1"):
        TrainBatch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1), pixel_values=torch.ones(4, 2),
                   image_grid_thw=grid, images_per_sample=torch.tensor([2]))


def test_train_batch_takes_each_step_samples_images():
    from types import SimpleNamespace

    from tests.unit.test_samples import train_batch

    def step(prompt, pixels=None, grid=None):
        return SimpleNamespace(prompt_ids=prompt, response_ids=[4], rollout_logprobs=[-0.5],
                               pixel_values=pixels, image_grid_thw=grid, step_index=0,
                               routed_experts=None)

    pixels = torch.arange(16, dtype=torch.float32).reshape(8, 2)
    samples = [step([5, IMAGE, 7], pixels[:4], torch.tensor([[1, 2, 2]])), step([5]),
               step([IMAGE, 6], pixels[4:], torch.tensor([[1, 2, 2]]))]
    batch = train_batch(samples)
    assert batch.images_per_sample.tolist() == [1, 0, 1] and torch.equal(batch.pixel_values, pixels)
    assert batch.image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 2]]
    assert _patch_ids(batch.select([2])) == [8, 10, 12, 14]
    assert not train_batch([step([5]), step([6])]).has_images
