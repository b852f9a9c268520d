"""The SGLang server's command line on GPUs (colocated or not) and the host in engine URLs.

References (SGLang 0.5.23, server_args.py and its arg_groups): `--enable-memory-saver`
(default off) is what makes /release_memory_occupation free weights and KV cache (off, the
memory saver adapter is a no-op and the call still answers 200); `--mem-fraction-static`
is the share of the GPU memory free at start that weights + KV cache take; of a flag given
twice, argparse keeps the last (checked against SGLang's own parser: `--mem-fraction-static
0.5 ... --mem-fraction-static 0.3` parses as 0.3)."""

from __future__ import annotations

import socket
import subprocess

import pytest

import rollout.engine_launch as engine_launch
from rollout.engine_launch import (
    COLOCATED_MEM_FRACTION_STATIC,
    EngineConfig,
    engine_url_host,
    sglang_server_command,
    start_sglang_server,
)


def flag(cmd: list[str], name: str) -> list[str]:
    """The values `name` is given in `cmd`, in order (SGLang keeps the last)."""
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == name]


def test_a_colocated_server_frees_its_memory_when_released_and_leaves_the_actor_room(monkeypatch):
    monkeypatch.delenv("MEGATRON_AGENT_ENGINE_TOKEN", raising=False)
    config = EngineConfig(server="sglang", gpus_per_engine=2)
    colocated = sglang_server_command(config, "/m", 30000, colocated=True)
    assert "--enable-memory-saver" in colocated
    assert flag(colocated, "--mem-fraction-static") == [str(COLOCATED_MEM_FRACTION_STATIC)]
    assert 0 < COLOCATED_MEM_FRACTION_STATIC < 1
    alone = sglang_server_command(config, "/m", 30000)  # its GPUs are its own: SGLang's defaults
    assert "--enable-memory-saver" not in alone and "--mem-fraction-static" not in alone


def test_the_configured_fraction_wins_and_server_args_come_last(monkeypatch):
    monkeypatch.delenv("MEGATRON_AGENT_ENGINE_TOKEN", raising=False)
    config = EngineConfig(server="sglang", gpus_per_engine=1, mem_fraction_static=0.3)
    assert flag(sglang_server_command(config, "/m", 1, colocated=True), "--mem-fraction-static") == ["0.3"]
    assert flag(sglang_server_command(config, "/m", 1), "--mem-fraction-static") == ["0.3"]
    override = EngineConfig(server="sglang", gpus_per_engine=1, server_args=("--mem-fraction-static", "0.7"))
    assert flag(sglang_server_command(override, "/m", 1, colocated=True), "--mem-fraction-static")[-1] == "0.7"


def test_url_hosts_never_come_from_the_hosts_file(monkeypatch):
    """Debian-style /etc/hosts maps the machine's name to 127.0.1.1: an engine bound to
    every address is named by the address given for it, else loopback."""
    monkeypatch.setattr(socket, "gethostname", lambda: "worker-7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert engine_url_host("0.0.0.0", "10.0.0.7") == "10.0.0.7"
    assert engine_url_host("0.0.0.0") == "127.0.0.1"
    assert engine_url_host("::", "fd00::7") == "[fd00::7]"
    assert engine_url_host("10.1.1.1", "10.0.0.7") == "10.1.1.1"  # bound to one address: that one


def test_start_sglang_server_names_the_advertised_host(monkeypatch, tmp_path):
    monkeypatch.setattr(socket, "gethostname", lambda: "worker-7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kwargs: object())
    monkeypatch.setattr(engine_launch, "wait_healthy", lambda engine, timeout_s: True)
    config = EngineConfig(server="sglang", host="0.0.0.0", auth_token="k", gpus_per_engine=1)
    assert start_sglang_server(config, "/m", tmp_path).url.startswith("http://127.0.0.1:")
    assert start_sglang_server(config, "/m", tmp_path, advertise_host="10.0.0.7").url.startswith("http://10.0.0.7:")


@pytest.mark.parametrize("devices", [None, "2,3"])
def test_a_colocated_server_runs_on_the_gpus_it_is_given(monkeypatch, tmp_path, devices):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # what Ray gave the engine's actor
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kwargs: started.append(kwargs["env"]) or object())
    monkeypatch.setattr(engine_launch, "wait_healthy", lambda engine, timeout_s: True)
    start_sglang_server(EngineConfig(server="sglang", gpus_per_engine=2), "/m", tmp_path, colocated=True,
                        cuda_visible_devices=devices)
    assert started[0]["CUDA_VISIBLE_DEVICES"] == (devices or "2")
