"""The run configuration: the typed schema root that Hydra fills, and its checks.

    run = load_run_config(["algorithm=gigpo", "actor.lr=5e-4"])

`RunConfig` is the root; each section's dataclass lives with the code it configures
(`AlgorithmConfig` in algorithms/, `ActorConfig` in training/, `PlacementConfig` in
placement.py, ...). configs/*.yaml fill it (configs/config.yaml lists `run_schema`, this
schema, first). Everything is checked here, before any process starts: an unknown key, a
value of the wrong type, an unknown group option, and combinations that cannot work
(GiGPO with groups of one, an env config field the env does not have, a prompt budget over
the model's context, a tokenizer with no tokens for the env's words...) raise `ConfigError`
naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from megatron_agent.algorithms import AlgorithmConfig
from megatron_agent.placement import PlacementConfig, validate_colocation
from megatron_agent.platform.parallel import ParallelConfig
from megatron_agent.rollout_stream import TrainingConfig, training_problem
from megatron_agent.rollout_workers import RolloutWorkersConfig
from megatron_agent.trackers import LoggingConfig, logging_problem, resolve_logging
from megatron_agent.training.actor import ActorConfig
from megatron_agent.training.checks import LogprobCheckConfig
from megatron_agent.warm_start import WarmStartConfig
from megatron_agent.weight_sync import LORA_SYNC_MODES, WeightSyncConfig
from rollout.agent_loop import LOOP_MODES, AgentLoopConfig
from rollout.engine_launch import EngineConfig

ENV_BACKENDS = ("inline", "process", "ray")


@dataclass
class TinyModelConfig:
    """The model made on the spot in run_dir/model when model_dir is None."""

    family: str = "qwen3"
    preset: str = "tiny"
    num_hidden_layers: int = 2
    tokenizer: str = "words"  # "words": the 43-word job vocabulary; "bpe": byte-level BPE
    # Imitation of the env's noisy expert before RL (megatron_agent/warm_start.py).
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


@dataclass
class RunConfig:
    """The schema root; the defaults here are the libraries' own, the CPU main job's
    settings live in configs/."""

    run_dir: str = "runs/default"
    model_dir: str | None = None  # an HF model directory; None: tiny_model, made on the spot
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    env: str = "numberline"
    env_config: dict = field(default_factory=dict)  # fields of the env's config dataclass
    # Run although the tokenizer has no tokens for some of the env's words (they reach the
    # model as its unknown token): refused otherwise, before anything starts.
    allow_unknown_tokens: bool = False
    # Where the env copies step: "inline" (in rank 0's process), "process" (a pool of
    # worker processes), "ray" (Ray actors); env_workers: how many (None: one per CPU).
    env_backend: str = "process"
    env_workers: int | None = None
    num_groups: int = 16
    group_size: int = 8
    iterations: int = 200
    # Stop once the 3-iteration moving average of the success rate reaches this.
    stop_success: float | None = None
    seed: int = 0
    save_every: int = 0  # iterations between checkpoints in run_dir/checkpoints (0: none)
    val_every: int = 0  # iterations between validation runs (loop.validation settings; 0: none)
    samples_every: int = 0  # iterations between writing a group's episodes to samples/ (text, JSON; 0: none)
    # A run directory to continue from its last complete checkpoint (the same settings).
    resume: str | None = None
    # When the rollout runs beside the update: sync, overlap or async (megatron_agent/rollout_stream.py).
    training: TrainingConfig = field(default_factory=TrainingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: ActorConfig = field(default_factory=ActorConfig)  # the value model of algorithm=ppo (GAE)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    rollout: RolloutWorkersConfig = field(default_factory=RolloutWorkersConfig)  # who rolls out which groups
    loop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    check: LogprobCheckConfig = field(default_factory=LogprobCheckConfig)  # served vs trained logprobs
    # Experiment trackers beside metrics.jsonl: tensorboard, wandb, mlflow (megatron_agent/trackers.py).
    logging: LoggingConfig = field(default_factory=LoggingConfig)


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class ConfigError(ValueError):
    """A run configuration that cannot work; the message names the key."""


def load_run_config(overrides: list[str] | None = None, *, config_dir: Path = CONFIG_DIR,
                    config_name: str = "config") -> RunConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
    # The typed schema is the base of the defaults list (configs/config.yaml: `- run_schema`),
    # so every field can be overridden and is type-checked as it is set.
    ConfigStore.instance().store(name="run_schema", node=_schema())
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            composed = compose(config_name=config_name, overrides=list(overrides or []))
        run = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_first_line(err)) from None
    resolve_defaults(run)
    validate_run_config(run)
    return run


def resolve_defaults(run: RunConfig) -> None:
    """Defaults that depend on other sections, written into the config (so run_dir/config.json
    shows them): FP8 rollouts turn truncated importance sampling on (algorithm.tis_cap
    FP8_DEFAULT_TIS_CAP) unless a rollout correction is set; routing replay from the
    rollout asks the engines for routes (engine.return_routed_experts); the trackers' run
    name, W&B mode and MLflow store (logging.*, from run_dir and the environment)."""
    from megatron_agent.weight_sync.fp8 import FP8_DEFAULT_TIS_CAP

    if run.weight_sync.quantize == "fp8" and not run.algorithm.corrects_rollout:
        run.algorithm.tis_cap = FP8_DEFAULT_TIS_CAP
    if run.algorithm.routing_replay == "rollout":
        run.engine.return_routed_experts = True
    resolve_logging(run.logging, run.run_dir)


def _schema():
    """RunConfig as an OmegaConf node; frozen dataclasses in it (ParallelConfig) are
    read-only to OmegaConf, but configs must be able to set them."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(RunConfig)
    OmegaConf.set_readonly(schema.parallel, False)
    return schema


