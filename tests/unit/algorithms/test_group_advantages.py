"""Workers that own whole groups: partial -> combine -> finish on each part equals
compute_advantages on the whole batch, for every estimator."""

import math

import numpy as np
import pytest

from megatron_agent.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AlgorithmConfig,
    Moments,
    StepSamples,
    combine_moments,
    compute_advantages,
    finish_advantages,
    moments_of,
    partial_advantages,
)

TEXTS = ["go north", "go nurth", "go south", "open door", "open doors"]
N_GROUPS = 6
# Each split: its parts, each (the groups it owns, the padding rows it holds: positions in the padding list).
SPLITS = {
    "one worker": [(range(N_GROUPS), [0, 1, 2])],
    "two, one of them a single group": [({2}, []), ({0, 1, 3, 4, 5}, [0, 1, 2])],
    "three, one of padding only": [({0, 1, 2, 3, 5}, [0]), ({4}, []), ((), [1, 2])],
    "three, one empty": [({0, 1}, []), ((), []), ({2, 3, 4, 5}, [0, 1, 2])],
}
VARIANTS = [  # (config fields, which optional columns the batch carries)
    (
        {"gigpo_mode": "mean_std_norm", "episode_stats": "per_trajectory", "similarity_threshold": 0.8},
        {"episode_scores": True, "reward_penalty": False},
    ),
    (
        {"gae_whiten": False, "gamma": 1.0, "invalid_action_penalty": 0.5},
        {"episode_scores": False, "reward_penalty": True},
    ),
]
BATCH_WHITENED = {"reinforce_pp", "reinforce_pp_baseline", "gae"}  # gae: with gae_whiten


def random_batch(seed: int) -> dict[str, np.ndarray]:
    """Columns of N_GROUPS groups of 2-4 trajectories of 1-5 steps (shuffled), then 3 padding
    copies of real rows with a reward no statistic may see."""
    rng = np.random.default_rng(seed)
    rows = []
    for group in range(N_GROUPS):
        for traj in range(rng.integers(2, 5)):  # traj ids repeat across groups: a trajectory is (group, traj)
            score, length = rng.normal(), rng.integers(1, 6)
            for step in range(length):
                final = rng.normal() if step == length - 1 and rng.random() < 0.5 else 0.0
                rows.append((group, traj, step, rng.normal(1.0, 3.0), score + 0.1 * rng.normal(),
                             rng.choice(TEXTS), rng.random() > 0.25, rng.normal(), final, 0.2 * rng.random(), False))  # fmt: skip
    rows = [rows[i] for i in rng.permutation(len(rows))]
    for i in rng.choice(len(rows), 3, replace=False):
        rows.append((*rows[i][:3], 50.0, 50.0, *rows[i][5:10], True))
    names = ["group_ids", "traj_ids", "step_index", "rewards", "episode_scores", "anchors", "is_action_valid",
             "values", "final_values", "reward_penalty", "is_padding"]  # fmt: skip
    columns = {name: np.array([row[k] for row in rows]) for k, name in enumerate(names)}
    columns["anchors"] = columns["anchors"].astype(object)
    return columns


def samples_of(columns: dict[str, np.ndarray], rows: np.ndarray, **carried: bool) -> StepSamples:
    """The rows' samples, without the optional columns ``carried`` says the batch lacks."""
    picked = {name: column[rows] for name, column in columns.items()}
    for name, present in carried.items():
        if not present:
            picked[name] = None
    return StepSamples(**picked)


def part_rows(columns: dict[str, np.ndarray], groups, padding: list[int]) -> np.ndarray:
    """The rows of a part, in batch order: its groups' real samples and the padding rows it holds."""
    padding_rows = np.flatnonzero(columns["is_padding"])
    owned = ~columns["is_padding"] & np.isin(columns["group_ids"], list(groups))
    owned[padding_rows[padding]] = True
    return np.flatnonzero(owned)


def config_and_flags(name: str, variant: int) -> tuple[AlgorithmConfig, dict[str, bool]]:
    fields, carried = VARIANTS[variant]
    config = AlgorithmConfig(
        **{
            "advantage_estimator": name,
            "gamma": 0.9,
            "gae_lambda": 0.8,
            "invalid_action_penalty": 0.2,
            **fields,
        }
    )
    return config, carried


@pytest.fixture(scope="module")
def batch():
    return random_batch(seed=7)


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_workers_owning_whole_groups_reproduce_the_whole_batch(batch, name, variant):
    config, flags = config_and_flags(name, variant)
    whole = compute_advantages(samples_of(batch, np.arange(len(batch["rewards"])), **flags), config)
    needs_moments = name in BATCH_WHITENED and (name != "gae" or config.gae_whiten)
    for split, parts in SPLITS.items():
        rows = [part_rows(batch, groups, padding) for groups, padding in parts]
        assert sorted(np.concatenate(rows).tolist()) == list(range(len(batch["rewards"])))  # a partition
        partials = [partial_advantages(samples_of(batch, r, **flags), config) for r in rows]
        assert [p.moments is not None for p in partials] == [needs_moments] * len(parts), split
        moments = combine_moments([p.moments for p in partials])
        finished = [finish_advantages(p, moments, config) for p in partials]
        order = np.concatenate(rows)
        for field in ("advantages", "returns"):
            together = np.concatenate([getattr(f, field) for f in finished])
            np.testing.assert_allclose(together, getattr(whole, field)[order], rtol=1e-12, atol=1e-12,
                                       err_msg=f"{split}: {field}")  # fmt: skip


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_a_part_s_advantages_do_not_depend_on_the_other_groups(batch, name, variant):
    """Per-group estimators: a part's advantages are final, whatever the other groups are. The
    batch-whitened ones: they are not, so whitening a part with its own moments is wrong."""
    config, flags = config_and_flags(name, variant)
    mine = part_rows(batch, {1, 3}, [0])
    part = partial_advantages(samples_of(batch, mine, **flags), config)
    for others in ({0}, {2, 4, 5}, {0, 2, 4, 5}):
        together = np.union1d(mine, part_rows(batch, others, [1]))
        whole = compute_advantages(samples_of(batch, together, **flags), config).advantages
        mine_in_whole = whole[np.searchsorted(together, mine)]
        if part.moments is not None:
            alone = finish_advantages(part, part.moments, config).advantages
            assert np.abs(alone - mine_in_whole).max() > 1e-3
        else:
            np.testing.assert_allclose(finish_advantages(part, None, config).advantages, mine_in_whole,
                                       rtol=1e-12, atol=1e-12)  # fmt: skip


