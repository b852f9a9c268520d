"""The layering of configs/: the files composed together (config.yaml's own body and the
selected option of each group) never set the same key, so each is authoritative for what
it sets; two layers override on purpose: an env's settings for one machine
(env_on_backend/ENV_BACKEND.yaml, after the groups) and an experiment (+experiment=NAME, last).

Checked for every combination of group options from the YAML files themselves (cheap),
then each file is resolved through Hydra at least once and every key it sets must arrive
unchanged in the RunConfig. Disjoint keys make that hold in every combination."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sys

import pytest
from omegaconf import OmegaConf

from megatron_agent.run_config import CONFIG_DIR, ConfigError, load_run_config
from tests.unit.test_config import QWEN3_8B, QWEN3_30B_A3B

GROUPS = ("algorithm", "env", "model", "backend")
OPTIONS = {group: sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")) for group in GROUPS}
EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
# The published vision-language configs (config.json of Qwen/Qwen3-VL-30B-A3B-Instruct and
# Qwen/Qwen3-VL-8B-Instruct, the fields a layout or a parameter count reads; docs/scale.md).
QWEN3_VL_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                      temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
QWEN3_VL_30B_A3B = dict(
    model_type="qwen3_vl_moe", tie_word_embeddings=False, image_token_id=151655,
    text_config=dict(model_type="qwen3_vl_moe_text", num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                     head_dim=128, vocab_size=151936),
    vision_config=dict(QWEN3_VL_TOWER, out_hidden_size=2048))
QWEN3_VL_8B = dict(
    model_type="qwen3_vl", tie_word_embeddings=False, image_token_id=151655,
    text_config=dict(model_type="qwen3_vl_text", num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     hidden_size=4096, intermediate_size=12288, head_dim=128, vocab_size=151936),
    vision_config=dict(QWEN3_VL_TOWER, out_hidden_size=4096))
# Cluster presets: the published architecture (config.json only) and a layout's world size.
CLUSTER_MODELS = {"qwen3-8b": (QWEN3_8B, 8), "qwen3-30b-a3b": (QWEN3_30B_A3B, 16),
                  "qwen3-vl-8b": (QWEN3_VL_8B, 8), "qwen3-vl-30b-a3b": (QWEN3_VL_30B_A3B, 16)}
INTERPOLATION = re.compile(r"^\$\{([\w.]+)\}$")


def flatten(node, prefix=""):
    """{dotted key: value} of a YAML mapping's leaves (an empty mapping or a list is a leaf)."""
    if isinstance(node, dict) and node:
        out = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def file_keys(path, group=None):
    """What a config file sets, as full keys of the RunConfig: a `# @package _global_` file
    at the root, a group's file (algorithm/) under its group; config.yaml without its defaults."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    raw.pop("defaults", None)
    is_global = "# @package _global_" in path.read_text()
    prefix = "" if is_global or group is None else f"{group}."
    return flatten(raw, prefix)


BODY = file_keys(CONFIG_DIR / "config.yaml")
KEYS = {(group, option): file_keys(CONFIG_DIR / group / f"{option}.yaml", group)
        for group in (*GROUPS, "experiment") for option in (OPTIONS.get(group) or EXPERIMENTS)}
DEFAULTS_LIST = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml").defaults)
DEFAULTS = {group: option for entry in DEFAULTS_LIST if isinstance(entry, dict) for group, option in entry.items()
            if not group.startswith("optional ")}
# An env's settings for one machine (env_on_backend/sokoban_cpu.yaml): chosen by the env and
# backend options, composed after the groups and over them where they differ.
SPECIAL = "env_on_backend"
SPECIALIZED = {p.stem: file_keys(p) for p in (CONFIG_DIR / SPECIAL).glob("*.yaml")}


def specialization(selection):
    name = f"{selection['env']}_{selection['backend']}"
    return f"{SPECIAL}/{name}.yaml", SPECIALIZED.get(name, {})


def overlap(a, b):
    """Keys of `a` and `b` that name the same field or one inside the other."""
    return sorted(ka for ka in a for kb in b if ka == kb or ka.startswith(kb + ".") or kb.startswith(ka + "."))


def test_the_defaults_list_names_every_group():
    assert set(DEFAULTS) == set(GROUPS)
    assert all(DEFAULTS[group] in OPTIONS[group] for group in GROUPS)
    # after every group, so that it overrides them; optional: most pairs have none
    assert DEFAULTS_LIST[-1] == {f"optional {SPECIAL}": "${env}_${backend}"}


def test_each_env_on_backend_file_names_an_env_option_and_a_backend_option():
    pairs = {f"{e}_{b}" for e in OPTIONS["env"] for b in OPTIONS["backend"]}
    assert SPECIALIZED and set(SPECIALIZED) <= pairs, sorted(set(SPECIALIZED) - pairs)
    assert not any(name.endswith("_gpu") for name in SPECIALIZED)  # the GPU presets: the env files as shipped


def test_no_two_composed_files_set_the_same_key():
    """For every combination: pairwise disjoint across groups and config.yaml's body."""
    clashes = []
    files = [("config.yaml", BODY)] + [(f"{g}/{o}.yaml", KEYS[g, o]) for g in GROUPS for o in OPTIONS[g]]
    group_of = {name: name.split("/")[0] if "/" in name else None for name, _ in files}
    for (name_a, a), (name_b, b) in itertools.combinations(files, 2):
        if group_of[name_a] is not None and group_of[name_a] == group_of[name_b]:
            continue  # two options of one group are never composed together
        if shared := overlap(a, b):
            clashes.append(f"{name_a} and {name_b} both set {shared}")
    assert not clashes, "\n".join(clashes)
    # so every one of the combinations composes without an override:
    assert len(list(itertools.product(*(OPTIONS[g] for g in GROUPS)))) > 1


