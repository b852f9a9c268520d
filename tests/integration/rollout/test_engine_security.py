"""The engines' guards (docs/security.md): no engine beyond loopback without a key, the
token on weight-update and control calls (constant-time), disk loads only from the
allowed directories, bounded bodies and generation lengths, validated token ids.

Servers bind 0.0.0.0 or 127.0.0.1 and are reached at 127.0.0.1: nothing leaves the machine.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from megatron_agent.models.tiny import write_tiny_model
from rollout import engine_guard
from rollout.embedded_engine import Engine
from rollout.engine_client import TOKEN_ENV, EngineClient, EngineError, http_json
from rollout.engine_guard import InsecureBind, bearer_ok, is_loopback, require_token
from rollout.engine_launch import (
    EngineConfig,
    launch_embedded_engines,
    launch_engines,
    sglang_server_command,
    start_sglang_server,
    stop_engines,
)
from rollout.engine_server import CONTROL_PATHS, make_server, serve
from rollout.processes import free_port

WEIGHT = "model.embed_tokens.weight"
GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(str(model_dir))


@contextmanager
def served(engine, *, host="127.0.0.1", token=None, **limits):
    """The engine behind make_server (serve's server) on a free port; yields its URL."""
    server = make_server(engine, host, 0, token=token, **limits)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def checksum(engine) -> float:
    return engine.weight_checksums([WEIGHT])[WEIGHT]


def raw(url: str, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict, str]:
    """One request with the headers exactly as given (no Content-Length added); (status, JSON, Connection)."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body or None)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null"), resp.getheader("Connection", "")
    finally:
        conn.close()


# -- who may start an engine where -----------------------------------------------------------

def test_loopback_is_only_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "node1", "localhost.evil.org"))
    require_token("127.0.0.1", None, "x")
    require_token("0.0.0.0", "k", "x")
    with pytest.raises(InsecureBind, match="x bound to 0.0.0.0 needs a token"):
        require_token("0.0.0.0", "", "x")
    with pytest.raises(InsecureBind, match="every address"):
        require_token("", None, "x")


def test_the_embedded_engine_refuses_to_start_off_loopback_without_a_token(model_dir, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit, match="the embedded engine bound to 10.0.0.1 needs a token"):
        serve("/no/such/model", host="10.0.0.1")  # refused before the model is looked at
    with pytest.raises(InsecureBind, match="an embedded engine bound to 0.0.0.0 needs a token"):
        launch_engines(model_dir, 1, host="0.0.0.0")  # before any process starts
    refused = subprocess.run([sys.executable, "-m", "rollout.engine_server", "--model", str(model_dir),
                              "--host", "0.0.0.0", "--port", str(free_port())],
                             env={k: v for k, v in os.environ.items() if k != TOKEN_ENV},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert "rollout.engine_server: error: the embedded engine bound to 0.0.0.0 needs a token" in refused.stderr


def test_the_sglang_launcher_needs_a_key_off_loopback(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    config = EngineConfig(server="sglang", host="0.0.0.0", gpus_per_engine=2)
    with pytest.raises(InsecureBind, match="an SGLang server bound to 0.0.0.0 needs a token"):
        sglang_server_command(config, "/models/m", 30000)

    def no_process(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(InsecureBind):
        start_sglang_server(config, "/models/m", tmp_path)
    local = sglang_server_command(EngineConfig(server="sglang"), "/models/m", 30000)
    assert "--api-key" not in local and local[local.index("--host") + 1] == "127.0.0.1"
    monkeypatch.setenv(TOKEN_ENV, "job-key")  # what slurm/train.sbatch exports
    cmd = sglang_server_command(config, "/models/m", 30000)
    assert cmd[cmd.index("--api-key") + 1] == "job-key"
    explicit = sglang_server_command(EngineConfig(server="sglang", host="0.0.0.0", auth_token="cfg"), "/m", 1)
    assert explicit[explicit.index("--api-key") + 1] == "cfg"


# -- the token -------------------------------------------------------------------------------------

def test_the_token_is_compared_in_constant_time(monkeypatch):
    assert bearer_ok("Bearer s3cret", "s3cret")
    for header in (None, "", "s3cret", "Bearer s3cre", "Bearer s3cret ", "bearer s3cret", "Bearer s3crét", "Basic x"):
        assert not bearer_ok(header, "s3cret"), header
    seen = []
    real = engine_guard.hmac.compare_digest
    monkeypatch.setattr(engine_guard.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    assert not bearer_ok("Bearer guess", "s3cret")
    assert seen == [(b"Bearer guess", b"Bearer s3cret")]


def test_off_loopback_every_control_call_needs_the_token_and_nothing_changes_without_it(model_dir, tmp_path):
    other = write_tiny_model("qwen3", tmp_path / "other", seed=1)  # outside every allowed directory
    started = launch_engines(model_dir, 1, host="0.0.0.0", token="run-key", log_dir=tmp_path / "logs")
    try:
        url = started[0].url
        owner = EngineClient([url], auth_token="run-key")
        before = http_json("POST", url + "/weights_checksum", {"names": [WEIGHT]})[1]["checksums"]
        bodies = {"/update_weights_from_disk": {"model_path": str(other)},
                  "/update_weight_version": {"new_version": "x"}, "/pause_generation": {"mode": "abort"},
                  "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}}
        for path in sorted(CONTROL_PATHS):
            for token in (None, "", "guess", "run-ke", "run-key2"):
                for method in ("POST", "GET"):
                    status, answer = http_json(method, url + path, bodies.get(path, {}), token=token)
                    assert status == 401, (path, token, method, answer)
        assert http_json("GET", url + "/weight_version")[1]["weight_version"] == "default"
        assert http_json("POST", url + "/weights_checksum", {"names": [WEIGHT]})[1]["checksums"] == before
        assert http_json("GET", url + "/model_info")[1]["model_path"] == str(Path(model_dir).resolve())
        assert EngineClient([url], auth_token="").generate([[5, 6]], GREEDY)[0].output_ids  # generation is open
        # With the token, a weight push or a disk load from anywhere goes through.
        owner.begin_weight_update()
        status, answer = http_json("POST", url + "/update_weights_from_disk", {"model_path": str(other)},
                                   token="run-key")
        owner.end_weight_update()
        assert status == 200, answer
        assert http_json("POST", url + "/weights_checksum", {"names": [WEIGHT]})[1]["checksums"] != before
        owner.close()
    finally:
        stop_engines(started)


# -- disk loads ----------------------------------------------------------------------------------------

def test_disk_loads_stay_in_the_allowed_directories(engine, model_dir, tmp_path):
    run_dir = tmp_path / "run"
    inside = write_tiny_model("qwen3", run_dir / "export", seed=1)
    outside = write_tiny_model("qwen3", tmp_path / "outside", seed=2)
    (run_dir / "link").symlink_to(outside)
    original = checksum(engine)
    with served(engine, allowed_weight_dirs=[str(model_dir), str(run_dir)]) as url:
        client = EngineClient([url])
        client.begin_weight_update()
        try:
            for path in (outside, run_dir / "link", run_dir / ".." / "outside", "Qwen/Qwen3-0.6B", "/"):
                status, answer = http_json("POST", url + "/update_weights_from_disk", {"model_path": str(path)})
                assert status == 403 and "outside the directories" in answer["message"], (path, answer)
                assert checksum(engine) == original and engine.model_path == str(model_dir)
            status, answer = http_json("POST", url + "/update_weights_from_disk", {"model_path": str(run_dir / "none")})
            assert status == 400 and "not a directory" in answer["message"]
            status, answer = http_json("POST", url + "/update_weights_from_disk",
                                       {"model_path": str(inside), "weight_version": "exported"})
            assert status == 200 and answer["weight_version"] == "exported", answer
            assert checksum(engine) != original
            status, _ = http_json("POST", url + "/update_weights_from_disk", {"model_path": str(model_dir)})
            assert status == 200 and checksum(engine) == original
        finally:
            client.end_weight_update()
            client.close()
    # The default: the model's directory only. With a token (here on loopback), any path
    # with it, and every control call needs it.
    with served(engine, token="k") as url:
        client = EngineClient([url], auth_token="k")
        with pytest.raises(EngineError, match="401"):
            EngineClient([url], auth_token="").begin_weight_update()
        client.begin_weight_update()
        try:
            assert http_json("POST", url + "/update_weights_from_disk", {"model_path": str(inside)})[0] == 401
            assert http_json("POST", url + "/update_weights_from_disk", {"model_path": str(inside)}, token="k")[0] == 200
            assert checksum(engine) != original
            assert http_json("POST", url + "/update_weights_from_disk", {"model_path": str(model_dir)}, token="k")[0] == 200
        finally:
            client.end_weight_update()
            client.close()
    assert checksum(engine) == original


def test_the_driver_s_engines_load_from_the_model_and_the_run_directory(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    run_dir = tmp_path / "run"
    inside = write_tiny_model("qwen3", run_dir / "hf", seed=1)
    outside = write_tiny_model("qwen3", tmp_path / "elsewhere", seed=2)
    started = launch_embedded_engines(EngineConfig(), model_dir, run_dir / "engines")  # as EngineFleet calls it
    try:
        url = started[0].url
        client = EngineClient([url])
        client.begin_weight_update()
        status, answer = http_json("POST", url + "/update_weights_from_disk", {"model_path": str(outside)})
        assert status == 403, answer
        assert http_json("GET", url + "/model_info")[1]["model_path"] == str(Path(model_dir).resolve())
        for path in (inside, model_dir):
            status, answer = http_json("POST", url + "/update_weights_from_disk", {"model_path": str(path)})
            assert status == 200, (path, answer)
        client.end_weight_update()
        client.close()
    finally:
        stop_engines(started)


# -- limits -----------------------------------------------------------------------------------------------

def test_bodies_over_the_limit_answer_413_unread(engine):
    with served(engine, max_body_bytes=1000) as url:
        ok = json.dumps({"input_ids": [5, 6], "sampling_params": GREEDY}).encode()
        status, answer, _ = raw(url, "POST", "/generate", {"Content-Length": str(len(ok))}, ok)
        assert status == 200 and len(answer["output_ids"]) == 4
        # Announced over the limit: refused at once, the body never read, the connection closed.
        status, answer, connection = raw(url, "POST", "/generate", {"Content-Length": str(10**12)})
        assert status == 413 and "over this server's limit of 1000" in answer["message"]
        assert connection.lower() == "close"
        big = {"input_ids": [5] * 600}  # 1.2 kB written compactly (the client's orjson) or not
        assert http_json("POST", url + "/generate", big)[0] == 413
        for headers, code in (({"Content-Length": "many"}, 400), ({"Content-Length": "-5"}, 400),
                              ({"Transfer-Encoding": "chunked"}, 411)):
            assert raw(url, "POST", "/generate", headers)[0] == code, headers
        status, answer, _ = raw(url, "POST", "/generate", {"Content-Length": "9"}, b"[1, 2, 3]")
        assert status == 400 and "JSON object" in answer["message"]
        assert http_json("GET", url + "/health")[0] == 200  # still serving


def test_generation_lengths_and_token_ids_are_checked(engine, monkeypatch):
    monkeypatch.setattr(engine, "max_new_tokens_cap", 64)
    context = engine.model.config.max_position_embeddings
    vocab = engine.model.get_input_embeddings().weight.shape[0]
    with served(engine) as url:
        def generate(input_ids, **params):
            return http_json("POST", url + "/generate", {"input_ids": input_ids,
                                                         "sampling_params": {**GREEDY, **params}})

        assert generate([5, 6], max_new_tokens=64)[0] == 200
        cases = [
            (generate([5, 6], max_new_tokens=65), "max_new_tokens=65 is over this server's limit of 64"),
            (generate([5, 6], max_new_tokens=-1), "max_new_tokens=-1 must be an integer >= 0"),
            (generate([5, 6], max_new_tokens="many"), "max_new_tokens=string 'many' must be an integer >= 0"),
            (generate([5] * (context - 10), max_new_tokens=11),
             f"plus max_new_tokens=11 exceed the model's context of {context} tokens"),
            (generate([5, vocab]), f"input_ids out of range [0, {vocab})"),
            (generate([5, -1]), "input_ids out of range"),
            (generate([[5, 6], [5, "7"]]), "prompt 1: input_ids must be integers"),
            (generate([[5, 6], [5, 1.5]]), "prompt 1: input_ids must be integers"),
            (generate([[5, True]]), "input_ids must be integers"),
            (generate([[5, 6], []]), "prompt 1: input_ids must be a non-empty list"),
            (generate("hello"), "input_ids"),
        ]
        for (status, answer), message in cases:
            assert status == 400 and message in answer["message"], (message, answer)
        assert generate([5] * (context - 10), max_new_tokens=10)[0] == 200  # exactly the context
        with pytest.raises(EngineError, match="400"):  # the client does not retry a 400
            EngineClient([url]).generate([[5, 6]], {**GREEDY, "max_new_tokens": 1000})


def test_a_closed_server_serves_no_connection_a_client_kept_open(engine):
    """The client keeps its connection open between calls; closing the server ends it, so
    no later call reaches the closed server's handlers (they would answer with its old
    settings, even for a new server on the same port)."""
    with served(engine) as url:
        assert http_json("GET", url + "/health")[0] == 200  # this thread now holds a connection to it
    with pytest.raises(OSError):
        http_json("GET", url + "/health", timeout_s=5)


def test_a_client_that_drops_its_kept_open_connection_is_no_server_error(engine, monkeypatch):
    """A client gone with a reset (killed, or its pooled connection dropped) while the
    handler waits for its next request: the connection ends quietly, no traceback."""
    import socket
    import struct
    import time

    from rollout.engine_http import EngineHTTPServer

    errors = []
    monkeypatch.setattr(EngineHTTPServer, "handle_error", lambda self, request, address: errors.append(address))
    with served(engine) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None  # kept open: the handler waits for more
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # SO_LINGER 0: a reset, not a FIN
        time.sleep(0.5)
        assert http_json("GET", url + "/health")[0] == 200
    assert errors == []
