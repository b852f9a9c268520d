"""Where generation runs (`EngineConfig`), and starting and stopping engine processes on
this machine: embedded engines (`python -m rollout.engine_server`; tests, the CPU driver)
and SGLang servers."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rollout.engine_client import EngineClient, http_json
from rollout.processes import die_with_parent, free_port

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
           log_dir: Path, index: int) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log_path = log_dir / f"engine-{index}-{port}.log"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    if token:
        env["MEGATRON_AGENT_ENGINE_TOKEN"] = token
    cmd = [sys.executable, "-m", "rollout.engine_server", "--model", str(model_path), "--host", host,
           "--port", str(port), "--threads", str(threads), "--max-batch-size", str(max_batch_size),
           "--dtype", dtype]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(Path(__file__).resolve().parent.parent), preexec_fn=die_with_parent)
    return proc, port, log_path


def launch_engines(model_path: str | Path, num_engines: int = 1, *, host: str = "127.0.0.1",
                   threads: int = 1, max_batch_size: int = 256, dtype: str = "float32",
                   token: str | None = None, timeout_s: float = 120.0, log_dir: str | Path | None = None) -> list[EngineProcess]:
    """Start `num_engines` embedded engines on free ports; return once all answer /health."""
    model_path = Path(model_path).resolve()  # the engine processes may run elsewhere
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="engines-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[EngineProcess] = []
    try:
        for i in range(num_engines):
            for attempt in range(_PORT_RETRIES):
                proc, port, log_path = _start(str(model_path), host, threads, max_batch_size, dtype, token,
                                                log_dir, i)
                url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
                engine = EngineProcess(f"http://{url_host}:{port}", proc, log_path)
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


def launch_embedded_engines(config: EngineConfig, model_path: str | Path,
                            log_dir: str | Path | None = None) -> list[EngineProcess]:
    """The driver's default engine launcher: `config.num_engines` embedded engines here."""
    return launch_engines(model_path, config.num_engines, host=config.host, threads=config.threads_per_engine,
                          max_batch_size=config.max_batch_size, dtype=config.dtype, token=config.auth_token,
                          log_dir=log_dir)


def sglang_server_command(config: EngineConfig, model_path: str | Path, port: int) -> list[str]:
    """The command line of one SGLang server (GPU machines; the `gpu` extra installs it)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", config.host,
            "--port", str(port), "--tp-size", str(max(1, config.gpus_per_engine)), "--dtype", config.dtype,
            "--max-running-requests", str(config.max_batch_size),
            *(["--api-key", config.auth_token] if config.auth_token else []), *config.server_args]


def start_sglang_server(config: EngineConfig, model_path: str | Path, log_dir: str | Path,
                        index: int = 0, timeout_s: float = 900.0) -> EngineProcess:
    """Start one SGLang server on a free port (its GPUs are CUDA_VISIBLE_DEVICES) and wait
    until it answers /health; the URL names this host as others reach it."""
    import socket

    port = free_port()
    log_path = Path(log_dir) / f"sglang-{index}-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(sglang_server_command(config, model_path, port), stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    host = socket.gethostbyname(socket.gethostname()) if config.host in ("0.0.0.0", "::") else config.host
    engine = EngineProcess(f"http://{host}:{port}", proc, log_path)
    if not wait_healthy(engine, timeout_s):
        raise RuntimeError(f"SGLang server {index} did not start; its log ({log_path}):\n"
                           + log_path.read_text()[-3000:])
    return engine


def engine_client(config: EngineConfig, urls: list[str]) -> EngineClient:
    return EngineClient(urls, timeout_s=config.timeout_s, max_attempts=config.max_attempts,
                        auth_token=config.auth_token)


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
    return engine_client(config, urls), started