@pytest.fixture(autouse=True)
def engine_token(monkeypatch):
    """backend=gpu binds the engines beyond loopback: a run has a key (train.sbatch makes one)."""
    monkeypatch.setenv("MEGATRON_AGENT_ENGINE_TOKEN", "test-key")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for preset, (hf, _) in CLUSTER_MODELS.items():
        dirs[preset] = tmp_path_factory.mktemp(preset)
        (dirs[preset] / "config.json").write_text(json.dumps(hf))
    return dirs


def resolve(selection, model_dirs, extra=()):
    overrides = [f"{group}={option}" for group, option in selection.items()]
    if selection["model"] in CLUSTER_MODELS:
        overrides += [f"model_dir={model_dirs[selection['model']]}",
                      f"placement.trainer_ranks={CLUSTER_MODELS[selection['model']][1]}"]
    return dataclasses.asdict(load_run_config([*overrides, *extra]))


def lookup(resolved, key):
    value = resolved
    for part in key.split("."):
        value = value[part]
    return value


def assert_arrives(resolved, name, keys, model_dirs, overridden=()):
    """Every key the file sets has its value in the resolved config (an interpolation: the
    value of the key it names); keys an experiment overrides are left out."""
    for key, expected in keys.items():
        if any(key == o or key.startswith(o + ".") for o in overridden):
            continue
        if key == "model_dir" and lookup(resolved, key) in {str(d) for d in model_dirs.values()}:
            continue  # the placeholder of a cluster preset, set on the command line here
        if isinstance(expected, str) and (ref := INTERPOLATION.match(expected)):
            expected = lookup(resolved, ref.group(1))
        assert lookup(resolved, key) == expected, f"{name}: {key}={expected!r} arrives as {lookup(resolved, key)!r}"


# Envs whose prompts carry images resolve only with a vision-language model.
IMAGE_ENVS = {e for e in OPTIONS["env"] if KEYS["env", e].get("env_config.render_image") is True}
SELECTIONS = (
    [{**DEFAULTS, "algorithm": a} for a in OPTIONS["algorithm"]]
    + [{**DEFAULTS, "env": e, **({"model": "qwen3-vl-8b"} if e in IMAGE_ENVS else {})} for e in OPTIONS["env"]]
    + [{**DEFAULTS, "model": m, "backend": b} for m in OPTIONS["model"] for b in OPTIONS["backend"]]
    # every env at full size: on the GPU backend with a cluster model, no env_on_backend file
    + [{**DEFAULTS, "env": e, "backend": "gpu", "model": "qwen3-vl-8b" if e in IMAGE_ENVS else "qwen3-8b"}
       for e in OPTIONS["env"]]
)


