"""Where generation runs (`EngineConfig`), and starting and stopping engine processes on
this machine: embedded engines (`python -m rollout.engine_server`; tests, the CPU driver)
and SGLang servers."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout.engine_client import EngineClient, http_json
from rollout.engine_guard import require_token, resolve_token
from rollout.processes import die_with_parent, free_port
from rollout.routed_experts import route_shape
from rollout.vision import is_vision_model

_PORT_RETRIES = 3


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
    # Sent as `Authorization: Bearer <token>` (SGLang: --api-key). An engine bound beyond
    # loopback refuses to start without one; with one, weight-update and control calls need
    # it (docs/security.md). None: read MEGATRON_AGENT_ENGINE_TOKEN.
    auth_token: str | None = None
    threads_per_engine: int = 1  # per rank
    # Weight-update ranks of each embedded engine (replicas, `--ranks`); SGLang's is its TP size.
    ranks_per_engine: int = 1
    max_batch_size: int = 256
    # The asynchronous agent loop's requests open at once on each engine (the rest queue in
    # the client); about the engine's own batch, so it batches continuously.
    max_inflight_per_engine: int = 64
    # Requests per /generate call of the asynchronous loop (rollout/engine_client.py): 1 for
    # SGLang (it batches continuously); more for the embedded engine, which runs a call's
    # prompts as one batch.
    requests_per_call: int = 1
    dtype: str = "float32"
    # What the driver starts when `urls` is empty: "embedded" (this project's CPU engine)
    # or "sglang" (an SGLang server per engine, on `gpus_per_engine` GPUs, placement=ray).
    server: str = "embedded"
    gpus_per_engine: int = 0
    # SGLang's --mem-fraction-static: the share of the GPU memory free at its start that it
    # takes for weights and KV cache. None: SGLang's own choice, or, colocated with the
    # trainer, COLOCATED_MEM_FRACTION_STATIC (the rest is the actor's while the engine runs).
    mem_fraction_static: float | None = None
    server_args: tuple[str, ...] = ()  # extra command-line flags for each SGLang server (they come last: they win)
    # Ask for each fed token's experts (MoE routing replay; SGLang's --enable-return-routed-
    # experts, rollout/routed_experts.py); the run turns it on with algorithm.routing_replay.
    return_routed_experts: bool = False
    # Serve the trainer's LoRA adapters (weight_sync.lora=adapters, which turns it on): each
    # request names its server's current adapter; SGLang servers start with --enable-lora,
    # --max-lora-rank and --lora-target-modules (HF module names), set from actor.lora.
    lora_adapters: bool = False
    max_lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()


# Colocated SGLang's default --mem-fraction-static. SGLang (0.5.23) sizes its KV cache so
# that weights + cache take this share of the GPU memory free when it starts, after the
# actor's model; the actor's later allocations (optimizer state, activations it keeps
# cached) must fit in the rest while the engine holds its memory.
COLOCATED_MEM_FRACTION_STATIC = 0.5
WILDCARD_HOSTS = ("0.0.0.0", "::")


def engine_url_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host in the URL of an engine bound to `bind_host`: that address, or, bound to
    every address, `advertise_host` (the address other machines reach this one at; under
    Ray the node's, `ray.util.get_node_ip_address()`), else loopback. Not this machine's
    name looked up in /etc/hosts: Debian-style hosts files map it to 127.0.1.1, which no
    other machine reaches."""
    host = bind_host if bind_host not in WILDCARD_HOSTS else advertise_host or "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass
class EngineProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests)."""
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start(model_path: str, host: str, threads: int, max_batch_size: int, dtype: str, token: str | None,
           log_dir: Path, index: int, ranks: int = 1,
           allowed_weight_dirs: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log_path = log_dir / f"engine-{index}-{port}.log"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    if token:
        env["MEGATRON_AGENT_ENGINE_TOKEN"] = token
    cmd = [sys.executable, "-m", "rollout.engine_server", "--model", str(model_path), "--host", host,
           "--port", str(port), "--threads", str(threads), "--max-batch-size", str(max_batch_size),
           "--dtype", dtype, *(["--ranks", str(ranks)] if ranks != 1 else []),
           *(["--allowed-weight-dirs", *allowed_weight_dirs] if allowed_weight_dirs else [])]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(Path(__file__).resolve().parent.parent), preexec_fn=die_with_parent)
    return proc, port, log_path


def launch_engines(model_path: str | Path, num_engines: int = 1, *, host: str = "127.0.0.1",
                   threads: int = 1, max_batch_size: int = 256, dtype: str = "float32",
                   token: str | None = None, timeout_s: float = 120.0, log_dir: str | Path | None = None,
                   ranks: int = 1, allowed_weight_dirs: Sequence[str | Path] = (),
                   advertise_host: str | None = None) -> list[EngineProcess]:
    """Start `num_engines` embedded engines (of `ranks` weight-update ranks each) on free
    ports; return once all answer /health. /update_weights_from_disk loads, without the
    token, from the model's directory and `allowed_weight_dirs`. Bound beyond loopback
    without a token (`token`, else MEGATRON_AGENT_ENGINE_TOKEN): `InsecureBind`. Their
    URLs name `engine_url_host(host, advertise_host)`."""
    require_token(host, resolve_token(token), "an embedded engine")
    model_path = Path(model_path).resolve()  # the engine processes may run elsewhere
    weight_dirs = tuple(dict.fromkeys(str(Path(d).resolve()) for d in (model_path, *allowed_weight_dirs)))
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="engines-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[EngineProcess] = []
    try:
        for i in range(num_engines):
            for attempt in range(_PORT_RETRIES):
                proc, port, log_path = _start(str(model_path), host, threads, max_batch_size, dtype, token,
                                                log_dir, i, ranks, weight_dirs)
                engine = EngineProcess(f"http://{engine_url_host(host, advertise_host)}:{port}", proc, log_path)
                if wait_healthy(engine, timeout_s):
                    started.append(engine)
                    break
                if attempt == _PORT_RETRIES - 1 or "Address already in use" not in log_path.read_text():
                    raise RuntimeError(f"embedded engine {i} did not start; its log ({log_path}):\n"
                                       + log_path.read_text()[-3000:])
        return started
    except BaseException:
        stop_engines(started)
        raise


def wait_healthy(engine: EngineProcess, timeout_s: float) -> bool:
    """Poll /health until it answers 200 (True), the process exits or time runs out (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            return False
        try:
            if http_json("GET", engine.url + "/health", timeout_s=2.0)[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    engine.stop()
    return False


def stop_engines(engines: list[EngineProcess]) -> None:
    for e in engines:
        e.stop()


def launch_embedded_engines(config: EngineConfig, model_path: str | Path, log_dir: str | Path | None = None,
                            advertise_host: str | None = None) -> list[EngineProcess]:
    """The driver's default engine launcher: `config.num_engines` embedded engines here.
    `log_dir` is the run directory's `engines/` folder: the run directory (its parent) and
    the model's directory are where the engines may load weights from disk."""
    return launch_engines(model_path, config.num_engines, host=config.host, threads=config.threads_per_engine,
                          max_batch_size=config.max_batch_size, dtype=config.dtype, token=config.auth_token,
                          log_dir=log_dir, ranks=config.ranks_per_engine,
                          allowed_weight_dirs=[Path(log_dir).parent] if log_dir else (),
                          advertise_host=advertise_host)


def sglang_server_command(config: EngineConfig, model_path: str | Path, port: int, *,
                          colocated: bool = False) -> list[str]:
    """The command line of one SGLang server (GPU machines; the `gpu` extra installs it).
    Bound beyond loopback it needs an API key (`config.auth_token`, else
    MEGATRON_AGENT_ENGINE_TOKEN): `InsecureBind` otherwise. `colocated` (with the trainer,
    on its GPUs): the memory saver on, without which SGLang's /release_memory_occupation
    frees nothing and still answers 200, and `--mem-fraction-static`
    COLOCATED_MEM_FRACTION_STATIC unless `config.mem_fraction_static` says otherwise."""
    token = resolve_token(config.auth_token)
    require_token(config.host, token, "an SGLang server")
    fraction = config.mem_fraction_static
    if colocated and fraction is None:
        fraction = COLOCATED_MEM_FRACTION_STATIC
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", config.host,
            "--port", str(port), "--tp-size", str(max(1, config.gpus_per_engine)), "--dtype", config.dtype,
            "--max-running-requests", str(config.max_batch_size),
            *(["--enable-memory-saver"] if colocated else []),
            *(["--mem-fraction-static", str(fraction)] if fraction is not None else []),
            *(["--api-key", token] if token else []),
            *(["--enable-return-routed-experts"] if config.return_routed_experts else []),
            *(["--enable-lora", "--max-lora-rank", str(config.max_lora_rank), "--lora-target-modules",
               *config.lora_target_modules] if config.lora_adapters else []), *config.server_args]


def sglang_model_environment(model_path: str | Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment for this model. A vision-language model gets
    SGLANG_VLM_CACHE_SIZE_MB=0: SGLang 0.5.23 caches vision embeddings by image hash and
    no weight update or /flush_cache clears them, so images seen before a sync would be
    served with the old tower's features (measured: logprob gaps of 1.5e-2 to 4.1e-2
    and flipped greedy tokens; tests/integration/rollout/test_sglang_vlm.py)."""
    env = dict(os.environ if base is None else base)
    if is_vision_model(model_path):
        env["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
    return env


def start_sglang_server(config: EngineConfig, model_path: str | Path, log_dir: str | Path,
                        index: int = 0, timeout_s: float = 900.0, *, advertise_host: str | None = None,
                        colocated: bool = False, cuda_visible_devices: str | None = None) -> EngineProcess:
    """Start one SGLang server on a free port and wait until it answers /health. Its GPUs
    are CUDA_VISIBLE_DEVICES: this process's, or `cuda_visible_devices` (a colocated
    engine of TP > 1 spans the GPUs of several trainer ranks). `colocated`: see
    `sglang_server_command`. The URL names `engine_url_host(config.host, advertise_host)`."""
    port = free_port()
    log_path = Path(log_dir) / f"sglang-{index}-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = sglang_server_command(config, model_path, port, colocated=colocated)
    env = sglang_model_environment(model_path)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
    engine = EngineProcess(f"http://{engine_url_host(config.host, advertise_host)}:{port}", proc, log_path)
    if not wait_healthy(engine, timeout_s):
        raise RuntimeError(f"SGLang server {index} did not start; its log ({log_path}):\n"
                           + log_path.read_text()[-3000:])
    return engine


# --- SGLang on CPU: the real server, in a venv of its own (tests, CPU-only machines) ---

SGLANG_PYTHON_ENV = "MEGATRON_AGENT_SGLANG_PYTHON"  # the Python of a venv with SGLang installed
SGLANG_CPU_SHIM_ENV = "MEGATRON_AGENT_SGLANG_CPU_SHIM"  # turns tools/sglang_cpu/sitecustomize.py on
_CHECKOUT = Path(__file__).resolve().parent.parent
SGLANG_CPU_TOOLS = _CHECKOUT / "tools" / "sglang_cpu"
SGLANG_CPU_VENV = _CHECKOUT / ".venv-sglang"  # `make test` installs it (Makefile: $(VENV_SGLANG))


class SGLangCPUServer(EngineProcess):
    """An SGLang server started in a session of its own. It forks a scheduler per rank
    and a detokenizer, so stop() and kill() signal its whole process group."""

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        import signal

        self._signal_group(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        import signal

        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # children that outlived the server
        self.proc.wait()


def sglang_cpu_python() -> str | None:
    """The Python that runs SGLang on CPU: $MEGATRON_AGENT_SGLANG_PYTHON, else this
    checkout's `.venv-sglang` when it exists, else None."""
    explicit = os.environ.get(SGLANG_PYTHON_ENV)
    if explicit:
        return explicit
    python = SGLANG_CPU_VENV / "bin" / "python"
    return str(python) if python.exists() else None


