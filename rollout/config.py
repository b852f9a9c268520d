"""Typed configs for the agent loop, sampling and the rollout engines."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingConfig:
    """Sampling for one generation call; sent to the engine as SGLang `sampling_params`.

    temperature 0 is greedy. `seed` is the base of the per-request sampling seeds: the
    agent loop derives each request's seed from (seed, env seed, copy, step), so a run
    does not depend on the order in which requests reach the engines.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = 0  # None: send no per-request seed (servers that do not take one)

    def to_params(self, sampling_seed: int | None = None) -> dict:
        params = dict(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=int(self.top_k),
            max_new_tokens=int(self.max_new_tokens),
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            skip_special_tokens=False,
        )
        if sampling_seed is not None:
            params["sampling_seed"] = int(sampling_seed)
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class PromptConfig:
    """What one step's prompt is made of (see rollout/prompts.py for the layout)."""

    # "window": the last `history_length` (observation, action) pairs; "summary": a running
    # digest of the whole episode plus that window; "none": the current observation only.
    memory: str = "window"
    history_length: int = 2
    max_prompt_tokens: int = 1024
    # The system message is the env's instructions (False: none, for tiny models trained
    # from scratch, which cannot read them); these wrap the user message ("" leaves a
    # header out).
    include_instructions: bool = True
    history_header: str = "Your previous turns (oldest first):"
    observation_header: str = "Current observation (step {step}):"
    action_footer: str = "What is your next action?"


@dataclass
class ValidationConfig:
    num_episodes: int = 16  # groups of size 1, seeds envs.validation_seed(0..n-1)
    first_seed_index: int = 0
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))


@dataclass
class AgentLoopConfig:
    max_steps: int = 15
    prompt: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # Overlap env stepping of one env manager (a slot of groups) with generation for
    # another. Results equal a synchronous run with the same seeds (tested), so it is on.
    async_slots: bool = True
    # Episodes whose env copy broke (info["failed"]) are not the policy's doing: their
    # samples are dropped and counted in metrics.
    drop_failed_episodes: bool = True


@dataclass
class EngineConfig:
    """Where generation runs.

    `urls` empty: the driver starts `num_engines` embedded engine processes on this
    machine (CPU default). Otherwise the SGLang servers (or one SGLang router URL).
    """

    urls: tuple[str, ...] = ()
    num_engines: int = 1
    host: str = "127.0.0.1"
    timeout_s: float = 300.0
    max_attempts: int = 3  # per request, across servers
    # Sent as `Authorization: Bearer <token>`; engines bound beyond 127.0.0.1 require it on
    # weight-update calls. None: read MEGATRON_AGENT_ENGINE_TOKEN.
    auth_token: str | None = None
    threads_per_engine: int = 1
    max_batch_size: int = 256
    dtype: str = "float32"
    # What the driver starts when `urls` is empty: "embedded" (this project's CPU engine)
    # or "sglang" (an SGLang server per engine, on `gpus_per_engine` GPUs, placement=ray).
    server: str = "embedded"
    gpus_per_engine: int = 0
    server_args: tuple[str, ...] = ()  # extra command-line flags for each SGLang server
