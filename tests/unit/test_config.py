"""configs/*.yaml compose onto the typed RunConfig; bad configs fail naming the key."""

from __future__ import annotations

import re
import sys

import pytest
from omegaconf import OmegaConf

from megatron_agent.run_config import CONFIG_DIR, ConfigError, load_run_config

ALGORITHMS = sorted(p.stem for p in (CONFIG_DIR / "algorithm").glob("*.yaml"))
ENVS = sorted(p.stem for p in (CONFIG_DIR / "env").glob("*.yaml"))


def test_the_cpu_job_defaults():
    run = load_run_config()
    assert (run.env, run.algorithm.advantage_estimator, run.num_groups, run.group_size) == ("numberline", "gigpo", 16, 8)
    assert run.env_config["action_format"] == "bare" and run.loop.sampling.max_new_tokens == 3
    assert run.loop.prompt.include_instructions is False and run.algorithm.entropy_coef == 0.05
    assert run.actor.lr == 1e-3 and run.actor.params_dtype == "fp32"


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != "ppo"])
def test_every_algorithm_config_loads(algorithm):
    # dapo's dynamic sampling is refused until the driver resamples groups
    extra = ["algorithm.dynamic_sampling=false"] if algorithm == "dapo" else []
    run = load_run_config([f"algorithm={algorithm}", *extra])
    assert run.algorithm.advantage_estimator in ("grpo", "gigpo", "rloo", "reinforce_pp")


def test_named_algorithm_settings():
    assert load_run_config(["algorithm=dapo", "algorithm.dynamic_sampling=false"]).algorithm.clip_ratio_high == 0.28
    gspo = load_run_config(["algorithm=gspo"]).algorithm
    assert gspo.policy_loss == "gspo" and gspo.loss_agg_mode == "seq-mean-token-mean"
    gigpo = load_run_config(["algorithm=gigpo"]).algorithm
    assert gigpo.gamma == 0.95 and gigpo.step_weight == 1.0


@pytest.mark.parametrize("env", ENVS)
def test_every_env_config_loads_and_builds(env, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_AGENT_APPWORLD_PYTHON", sys.executable)  # AppWorld's venv and data,
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path))                     # checked before a run starts
    if env == "appworld":
        with pytest.raises(ConfigError, match=f"AppWorld data not found: '{tmp_path}' has no data/tasks"):
            load_run_config([f"env={env}"])
        (tmp_path / "data" / "tasks").mkdir(parents=True)
    preset = OmegaConf.load(CONFIG_DIR / "env" / f"{env}.yaml")
    vlm = ["tiny_model.family=qwen3_vl", "tiny_model.tokenizer=bpe"] if preset.env_config.get("render_image") else []
    run = load_run_config([f"env={env}", *vlm])  # an env with images needs a vision-language model
    assert run.env == preset.env
    if env not in ("numberline", "maze"):  # the tiny model's bare prompt (maze: on backend=cpu)
        assert run.loop.prompt.include_instructions is True


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["num_groups=zero"], "full_key: num_groups"),
        (["loop.sampling.temprature=1"], "Key 'temprature' not in 'SamplingConfig'; full_key: loop.sampling.temprature"),
        (["weight_sync.bucket_byte=1"], "full_key: weight_sync.bucket_byte"),
        (["algorithm=gigpo", "group_size=1"], "group_size=1 with algorithm.advantage_estimator='gigpo'"),
        (["algorithm=ppo", "critic.lr=-1"], "critic: "),
        (["parallel.tp=3", "placement.trainer_ranks=3"], "parallel: num_attention_heads=4 is not divisible by tp=3"),
        (["parallel.tp=2"], "does not divide the world size 1 (with placement.trainer_ranks=1)"),
        (["model=tiny-moe", "parallel.ep=3", "placement.trainer_ranks=3"], "num_experts=4 is not divisible by ep=3"),
        (["placement.launcher=slurm"], "placement.launcher='slurm'"),
        (["weight_sync.transport=ipc"], "weight_sync.transport='ipc'"),
        (["placement.launcher=ray", "weight_sync.transport=tensor"], "set placement.colocate=true"),
        (["placement.colocate=true", "engine.urls=[http://10.255.0.9:30000]"], "needs the engines on this machine"),
        (["placement.launcher=ray", "placement.colocate=true", "engine.urls=[http://127.0.0.1:30000]"],
         "needs placement.launcher=local"),
        (["model=qwen3-8b", "placement.trainer_ranks=2"], "model_dir='/path/to/Qwen3-8B' has no config.json"),
        (["model_dir=/nowhere"], "model_dir='/nowhere' has no config.json"),
        (["tiny_model.family=gpt2"], "tiny_model.family='gpt2'"),
        (["engine.server=vllm"], "engine.server='vllm'"),
        (["algorithm.clip_ratio_low=2"], "clip_ratio_low"),
        (["env=sokoban", "+env_config.dim_rom=[6,6]"], "env_config.dim_rom"),
        (["stop_success=1.5"], "stop_success=1.5"),
        (["rollout.workers=17"], "rollout.workers=17: a worker owns whole groups and the run has num_groups=16"),
        (["rollout.workers=2", "training.mode=overlap", "algorithm=ppo", "algorithm.tis_cap=2"],
         "rollout.workers=2 with training.mode=overlap and algorithm=ppo (GAE) is not supported yet"),
        (["rollout.workers=0"], "rollout.workers=0 must be >= 1"),
        (["tiny_model.warm_start.episodes=5"], "env='numberline' has no expert_action() to imitate"),
        (["+experiment=maze", "tiny_model.warm_start.noise=2"], "tiny_model.warm_start: noise=2.0 must be in [0, 1]"),
        (["actor.lora.rank=-1"], "actor: actor.lora.rank=-1 must be >= 0"),
        (["actor.lora.rank=4", "actor.lora.targets=[linear_q]"], "actor.lora.targets=['linear_q']: choose among"),
        (["actor.lora.rank=4", "actor.lora.dropout=1"], "actor.lora.dropout=1.0 must be in [0, 1)"),
        (["actor.lora.rank=4", "actor.layer_spec=transformer_engine"], "set actor.layer_spec=local"),
        (["actor.lora.rank=4", "placement.gpus_per_trainer=1"], "actor.layer_spec=auto on 1 GPU(s) per trainer"),
        (["algorithm=ppo", "critic.lora.rank=4"], "critic.lora.rank=4: the critic trains every weight"),
        (["weight_sync.lora=deltas"], "weight_sync.lora='deltas'; choose one of ('merged', 'adapters')"),
        (["weight_sync.lora=adapters"], "sends the actor's LoRA adapters alone; set actor.lora.rank > 0"),
        (["actor.lora.rank=4", "weight_sync.lora=adapters", "weight_sync.quantize=fp8"],
         "weight_sync.lora=adapters with weight_sync.quantize=fp8"),
        (["actor.lora.rank=4", "weight_sync.lora=adapters", "tiny_model.family=qwen3_vl_moe"],
         "qwen3_vl_moe keeps its experts fused in HF, whose adapters the engines do not load"),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_run_config(overrides)