@pytest.fixture(autouse=True)
def appworld_in_place(tmp_path, monkeypatch):
    """The AppWorld preset resolves where AppWorld's python and a data folder exist (the
    config check asks for both); what they hold is test_appworld.py's concern."""
    (tmp_path / "appworld" / "data" / "tasks").mkdir(parents=True)
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path / "appworld"))
    monkeypatch.setenv("MEGATRON_AGENT_APPWORLD_PYTHON", sys.executable)


@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: "-".join(s[g] for g in GROUPS))
def test_every_file_is_authoritative_for_what_it_sets(selection, model_dirs):
    resolved = resolve(selection, model_dirs)
    special_name, special = specialization(selection)
    assert_arrives(resolved, special_name, special, model_dirs)
    assert_arrives(resolved, "config.yaml", BODY, model_dirs, overridden=special)
    for group in GROUPS:
        assert_arrives(resolved, f"{group}/{selection[group]}.yaml", KEYS[group, selection[group]], model_dirs,
                       overridden=special)


def experiment_selection(experiment):
    """The default groups with the experiment's own `override /GROUP: OPTION` entries."""
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "experiment" / f"{experiment}.yaml"))
    chosen = {key.removeprefix("override /"): option for entry in raw.get("defaults", []) if isinstance(entry, dict)
              for key, option in entry.items()}
    return {**DEFAULTS, **chosen}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_an_experiment_overrides_on_purpose(experiment, model_dirs):
    selection = experiment_selection(experiment)
    resolved = resolve(selection, model_dirs, [f"+experiment={experiment}"])
    mine = KEYS["experiment", experiment]
    special_name, special = specialization(selection)
    assert_arrives(resolved, f"experiment/{experiment}.yaml", mine, model_dirs)
    assert_arrives(resolved, special_name, special, model_dirs, overridden=mine)
    assert_arrives(resolved, "config.yaml", BODY, model_dirs, overridden=[*mine, *special])
    for group in GROUPS:
        assert_arrives(resolved, f"{group}/{selection[group]}.yaml", KEYS[group, selection[group]], model_dirs,
                       overridden=[*mine, *special])


def test_the_cluster_presets_keep_their_settings(model_dirs):
    """The issue: config.yaml's CPU-job values (lr 1e-3, entropy 0.05, no KL, no penalty) and
    backend/gpu.yaml's one GPU per engine used to override the 30B preset."""
    run = load_run_config(["model=qwen3-30b-a3b", "backend=gpu", f"model_dir={model_dirs['qwen3-30b-a3b']}",
                           "placement.trainer_ranks=16"])
    assert run.actor.lr == 1e-6 and run.engine.gpus_per_engine == 4
    assert run.algorithm.entropy_coef == 0.001 and run.algorithm.kl_loss_active
    assert run.algorithm.invalid_action_penalty == 0.1  # the schema's defaults, not the CPU job's
    assert (run.engine.server, run.engine.dtype, run.actor.params_dtype) == ("sglang", "bfloat16", "bf16")
    assert run.placement.gpus_per_trainer == 1
    # the CPU job keeps its from-scratch settings, now in model/tiny.yaml
    cpu = load_run_config()
    assert (cpu.actor.lr, cpu.critic.lr, cpu.algorithm.entropy_coef) == (1e-3, 1e-3, 0.05)
    assert not cpu.algorithm.kl_loss_active and cpu.engine.gpus_per_engine == 0


# ---- memory per GPU of the cluster presets; the vision-language ones: parameters, refusals --

MEMORY_LINE = re.compile(
    r"^#\s+(\d+) ranks, (\d+) tokens(, FP8)?: ([\d.]+) B params; weights ([\d.]+), grads ([\d.]+), "
    r"optimizer ([\d.]+), reference ([\d.]+), (?:FP8 weights ([\d.]+), )?sync buffers ([\d.]+), "
    r"activations ([\d.]+), logits ([\d.]+) -> ([\d.]+) GiB, ([\d.-]+) spare on 80 GB \(fits: ([\w\- ]*)\)$", re.M)