def _first_line(err: Exception) -> str:
    """Hydra/OmegaConf's message: its first line and the lines that name the key."""
    text = str(err) + ("\n" + str(err.__cause__) if err.__cause__ is not None else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = [line for line in lines[1:] if line.startswith(("Key ", "full_key"))]
    return "; ".join(lines[:1] + detail)


def validate_run_config(run: RunConfig) -> None:
    """The combinations no schema can express."""
    from envs.registry import get_spec, registered_envs

    for name, section in (("algorithm", run.algorithm), ("actor", run.actor), ("critic", run.critic),
                          ("check", run.check)):
        try:
            section.validate()
        except ValueError as err:
            raise ConfigError(f"{name}: {err}") from None
    if run.env not in registered_envs():
        raise ConfigError(f"env={run.env!r} is not registered; choose one of {registered_envs()}")
    env_fields = {f.name for f in dataclasses.fields(get_spec(run.env).config_cls)}
    unknown = sorted(set(run.env_config) - env_fields)
    if unknown:
        raise ConfigError(f"env_config.{unknown[0]}: {run.env} has no such field (fields: {sorted(env_fields)})")
    try:  # one copy, to run the env's own checks of its values
        from envs.registry import make_env

        env_copy = make_env(run.env, dict(run.env_config))
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:  # a missing extra or data folder too
        raise ConfigError(f"env_config ({run.env}): {err}") from None
    validate_warm_start(run, env_copy)
    for key in ("num_groups", "group_size", "iterations"):
        if getattr(run, key) < 1:
            raise ConfigError(f"{key}={getattr(run, key)} must be >= 1")
    grouped = run.algorithm.advantage_estimator in ("gigpo", "grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
    if grouped and run.group_size < 2:
        raise ConfigError(
            f"group_size=1 with algorithm.advantage_estimator={run.algorithm.advantage_estimator!r}: "
            "group-relative advantages need at least 2 episodes per group"
        )
    if run.env_backend not in ENV_BACKENDS:
        raise ConfigError(f"env_backend={run.env_backend!r}; choose one of {ENV_BACKENDS}")
    if run.env_workers is not None and run.env_workers < 1:
        raise ConfigError(f"env_workers={run.env_workers} must be >= 1 (or null: one per CPU)")
    if run.loop.mode not in LOOP_MODES:
        raise ConfigError(f"loop.mode={run.loop.mode!r}; choose one of {LOOP_MODES}")
    problem = training_problem(run)
    if problem:
        raise ConfigError(problem)
    try:
        run.rollout.validate(run.num_groups)
    except ValueError as err:
        raise ConfigError(f"rollout.{err}") from None
    if run.stop_success is not None and not 0 < run.stop_success <= 1:
        raise ConfigError(f"stop_success={run.stop_success} must be in (0, 1]")
    problem = logging_problem(run.logging)
    if problem:
        raise ConfigError(problem)
    validate_placement(run)
    validate_routing_replay(run)
    validate_lora(run)
    validate_quantized_rollout(run)
    validate_prompt_fits_context(run)
    validate_tokenizer_reads_the_env(run, env_copy)
    if run.placement.launcher == "local":  # the copies run on this machine (under Ray: the driver checks)
        import psutil

        problem = env_copies_memory_problem(run, psutil.virtual_memory().available)
        if problem:
            raise ConfigError(problem)


def validate_warm_start(run: RunConfig, env_copy) -> None:
    warm = run.tiny_model.warm_start
    try:
        warm.validate()
    except ValueError as err:
        raise ConfigError(f"tiny_model.warm_start: {err}") from None
    if not warm.episodes:
        return
    if run.model_dir is not None:
        raise ConfigError(f"tiny_model.warm_start.episodes={warm.episodes} with model_dir={run.model_dir!r}: the warm "
                          "start trains the tiny model made on the spot; set model_dir=null or "
                          "tiny_model.warm_start.episodes=0")
    if not callable(getattr(env_copy, "expert_action", None)) or not getattr(env_copy, "actions", None):
        raise ConfigError(f"tiny_model.warm_start.episodes={warm.episodes}: env={run.env!r} has no expert_action() "
                          "to imitate and actions to draw the noise from (env=maze has both); set "
                          "tiny_model.warm_start.episodes=0")


def env_copies_memory_problem(run: RunConfig, available_bytes: int) -> str | None:
    """Why the run's environment copies (training groups, and the validation episodes when
    it validates) would not fit in `available_bytes` (None: they fit, or the env's copies
    declare no cost: envs.registry.memory_problem)."""
    from envs.registry import make_config, memory_problem

    copies = run.num_groups * run.group_size + (run.loop.validation.num_episodes if run.val_every else 0)
    return memory_problem(make_config(run.env, dict(run.env_config)), copies, available_bytes)


def validate_placement(run: RunConfig) -> None:
    """The parallel layout against the ranks and the model, where the engines go."""
    from megatron_agent.models.families import UnsupportedModelError
    from megatron_agent.models.tiny import PRESETS, TIED_EMBEDDINGS, TOKENIZER_KINDS, VISION_FAMILIES
    from megatron_agent.models.transformer_config import validate_layout_for_model
    from megatron_agent.platform import ParallelLayoutError

    try:
        run.placement.validate()
    except ValueError as err:
        raise ConfigError(f"placement.{err}") from None
    try:
        validate_colocation(run)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        run.parallel.validate(run.placement.trainer_ranks)
    except ParallelLayoutError as err:
        raise ConfigError(f"parallel: {err} (with placement.trainer_ranks={run.placement.trainer_ranks})") from None
    if run.model_dir is None:
        tiny = run.tiny_model
        for key, value, allowed in (("family", tiny.family, sorted({*TIED_EMBEDDINGS, *VISION_FAMILIES})),
                                    ("preset", tiny.preset, sorted(PRESETS)),
                                    ("tokenizer", tiny.tokenizer, sorted(TOKENIZER_KINDS))):
            if value not in allowed:
                raise ConfigError(f"tiny_model.{key}={value!r}; choose one of {allowed}")
    elif not (Path(run.model_dir) / "config.json").is_file():
        raise ConfigError(f"model_dir={run.model_dir!r} has no config.json (an HF model directory is needed)")
    hf = model_hf_config(run)
    try:
        validate_layout_for_model(hf, run.parallel, training=True)
    except (ParallelLayoutError, UnsupportedModelError) as err:
        raise ConfigError(f"parallel: {err}") from None
    validate_images_reach_the_model(run, hf)
    if run.engine.server not in ("embedded", "sglang"):
        raise ConfigError(f"engine.server={run.engine.server!r}; choose 'embedded' or 'sglang'")
    if not run.engine.urls:  # engines this run starts: refused before any process starts
        from rollout.engine_guard import InsecureBind, require_token, resolve_token

        try:
            require_token(run.engine.host, resolve_token(run.engine.auth_token), "the run's engines (engine.host)")
        except InsecureBind as err:
            raise ConfigError(str(err)) from None
    if run.engine.server == "sglang" and not run.engine.urls and run.placement.launcher != "ray":
        raise ConfigError("engine.server='sglang' is started by placement.launcher=ray (or give engine.urls)")


def validate_lora(run: RunConfig) -> None:
    """actor.lora: adapters on the policy's local-spec linears (models/lora.py)."""
    if run.critic.lora.enabled:
        raise ConfigError(f"critic.lora.rank={run.critic.lora.rank}: the critic trains every weight (LoRA is "
                          "built for the actor); set critic.lora.rank=0")
    # On a GPU, layer_spec=auto takes Transformer Engine's layers (models/builder.py).
    te = run.actor.layer_spec == "transformer_engine" or (
        run.actor.layer_spec == "auto" and run.placement.gpus_per_trainer > 0)
    if run.actor.lora.enabled and te:
        raise ConfigError(f"actor.lora with actor.layer_spec={run.actor.layer_spec} on "
                          f"{run.placement.gpus_per_trainer} GPU(s) per trainer (Transformer Engine's layers): "
                          "adapters are built on the local layer spec's linears only so far; "
                          "set actor.layer_spec=local")
    sync = run.weight_sync.lora
    if sync not in LORA_SYNC_MODES:
        raise ConfigError(f"weight_sync.lora={sync!r}; choose one of {LORA_SYNC_MODES}")
    if sync == "merged":
        return
    if not run.actor.lora.enabled:
        raise ConfigError("weight_sync.lora=adapters sends the actor's LoRA adapters alone; set actor.lora.rank > 0 "
                          "(or weight_sync.lora=merged)")
    if run.weight_sync.quantize:
        raise ConfigError(f"weight_sync.lora=adapters with weight_sync.quantize={run.weight_sync.quantize}: the "
                          "adapters go in the training dtype onto the engines' base weights; use one or the other")
    from megatron_agent.models.lora import adapter_serving_problem, hf_module_names

    hf = model_hf_config(run)
    problem = adapter_serving_problem(hf, run.actor.lora)
    if problem:
        raise ConfigError(f"weight_sync.lora=adapters: {problem}; use weight_sync.lora=merged")
    # resolved here, past the checks (it reads the model's config): requests name the adapters,
    # and SGLang servers start ready for them
    run.engine.lora_adapters = True
    run.engine.max_lora_rank = run.actor.lora.rank
    run.engine.lora_target_modules = hf_module_names(hf, run.actor.lora)


def validate_routing_replay(run: RunConfig) -> None:
    """algorithm.routing_replay replays, and engine.return_routed_experts returns, an MoE
    model's routing."""
    if run.algorithm.routing_replay == "none" and not run.engine.return_routed_experts:
        return
    if run.algorithm.routing_replay == "recompute" and run.actor.ppo_epochs == 1 and run.actor.num_mini_batches == 1:
        raise ConfigError("algorithm.routing_replay=recompute replays the old-logprob pass's routing in the "
                          "updates after it; with actor.ppo_epochs=1 and actor.num_mini_batches=1 the one update "
                          "routes as that pass did anyway (set more epochs or mini-batches, or routing_replay=none)")
    from megatron_agent.models.transformer_config import num_experts

    hf = model_hf_config(run)
    if not num_experts(hf):
        model = run.model_dir or f"tiny_model.family={run.tiny_model.family!r}"
        setting = (f"algorithm.routing_replay={run.algorithm.routing_replay}" if run.algorithm.routing_replay != "none"
                   else "engine.return_routed_experts=true")
        raise ConfigError(f"{setting} is about the routing of a mixture-of-experts model; {model} "
                          f"(model_type={hf.get('model_type')!r}) has no experts (model=tiny-moe, "
                          "model=qwen3-30b-a3b)")


def validate_quantized_rollout(run: RunConfig) -> None:
    """weight_sync.quantize, and what SGLang's block-FP8 layers need of the model and engines."""
    from megatron_agent.weight_sync.fp8 import QUANTIZE_MODES, sglang_fp8_problems

    if run.weight_sync.quantize is None:
        return
    if run.weight_sync.quantize not in QUANTIZE_MODES:
        raise ConfigError(f"weight_sync.quantize={run.weight_sync.quantize!r}; choose one of {QUANTIZE_MODES} "
                          "(or null: the training dtype)")
    if run.engine.server != "sglang":
        return  # the embedded engine dequantizes any shape
    if run.engine.dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"weight_sync.quantize=fp8 with engine.server=sglang needs engine.dtype bfloat16 or "
                          f"float16 (SGLang's FP8 layers refuse {run.engine.dtype})")
    hf = model_hf_config(run)
    engine_tp = max(1, run.engine.gpus_per_engine)
    problems = sglang_fp8_problems(hf, engine_tp, engine_ep=_server_arg(run.engine.server_args, "--ep-size", 1))
    if problems:
        raise ConfigError(f"weight_sync.quantize=fp8: SGLang cannot serve this model with 128x128 block-FP8 "
                          f"weights at engine TP {engine_tp} (engine.gpus_per_engine): {'; '.join(problems)}")


def validate_images_reach_the_model(run: RunConfig, hf: dict) -> None:
    """An env whose prompts carry images (render_image, loop.prompt.max_images >= 1) needs a
    vision-language model; a VLM on a text env is fine."""
    from envs.registry import make_config

    renders = bool(getattr(make_config(run.env, dict(run.env_config)), "render_image", False))
    if renders and run.loop.prompt.max_images >= 1 and not hf.get("vision_config"):
        model = run.model_dir or f"tiny_model.family={run.tiny_model.family!r}"
        raise ConfigError(
            f"env={run.env} with render_image=true puts images in the prompts, but the model ({model}, "
            f"model_type={hf.get('model_type')!r}) has no vision tower: use a vision-language model "
            "(model=qwen3-vl-30b-a3b, model=qwen3-vl-8b, tiny_model.family=qwen3_vl), or "
            "env_config.render_image=false / loop.prompt.max_images=0 for text-only prompts")


# ---- what the rollout would hit: the prompt budget against the context, the tokenizer ----

SAMPLE_SEEDS = 3  # resets whose observations the tokenizer check reads


def validate_prompt_fits_context(run: RunConfig) -> None:
    """A prompt (at most loop.prompt.max_prompt_tokens) plus the most tokens a response may
    add must fit the model's context: the engines refuse a longer request."""
    hf = model_hf_config(run)
    context = hf.get("max_position_embeddings")
    if run.engine.server == "sglang":
        context = _server_arg(run.engine.server_args, "--context-length", context)
    if context is None:
        return
    responses = [("loop.sampling.max_new_tokens", run.loop.sampling.max_new_tokens)]
    if run.val_every:
        responses.append(("loop.validation.sampling.max_new_tokens", run.loop.validation.sampling.max_new_tokens))
    key, new_tokens = max(responses, key=lambda kv: kv[1])
    prompt = run.loop.prompt.max_prompt_tokens
    if prompt + new_tokens > context:
        model = run.model_dir or "the tiny model (tiny_model.*)"
        fix = (f"set loop.prompt.max_prompt_tokens={context - new_tokens} or less (or lower {key})"
               if new_tokens < context else f"set {key} well below {context}")
        raise ConfigError(
            f"loop.prompt.max_prompt_tokens={prompt} plus {key}={new_tokens} exceed the context of {model}, "
            f"{context} tokens (max_position_embeddings): the engines would refuse the longest prompts mid-run; "
            f"{fix}")


def validate_tokenizer_reads_the_env(run: RunConfig, env_copy) -> None:
    """The prompts the agent loop builds for this env (its instructions, the prompt's own
    words, the observations of a few resets) have no word the tokenizer lacks a token for.
    A tokenizer without an unknown token (byte-level BPE: every text encodes) passes
    unread; the observations are read only when the fixed text passes."""
    if run.allow_unknown_tokens:
        return
    tokenizer = run_tokenizer(run)
    if tokenizer is None or tokenizer.unk_token_id is None or not tokenizer.is_fast:
        return
    found = _unknown_words(run, tokenizer, [""])
    if not found:
        found = _unknown_words(run, tokenizer, [env_copy.reset(seed).text for seed in range(SAMPLE_SEEDS)])
    if found:
        shown = ", ".join(repr(w) for w in found[:12]) + (f" and {len(found) - 12} more" if len(found) > 12 else "")
        if run.model_dir is None:
            fix = ("set tiny_model.tokenizer=bpe (byte-level: any text encodes)" if run.tiny_model.tokenizer != "bpe"
                   else "choose another tiny_model.tokenizer")
            whose = f"tiny_model.tokenizer={run.tiny_model.tokenizer!r}"
        else:
            fix, whose = "use a model whose tokenizer covers the text", f"the tokenizer of {run.model_dir}"
        raise ConfigError(
            f"env={run.env}: {whose} has no token for {shown} in the env's prompts, so the model could neither "
            f"read nor write them; {fix}, or allow_unknown_tokens=true to run with them unknown")


def run_tokenizer(run: RunConfig):
    """The tokenizer the run's engines and trainer load: the tiny model's (made from its
    settings, as prepare_run_dir writes it) or model_dir's; None where model_dir has none."""
    from megatron_agent.models.tiny import VISION_FAMILIES, build_tokenizer

    if run.model_dir is None:
        return build_tokenizer(run.tiny_model.tokenizer, vision=run.tiny_model.family in VISION_FAMILIES)
    if not any((Path(run.model_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(run.model_dir)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model_dir={run.model_dir!r}: its tokenizer does not load ({err})") from None


def _unknown_words(run: RunConfig, tokenizer, observations: list[str]) -> list[str]:
    """The pieces of text the tokenizer encodes as its unknown token, in the prompts
    rollout/prompts.py builds around these observations (with a full history), in order."""
    from envs.registry import env_instructions, make_config
    from rollout.memory import StepRecord, memory_factory
    from rollout.prompts import build_messages

    instructions = env_instructions(run.env, make_config(run.env, dict(run.env_config)))
    prompt = run.loop.prompt
    found: dict[str, None] = {}
    for observation in observations:
        memory = memory_factory(prompt.memory, prompt.history_length)()
        for step in range(1, prompt.history_length + 2):  # a full window (and a summary's digest)
            memory.store(StepRecord(step, observation, "", 0.0, True))
        for message in build_messages(instructions, observation, memory.render(None), prompt.history_length + 2,
                                      prompt):
            encoded = tokenizer.backend_tokenizer.encode(message["content"], add_special_tokens=False)
            found.update((message["content"][a:b], None) for token, (a, b) in zip(encoded.ids, encoded.offsets)
                         if token == tokenizer.unk_token_id)
    return list(found)


def model_hf_config(run: RunConfig) -> dict:
    """The model's HF config as `read_hf_config` gives it: a VLM's text_config lifted to the
    top, its vision_config kept (the tiny model's, made from the same functions as run_dir's)."""
    from megatron_agent.models.tiny import (
        VISION_FAMILIES,
        build_tokenizer,
        embedding_rows,
        hf_config_for,
        vision_config_for,
    )
    from megatron_agent.models.transformer_config import read_hf_config

    if run.model_dir is None:
        tiny = run.tiny_model
        if tiny.family in VISION_FAMILIES:
            vision = vision_config_for(tiny.family, build_tokenizer(tiny.tokenizer, vision=True), tiny.preset,
                                       num_hidden_layers=tiny.num_hidden_layers)
            return read_hf_config({"model_type": tiny.family, **vision})
        return {"model_type": tiny.family,
                **hf_config_for(tiny.family, tiny.preset, num_hidden_layers=tiny.num_hidden_layers,
                                vocab_size=embedding_rows(build_tokenizer(tiny.tokenizer)))}
    return read_hf_config(Path(run.model_dir))


def _server_arg(args, flag: str, default: int) -> int:
    """An integer flag among SGLang's extra arguments (`--flag N` or `--flag=N`)."""
    args = list(args)
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith(flag + "="):
            return int(arg.split("=", 1)[1])
    return default