def cpu_binding(ranks: int, cpus: list[int] | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks: the cores this process may run on,
    split in contiguous shares, one per rank ("0|1": 2 ranks on 2 cores; "0-1|2-3": 2
    on 4). With fewer cores than ranks, ranks share cores."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    shares = []
    for r in range(ranks):
        share = cpus[r * len(cpus) // ranks:(r + 1) * len(cpus) // ranks] or [cpus[r % len(cpus)]]
        runs: list[list[int]] = []
        for cpu in share:
            if runs and cpu == runs[-1][-1] + 1:
                runs[-1].append(cpu)
            else:
                runs.append([cpu])
        shares.append(",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs))
    return "|".join(shares)


def sglang_cpu_environment(tp_size: int = 1, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an SGLang server on CPU: its CPU engine, the placeholder modules
    for `sgl_kernel` and `torchvision` (tools/sglang_cpu/sitecustomize.py, on PYTHONPATH),
    and with TP > 1 the cores of each rank (SGLang refuses more ranks than NUMA nodes
    without them)."""
    env = dict(os.environ if base is None else base)
    env.update({"SGLANG_USE_CPU_ENGINE": "1", SGLANG_CPU_SHIM_ENV: "1", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = os.pathsep.join([str(SGLANG_CPU_TOOLS), *filter(None, [env.get("PYTHONPATH")])])
    if tp_size > 1:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_binding(tp_size))
    return env


def sglang_cpu_command(model_path: str | Path, port: int, *, python: str | None = None, host: str = "127.0.0.1",
                       tp_size: int = 1, dtype: str = "float32", mem_fraction_static: float = 0.05,
                       max_total_tokens: int = 20000, auth_token: str | None = None,
                       extra_args: tuple[str, ...] = ()) -> list[str]:
    """The command line of one SGLang server on CPU (torch-native attention, no CUDA
    graphs, a small KV pool; a vision-language model's images processed with Pillow, since
    torchvision is a placeholder here, and its tower on SDPA attention). Bound beyond
    loopback it needs an API key (`auth_token`, else MEGATRON_AGENT_ENGINE_TOKEN):
    `InsecureBind` otherwise."""
    token = resolve_token(auth_token)
    require_token(host, token, "an SGLang server")
    vision = ("--image-processor-backend", "pil", "--mm-attention-backend", "sdpa") if is_vision_model(model_path) else ()
    return [python or sglang_cpu_python() or sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_path), "--host", host, "--port", str(port), "--tp-size", str(tp_size),
            "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--dtype", dtype,
            "--mem-fraction-static", str(mem_fraction_static), "--max-total-tokens", str(max_total_tokens),
            *(["--api-key", token] if token else []), *vision, *extra_args]


def start_sglang_cpu_server(model_path: str | Path, *, tp_size: int = 1, python: str | None = None,
                            host: str = "127.0.0.1", log_dir: str | Path | None = None, timeout_s: float = 300.0,
                            extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                            **command_args) -> SGLangCPUServer:
    """Start SGLang on CPU on a free port, in its own session, and wait for /health.
    `python`: the SGLang venv's (default `sglang_cpu_python()`). Stop it with `.stop()`."""
    python = python or sglang_cpu_python()
    if python is None:
        raise FileNotFoundError(f"no SGLang venv: run `make {SGLANG_CPU_VENV.name}/.installed` or set "
                                f"{SGLANG_PYTHON_ENV} to a Python with sglang installed")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="sglang-cpu-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(_PORT_RETRIES):
        port = free_port()
        log_path = log_dir / f"sglang-cpu-tp{tp_size}-{port}.log"
        cmd = sglang_cpu_command(Path(model_path).resolve(), port, python=python, host=host, tp_size=tp_size,
                                 extra_args=tuple(extra_args), **command_args)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=sglang_model_environment(model_path, sglang_cpu_environment(tp_size, env)),
                                    start_new_session=True,
                                    preexec_fn=die_with_parent)
        server = SGLangCPUServer(f"http://{engine_url_host(host)}:{port}", proc, log_path)
        if wait_healthy(server, timeout_s):
            return server
        server.stop()
        if attempt == _PORT_RETRIES - 1 or "address already in use" not in log_path.read_text().lower():
            raise RuntimeError(f"SGLang on CPU (tp {tp_size}) did not start; its log ({log_path}):\n"
                               + log_path.read_text()[-4000:])
    raise AssertionError("unreachable")


def engine_client(config: EngineConfig, urls: list[str], model_path: str | Path | None = None) -> EngineClient:
    """A client for `urls`; with `config.return_routed_experts`, one that asks for routes and
    reads them in the layout of the model at `model_path` (its config.json)."""
    if config.return_routed_experts and model_path is None:
        raise ValueError("engine.return_routed_experts needs the model's path (its layers, top-k and experts)")
    return EngineClient(urls, timeout_s=config.timeout_s, max_attempts=config.max_attempts,
                        auth_token=config.auth_token, max_inflight_per_engine=config.max_inflight_per_engine,
                        requests_per_call=config.requests_per_call,
                        route_shape=route_shape(model_path) if config.return_routed_experts else None,
                        lora_adapters=config.lora_adapters)


def start_engines(config: EngineConfig, model_path: str | Path | None = None,
                  log_dir: str | Path | None = None) -> tuple[EngineClient, list[EngineProcess]]:
    """A client for `config.urls` (SGLang servers or a router) when given, else for
    `config.num_engines` embedded engines started here on `model_path`. Returns the
    client and the processes started (stop them at the end)."""
    started: list[EngineProcess] = []
    urls = list(config.urls)
    if not urls:
        if model_path is None:
            raise ValueError("no engine URLs configured and no model path to start embedded engines on")
        started = launch_embedded_engines(config, model_path, log_dir)
        urls = [e.url for e in started]
    return engine_client(config, urls, model_path), started