VLM_PRESETS = {"qwen3-vl-30b-a3b": QWEN3_VL_30B_A3B, "qwen3-vl-8b": QWEN3_VL_8B}
IMAGE_TOKEN_FRACTION = 0.25  # the presets' stated assumption


def test_vlm_parameter_counts_equal_transformers_own():
    """The count the memory figures start from, against a meta-device transformers model of
    the published configs (and the published totals: docs/scale.md, the 8B model card)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from megatron_agent.models.memory import parameter_counts
    from megatron_agent.models.transformer_config import read_hf_config

    published = {"qwen3-vl-30b-a3b": 31_070_754_032, "qwen3-vl-8b": 8_767_123_696}
    for preset, hf in VLM_PRESETS.items():
        fields = {k: v for k, v in hf.items() if k != "model_type"}
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(hf["model_type"], **fields))
        counts = parameter_counts(read_hf_config(hf))
        assert counts.total == sum(p.numel() for p in model.parameters()) == published[preset], preset
        assert counts.vision == sum(p.numel() for p in model.model.visual.parameters()), preset


def test_memory_arithmetic_matches_the_hand_computation_in_scale_md():
    """docs/scale.md, by hand: Qwen3-30B-A3B at TP 4 x EP 8 on 256 GPUs holds 3.62 B expert +
    0.39 B dense parameters a GPU: bf16 weights 8 GB, fp32 grads 16 GB, optimizer 1.4 GB."""
    from megatron_agent.models.memory import training_memory
    from megatron_agent.platform.parallel import ParallelConfig

    layout = ParallelConfig(tp=4, ep=8, etp=1, sequence_parallel=True)
    m = training_memory(QWEN3_30B_A3B, layout, 256, micro_batch_tokens=16384)
    assert round(m.expert_parameters / 1e9, 2) == 3.62 and round(m.dense_parameters / 1e9, 2) == 0.39
    assert (round(m.weights / 1e9), round(m.gradients / 1e9), round(m.optimizer / 1e9, 1)) == (8, 16, 1.4)
    # activations: linear in the tokens (of one sequence); TP 8 halves nearly all of them, not
    # RoPE's tables (per position, on every rank), the 4 KV heads (one a rank past TP 4) and a
    # few bytes per token
    double = training_memory(QWEN3_30B_A3B, layout, 256, micro_batch_tokens=32768)
    assert double.activations == pytest.approx(2 * m.activations, rel=1e-6)
    tp8 = training_memory(QWEN3_30B_A3B, ParallelConfig(tp=8, ep=8, etp=1, sequence_parallel=True), 256,
                          micro_batch_tokens=16384)
    assert m.activations / 2 < tp8.activations < 0.55 * m.activations


def test_memory_constants_are_the_trainers():
    """memory.py sits below weight_sync and training: the values it copies from them."""
    from megatron_agent.models import memory
    from megatron_agent.training import logprobs
    from megatron_agent.weight_sync import WeightSyncConfig

    assert memory.WEIGHT_SYNC_BUCKET_BYTES == WeightSyncConfig().bucket_bytes
    assert memory.LOSS_CHUNK_ELEMENTS == logprobs.CHUNK_ELEMENTS


@pytest.mark.parametrize("preset", sorted(CLUSTER_MODELS))
def test_cluster_preset_states_the_memory_it_resolves_to(preset, model_dirs):
    """Every memory line in the file's comments is what training_memory gives for the
    resolved layout, and the preset as shipped (its micro-batch, its fewest ranks) leaves
    SPARE_GIB (8 GiB) of an 80 GB part free. (Before the activations were measured
    (tests/multirank/test_activation_memory.py), the model undercounted them: the unfused
    SwiGLU and the loss's fp32 copies of the logits, which the trainer no longer keeps,
    RoPE's tables, the norms' and q/k norms' inputs, the weight-sync buffers.)"""
    from megatron_agent.models.memory import GPU_MEMORY_GIB, SPARE_GIB, training_memory
    from megatron_agent.models.transformer_config import read_hf_config

    text = (CONFIG_DIR / "model" / f"{preset}.yaml").read_text()
    lines = MEMORY_LINE.findall(text)
    assert len(lines) >= 2, f"{preset}.yaml states no memory figures"
    hf_config, fewest = CLUSTER_MODELS[preset]
    hf = read_hf_config(hf_config)
    images = IMAGE_TOKEN_FRACTION if preset in VLM_PRESETS else 0.0
    run = load_run_config([f"model={preset}", "backend=gpu", f"model_dir={model_dirs[preset]}",
                           f"placement.trainer_ranks={fewest}"])
    for ranks, tokens, fp8, params, *gib, spare, fits in lines:
        m = training_memory(hf, run.parallel, int(ranks), micro_batch_tokens=int(tokens),
                            image_token_fraction=images, kl_reference=run.algorithm.kl_loss_active, fp8=bool(fp8))
        line = f"{preset}: {ranks} ranks, {tokens} tokens{fp8}"
        assert f"{m.parameters / 1e9:.3f}" == params, line
        names = ("weights", "gradients", "optimizer", "reference", "fp8_weights", "sync_buffers", "activations",
                 "logits_transient", "total")
        stated = [g for name, g in zip(names, gib) if name != "fp8_weights" or fp8]
        computed = [f"{m.gib(n):.1f}" for n in names if n != "fp8_weights" or fp8]
        assert computed == stated, line
        assert f"{m.spare_gib('H100-80GB'):.1f}" == spare, line
        assert fits.split() == [gpu for gpu in GPU_MEMORY_GIB if m.fits(gpu)], line
    tokens = run.actor.max_tokens_per_micro_batch
    shipped = training_memory(hf, run.parallel, fewest, micro_batch_tokens=tokens, image_token_fraction=images,
                              kl_reference=run.algorithm.kl_loss_active, fp8=run.actor.fp8_recipe is not None)
    assert shipped.spare_gib("H100-80GB") >= SPARE_GIB, (
        f"{preset} as shipped needs {shipped.gib('total'):.1f} GiB a GPU: "
        f"{shipped.spare_gib('H100-80GB'):.1f} GiB spare on 80 GB, under {SPARE_GIB}")
    assert (str(fewest), str(tokens), "") in {(r, t, f) for r, t, f, *_ in lines}


def test_the_lora_preset_states_the_memory_it_resolves_to(model_dirs):
    """configs/experiment/qwen3-30b-a3b-lora.yaml: its memory lines are training_memory's
    with its adapters on the local layer spec, and it fits 80 GB parts at its fewest ranks."""
    from megatron_agent.models.memory import GPU_MEMORY_GIB, SPARE_GIB, ActivationPath, training_memory
    from megatron_agent.models.transformer_config import read_hf_config

    text = (CONFIG_DIR / "experiment" / "qwen3-30b-a3b-lora.yaml").read_text()
    lines = MEMORY_LINE.findall(text)
    assert len(lines) >= 2
    hf = read_hf_config(QWEN3_30B_A3B)
    run = load_run_config(["+experiment=qwen3-30b-a3b-lora", f"model_dir={model_dirs['qwen3-30b-a3b']}",
                           "placement.trainer_ranks=2"])
    assert run.actor.lora.enabled and run.actor.layer_spec == "local" and run.weight_sync.lora == "adapters"
    path = ActivationPath(layer_spec="local", fused_swiglu=True)  # the local spec on a GPU
    for ranks, tokens, _, params, *gib, spare, fits in lines:
        m = training_memory(hf, run.parallel, int(ranks), micro_batch_tokens=int(tokens), path=path,
                            lora=run.actor.lora, kl_reference=run.algorithm.kl_loss_active)
        names = ("weights", "gradients", "optimizer", "reference", "sync_buffers", "activations", "logits_transient",
                 "total")
        assert (f"{m.parameters / 1e9:.3f}", [f"{m.gib(n):.1f}" for n in names]) == (params, [g for g in gib if g]), ranks
        assert f"{m.spare_gib('H100-80GB'):.1f}" == spare and fits.split() == [g for g in GPU_MEMORY_GIB if m.fits(g)]
    shipped = training_memory(hf, run.parallel, 2, micro_batch_tokens=run.actor.max_tokens_per_micro_batch,
                              path=path, lora=run.actor.lora, kl_reference=run.algorithm.kl_loss_active)
    assert shipped.spare_gib("H100-80GB") >= SPARE_GIB
    whole = training_memory(hf, run.parallel, 2, micro_batch_tokens=run.actor.max_tokens_per_micro_batch, path=path)
    assert whole.total > 2 * shipped.total  # what LoRA saves: the base's gradients, Adam state, reference


def test_vlm_presets_resolve_for_visual_sokoban(model_dirs):
    run = load_run_config(["model=qwen3-vl-30b-a3b", "env=sokoban-visual", "backend=gpu",
                           f"model_dir={model_dirs['qwen3-vl-30b-a3b']}", "placement.trainer_ranks=16"])
    assert (run.parallel.tp, run.parallel.ep, run.parallel.etp, run.parallel.pp) == (4, 16, 1, 1)
    assert run.parallel.sequence_parallel and run.parallel.expert_data_parallel_size(16) == 1
    assert run.actor.lr == 1e-6 and run.engine.gpus_per_engine == 4 and run.algorithm.kl_loss_active
    assert run.env == "sokoban" and run.env_config["render_image"] is True and run.loop.prompt.max_images == 1
    with pytest.raises(ConfigError, match="etp\\*ep\\*pp = 1\\*16\\*1 = 16 does not divide the world size 8"):
        load_run_config(["model=qwen3-vl-30b-a3b", "backend=gpu", f"model_dir={model_dirs['qwen3-vl-30b-a3b']}",
                         "placement.trainer_ranks=8"])


def test_an_image_env_refuses_a_text_model_and_a_vlm_takes_a_text_env(model_dirs):
    for text_model in (["model=tiny", "tiny_model.family=qwen3"], ["model=qwen3-30b-a3b", "backend=gpu", f"model_dir={model_dirs['qwen3-30b-a3b']}",
                                        "placement.trainer_ranks=16"]):
        with pytest.raises(ConfigError, match="render_image=true puts images in the prompts.*no vision tower"):
            load_run_config([*text_model, "env=sokoban-visual"])
        load_run_config([*text_model, "env=sokoban-visual", "loop.prompt.max_images=0"])  # text-only prompts
    with pytest.raises(ConfigError, match="env=numberline with render_image=true"):
        load_run_config(["env_config.render_image=true"])
    run = load_run_config(["model=qwen3-vl-8b", "env=sokoban", f"model_dir={model_dirs['qwen3-vl-8b']}",
                           "placement.trainer_ranks=8"])
    assert run.env_config["render_image"] is False


def test_deepstack_layers_apart_from_the_tower_are_refused_at_config_time(model_dirs):
    common = ["model=qwen3-vl-30b-a3b", "backend=gpu", f"model_dir={model_dirs['qwen3-vl-30b-a3b']}",
              "parallel.tp=1", "parallel.ep=1", "parallel.sequence_parallel=false"]
    # 48 layers over 24 stages: 2 with the tower, DeepStack needs layers 0-2 there
    with pytest.raises(ConfigError, match="parallel: deepstack .* layers 0-2, .* first chunk 2 of the 48"):
        load_run_config([*common, "parallel.pp=24", "placement.trainer_ranks=24"])
    with pytest.raises(ConfigError, match="pp=4 x vpp=6 gives its first chunk 2"):
        load_run_config([*common, "parallel.pp=4", "parallel.vpp=6", "placement.trainer_ranks=4"])
    assert load_run_config([*common, "parallel.pp=16", "placement.trainer_ranks=16"]).parallel.pp == 16


def test_a_tiny_vlm_is_a_run_configs_model_and_made_in_the_run_dir(tmp_path):
    from megatron_agent.run_dir import prepare_run_dir

    run = load_run_config(["tiny_model.family=qwen3_vl", "env=sokoban-visual", f"run_dir={tmp_path}", "seed=3"])
    with pytest.raises(ConfigError, match="tiny_model.family='gpt2'; choose one of .*qwen3_vl_moe"):
        load_run_config(["tiny_model.family=gpt2"])
    prepare_run_dir(run)
    made = json.loads((tmp_path / "model" / "megatron_agent.json").read_text())
    assert (made["family"], made["seed"], made["tokenizer"]) == ("qwen3_vl", 3, "bpe")  # env_on_backend/
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["text_config"]["num_hidden_layers"] == 2
    assert (tmp_path / "model" / "preprocessor_config.json").is_file()