QWEN3_8B = dict(model_type="qwen3", num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                hidden_size=4096, intermediate_size=12288, head_dim=128, vocab_size=151936)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, head_dim=128, vocab_size=151936)


@pytest.mark.parametrize("preset, hf, ranks", [("qwen3-8b", QWEN3_8B, 8), ("qwen3-30b-a3b", QWEN3_30B_A3B, 16)])
def test_cluster_model_presets_fit_their_architectures(tmp_path, monkeypatch, preset, hf, ranks):
    """The presets' layouts against the published architectures (config.json only: no weights here)."""
    import json

    monkeypatch.setenv("MEGATRON_AGENT_ENGINE_TOKEN", "test-key")  # backend=gpu binds beyond loopback

    (tmp_path / "config.json").write_text(json.dumps(hf))
    common = [f"model={preset}", "backend=gpu", f"model_dir={tmp_path}", f"placement.trainer_ranks={ranks}"]
    run = load_run_config(common)
    assert run.placement.launcher == "ray" and run.engine.server == "sglang" and run.actor.params_dtype == "bf16"
    assert run.parallel.data_parallel_size(ranks) >= 1
    with pytest.raises(ConfigError, match="not divisible by tp=16"):  # 32 heads, but 8 or 4 KV heads
        load_run_config([*common, "parallel.tp=16", "parallel.ep=1", f"placement.trainer_ranks={16 * 8}"])


def test_ready_experiments_load():
    run = load_run_config(["+experiment=numberline-sparse", "algorithm=gigpo"])
    assert run.env_config["reward"] == "sparse" and run.stop_success is None
    assert run.algorithm.advantage_estimator == "gigpo"


def test_engines_beyond_loopback_need_a_key_before_anything_starts(monkeypatch):
    monkeypatch.delenv("MEGATRON_AGENT_ENGINE_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"engine.host\) bound to 0.0.0.0 needs a token.*docs/security.md"):
        load_run_config(["engine.host=0.0.0.0"])
    assert load_run_config(["engine.host=0.0.0.0", "engine.auth_token=k"]).engine.auth_token == "k"
    monkeypatch.setenv("MEGATRON_AGENT_ENGINE_TOKEN", "k")
    load_run_config(["engine.host=0.0.0.0"])
    monkeypatch.delenv("MEGATRON_AGENT_ENGINE_TOKEN")
    load_run_config(["engine.host=0.0.0.0", "engine.urls=[http://10.1.2.3:30000]"])  # a fleet started elsewhere


# ---- what the rollout would hit, refused before anything starts (issue 33) ----------------

