"""Colocated engines on GPUs: the configs refused before any process starts, and what the
run makes of an engine's /server_info (does its memory release free anything?).

References: SGLang 0.5.23 answers /server_info with its resolved server arguments, among
them `enable_memory_saver` and `device` (server_args.py `resolved_dict`); without the
memory saver its /release_memory_occupation pauses a no-op adapter and answers 200
(utils/torch_memory_saver_adapter.py `_TorchMemorySaverAdapterNoop`)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_agent.engine_fleet import EngineFleet, release_check
from megatron_agent.run_config import ConfigError, RunConfig, load_run_config
from rollout.engine_client import EngineError

RAY_GPUS = ["placement.launcher=ray", "placement.colocate=true", "placement.gpus_per_trainer=1",
            "engine.server=sglang"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["placement.trainer_ranks=2", "engine.num_engines=2", "engine.gpus_per_engine=2"],
         "engine.num_engines=2 x engine.gpus_per_engine=2 engine ranks need 4 GPUs, and the 2 trainer ranks have 2 "
         "(a GPU holds one trainer rank and at most one engine rank): set engine.num_engines <= 1"),
        (["placement.trainer_ranks=2", "engine.gpus_per_engine=4"], "set engine.gpus_per_engine <= 2"),
        (["placement.trainer_ranks=2", "placement.gpus_per_trainer=2", "engine.gpus_per_engine=1"],
         "colocated engines run on the trainer ranks' GPUs, one GPU per rank: set placement.gpus_per_trainer=1 "
         "(it is 2)"),
        (["placement.trainer_ranks=2", "engine.gpus_per_engine=0"],
         "engine.server=sglang runs on GPUs: set engine.gpus_per_engine"),
        (["placement.trainer_ranks=2", "engine.gpus_per_engine=1", "engine.mem_fraction_static=1.5"],
         "engine.mem_fraction_static=1.5 must be in (0, 1)"),
    ],
)
def test_colocated_gpu_configs_that_cannot_be_placed_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_run_config([*RAY_GPUS, *overrides])


def test_engines_that_fit_on_the_trainer_gpus_are_accepted():
    run = load_run_config([*RAY_GPUS, "placement.trainer_ranks=4", "engine.num_engines=2", "engine.gpus_per_engine=2"])
    assert (run.engine.num_engines, run.engine.gpus_per_engine, run.engine.mem_fraction_static) == (2, 2, None)


def test_what_a_release_frees_by_the_engines_server_info():
    embedded = {"tp_size": 1, "dtype": "float32", "max_running_requests": 256}  # rollout/engine_server.py's answer
    saver = {"enable_memory_saver": True, "device": "cuda", "tp_size": 2}
    cpu = {"enable_memory_saver": False, "device": "cpu", "tp_size": 1}
    assert release_check({"http://a": embedded, "http://b": saver}) == (True, None)
    assert release_check({"http://a": cpu}) == (False, None)  # SGLang on a CPU: nothing to free, nothing to refuse
    frees, problem = release_check({"http://a": saver, "http://b": {"enable_memory_saver": False, "device": "cuda"}})
    assert not frees
    assert problem.startswith("http://b is SGLang on cuda without --enable-memory-saver") and "http://a" not in problem


class _ServerInfo(BaseHTTPRequestHandler):
    info: dict = {}

    def do_GET(self):
        body = json.dumps(self.info if self.path == "/server_info" else {}).encode()
        self.send_response(200 if self.path == "/server_info" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_colocated_run_refuses_sglang_on_a_gpu_without_its_memory_saver(tmp_path):
    """An SGLang fleet given by URL, on a GPU, started without --enable-memory-saver: the
    fleet refuses it before the first rollout (it answered the release with 200 and the
    run reported engine/memory_released=1 while the actor ran out of memory)."""
    handler = type("Handler", (_ServerInfo,), {"info": {"enable_memory_saver": False, "device": "cuda",
                                                        "tp_size": 1}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    run = RunConfig(run_dir=str(tmp_path))
    run.placement.colocate, run.engine.urls = True, (url,)
    try:
        with pytest.raises(EngineError, match=f"{url} is SGLang on cuda without --enable-memory-saver"):
            EngineFleet(run, str(tmp_path), actor=None, leader=True)
    finally:
        server.shutdown()
        server.server_close()