def test_whitening_over_two_workers_by_hand():
    # REINFORCE++, gamma 1, one-step trajectories: worker A holds G [1, 2], worker B [3, 6] and a
    # padding row. Batch: mean 3, deviations [-2, -1, 0, 3], m2 14, std (n-1) sqrt(14/3).
    # A: count 2, mean 1.5, m2 .5; B: count 2, mean 4.5, m2 4.5; combined: delta 3,
    # mean 1.5 + 3 * 2/4 = 3, m2 .5 + 4.5 + 9 * 2 * 2/4 = 14.
    eps = 1e-6
    config = AlgorithmConfig(advantage_estimator="reinforce_pp", gamma=1.0, adv_eps=eps)
    a = StepSamples(group_ids=[0, 1], traj_ids=[0, 0], step_index=[0, 0], rewards=[1.0, 2.0])
    b = StepSamples(group_ids=[2, 3, 3], traj_ids=[0, 0, 0], step_index=[0, 0, 0], rewards=[3.0, 6.0, 40.0],
                    is_padding=[False, False, True])  # fmt: skip
    part_a, part_b = partial_advantages(a, config), partial_advantages(b, config)
    assert part_a.moments == Moments(2, 1.5, 0.5) and part_b.moments == Moments(2, 4.5, 4.5)
    moments = combine_moments([part_a.moments, part_b.moments])
    assert moments == Moments(4, 3.0, 14.0)
    std = math.sqrt(14 / 3)
    np.testing.assert_allclose(
        finish_advantages(part_a, moments, config).advantages, np.array([-2, -1]) / (std + eps)
    )
    np.testing.assert_allclose(finish_advantages(part_b, moments, config).advantages, [0, 3 / (std + eps), 0])
    np.testing.assert_allclose(finish_advantages(part_b, moments, config).returns, [3, 6, 0])
    # One real sample in the whole batch: std 1, its own mean: 0. No real sample: nothing to whiten.
    lone = partial_advantages(StepSamples([0], [0], [0], [5.0]), config)
    padding = partial_advantages(StepSamples([1], [0], [0], [7.0], is_padding=[True]), config)
    assert padding.moments == Moments(0, 0.0, 0.0)
    both = combine_moments([lone.moments, padding.moments])
    assert both.std == 1.0
    np.testing.assert_array_equal(finish_advantages(lone, both, config).advantages, [0.0])
    np.testing.assert_array_equal(finish_advantages(padding, both, config).advantages, [0.0])


def test_moments_combine_exactly_without_cancellation():
    # 1e9 + [1..7]: mean 1e9 + 4, m2 = 28. A sum of squares (about 7e18, spaced 1024 apart in
    # float64) could not resolve 28; the pairwise update is exact here (every chunk mean is exact).
    x = 1e9 + np.arange(1.0, 8.0)
    chunks = [x[:2], x[2:5], x[5:5], x[5:]]
    assert combine_moments([moments_of(c) for c in chunks]) == Moments(7, 1e9 + 4, 28.0)
    values = np.random.default_rng(0).normal(1.0, 3.0, 101)
    parts = [moments_of(c) for c in np.split(values, [1, 40, 41, 90])]
    together = combine_moments(parts)
    assert together.count == 101
    np.testing.assert_allclose([together.mean, together.std], [values.mean(), values.std(ddof=1)], rtol=1e-12)


def test_parts_and_moments_must_agree():
    assert combine_moments([None, None]) is None
    with pytest.raises(ValueError, match="some parts carry moments"):
        combine_moments([Moments(1, 0.0, 0.0), None])
    samples = StepSamples([0, 0], [0, 1], [0, 0], [1.0, 0.0], anchors=["s", "s"])
    whitened = AlgorithmConfig(advantage_estimator="reinforce_pp")
    with pytest.raises(ValueError, match="whitens over the batch"):
        finish_advantages(partial_advantages(samples, whitened), None, whitened)
    per_group = AlgorithmConfig(advantage_estimator="grpo")
    with pytest.raises(ValueError, match="needs no batch moments"):
        finish_advantages(partial_advantages(samples, per_group), Moments(2, 0.0, 1.0), per_group)
    with pytest.raises(ValueError, match="advantage_estimator"):
        partial_advantages(samples, AlgorithmConfig(advantage_estimator="a2c"))