def test_a_prompt_budget_over_the_models_context_is_refused_naming_the_fix():
    """WebShop's full-size prompt budget (configs/env/webshop.yaml, for 32k-context models) on
    the tiny model, whose context is 2048 (hf_config_for's max_position_embeddings): a 4096-
    token budget plus 512 new tokens used to fail mid-rollout with the engine's HTTP 400."""
    from megatron_agent.models.tiny import hf_config_for

    shipped = OmegaConf.load(CONFIG_DIR / "env" / "webshop.yaml").loop
    budget, new = shipped.prompt.max_prompt_tokens, shipped.sampling.max_new_tokens
    context = hf_config_for("qwen3")["max_position_embeddings"]
    assert budget + new > context  # the numbers: 4096 + 512 against 2048
    full_size = ["env=webshop", "tiny_model.tokenizer=bpe", f"loop.prompt.max_prompt_tokens={budget}",
                 f"loop.sampling.max_new_tokens={new}"]
    with pytest.raises(ConfigError, match=re.escape(
            f"loop.prompt.max_prompt_tokens={budget} plus loop.sampling.max_new_tokens={new} exceed the context of "
            f"the tiny model (tiny_model.*), {context} tokens") + f".*set loop.prompt.max_prompt_tokens={context - new}"):
        load_run_config(full_size)
    assert load_run_config([*full_size, f"loop.prompt.max_prompt_tokens={context - new}"]).env == "webshop"
    # validation's own max_new_tokens counts when validation runs
    with pytest.raises(ConfigError, match=re.escape("loop.validation.sampling.max_new_tokens=1000 exceed")):
        load_run_config(["val_every=1", "loop.validation.sampling.max_new_tokens=1000",
                         f"loop.prompt.max_prompt_tokens={context - 999}"])
    load_run_config(["val_every=0", "loop.validation.sampling.max_new_tokens=1000",
                     f"loop.prompt.max_prompt_tokens={context - 999}"])


def test_a_tokenizer_that_cannot_read_the_env_is_refused_naming_the_fix(tiny_model_dir):
    """The word-level tiny tokenizer knows the NumberLine job's words (JOB_WORDS) only: the
    Search instructions' first word 'Answer' is not one; numbers above 20 in NumberLine's
    observations are not either (read from three resets). Byte-level BPE encodes any text."""
    from megatron_agent.models.tiny import JOB_WORDS

    assert "Answer" not in JOB_WORDS and "25" not in JOB_WORDS and "20" in JOB_WORDS
    with pytest.raises(ConfigError, match=r"env=search: tiny_model.tokenizer='words' has no token for 'Answer', .*"
                                          r"set tiny_model.tokenizer=bpe"):
        load_run_config(["env=search", "tiny_model.tokenizer=words"])
    assert load_run_config(["env=search", "tiny_model.tokenizer=bpe"]).tiny_model.tokenizer == "bpe"
    with pytest.raises(ConfigError, match=r"env=numberline: .* no token for .*'25'"):
        load_run_config(["env_config.max_position=30"])
    load_run_config(["env_config.max_position=20"])
    run = load_run_config(["env=search", "tiny_model.tokenizer=words", "allow_unknown_tokens=true"])
    assert run.allow_unknown_tokens
    # a model directory's own tokenizer: a word-level one is read, a byte-level one passes
    words = tiny_model_dir("qwen3", tokenizer="words")
    with pytest.raises(ConfigError, match=f"the tokenizer of {re.escape(str(words))} has no token for 'Answer'"):
        load_run_config(["env=search", f"model_dir={words}"])
    load_run_config(["env=search", f"model_dir={tiny_model_dir('qwen3')}"])


def test_env_copies_that_would_not_fit_this_machine_are_refused(tmp_path, monkeypatch):
    """`env=appworld` at 16 x 8 copies (one AppWorld server process each) ran a 24 GiB machine
    out of memory before its first iteration (issue 33); the run is refused before any
    process starts, naming the fix, and the fix loads."""
    from types import SimpleNamespace

    import psutil

    (tmp_path / "appworld" / "data" / "tasks").mkdir(parents=True)
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path / "appworld"))
    monkeypatch.setenv("MEGATRON_AGENT_APPWORLD_PYTHON", sys.executable)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * 2**30, total=24 * 2**30))
    with pytest.raises(ConfigError, match=r"128 env copies .* lower num_groups or group_size"):
        load_run_config(["env=appworld", "num_groups=16", "group_size=8", "val_every=0"])
    load_run_config(["env=appworld", "num_groups=4", "group_size=4", "val_every=0"])


def test_adapter_sync_readies_the_engines_for_the_actors_adapters():
    from rollout.engine_launch import sglang_server_command

    run = load_run_config(["actor.lora.rank=8", "actor.lora.targets=[linear_qkv,linear_fc2]", "weight_sync.lora=adapters"])
    assert (run.engine.lora_adapters, run.engine.max_lora_rank) == (True, 8)
    assert run.engine.lora_target_modules == ("down_proj", "k_proj", "q_proj", "v_proj")
    command = sglang_server_command(run.engine, "/m", 30000)
    at = command.index("--enable-lora")
    assert command[at:at + 8] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                                  "down_proj", "k_proj", "q_proj", "v_proj"]
    assert not load_run_config(["actor.lora.rank=8"]).engine.lora_adapters  # merged: engines as they are
    # experts left out, Qwen3-VL-MoE's fused experts need no PEFT module
    load_run_config(["actor.lora.rank=4", "actor.lora.experts=false", "weight_sync.lora=adapters",
                     "tiny_model.family=qwen3_vl_moe"])
