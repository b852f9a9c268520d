"""The SGLang-protocol client against fake servers: balancing, stickiness, failover,
errors (malformed answers too), and the weight-update calls fanned out to every server."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.engine_client import EngineClient, EngineError, NoEngineLeft


class FakeServer:
    """Answers /generate with output_ids [prompt length, server index]; `info` on the
    `info_paths` (SGLang's server-info calls, 404 elsewhere); `replies` overrides the
    body of a POST path (a str is sent as plain text, as SGLang's /flush_cache does)."""

    def __init__(self, index: int, mode: str = "ok"):
        self.index, self.mode = index, mode
        self.calls: list[tuple[str, dict]] = []
        self.info: dict = {}
        self.info_paths: tuple[str, ...] = ("/server_info", "/get_server_info")
        self.replies: dict[str, object] = {}
        self.raw: dict[str, bytes] = {}  # POST path -> bytes sent as they are (not even HTTP), then closed
        self.generate_delay_s = 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _reply(self, code, payload):
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append((self.path, {}))
                if self.path in ("/server_info", "/get_server_info") and fake.mode == "ok":
                    if self.path not in fake.info_paths:
                        return self._reply(404, {"detail": "Not Found"})
                    return self._reply(200, fake.info)
                self._reply(200 if fake.mode == "ok" else 503, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append((self.path, body))
                if fake.mode == "drop":  # dies mid-request: closes without an answer
                    self.close_connection = True
                    self.connection.close()
                    return
                if fake.mode == "bad":
                    return self._reply(400, {"message": "bad"})
                if self.path in fake.raw:
                    self.wfile.write(fake.raw[self.path])
                    self.close_connection = True
                    return
                if self.path in fake.replies:
                    return self._reply(200, fake.replies[self.path])
                if self.path != "/generate":
                    return self._reply(200, {"success": True, "auth": self.headers.get("Authorization")})
                time.sleep(fake.generate_delay_s)
                outs = [{"text": "x", "output_ids": [len(ids), fake.index],
                         "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "3",
                                       "output_token_logprobs": [[-0.5, len(ids), None], [-0.25, fake.index, None]]}}
                        for ids in body["input_ids"]]
                self._reply(200, outs)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def generate_calls(self):
        return [b for p, b in self.calls if p == "/generate"]

    def last(self, path: str) -> dict:
        return [b for p, b in self.calls if p == path][-1]

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    made = []

    def make(*modes):
        made.extend(FakeServer(i, m) for i, m in enumerate(modes))
        return made

    yield make
    for s in made:
        s.stop()


def test_outputs_in_request_order_with_logprobs(servers):
    a, b = servers("ok", "ok")
    client = EngineClient([a.url, b.url])
    outs = client.generate([[1] * n for n in range(1, 7)], {"temperature": 1.0})
    assert [o.output_ids[0] for o in outs] == [1, 2, 3, 4, 5, 6]
    assert all(o.logprobs == [-0.5, -0.25] and o.finish_reason == "length" and o.weight_version == "3"
               for o in outs)
    # least loaded: the six requests are split evenly, one HTTP call per server
    assert sorted(len(c["input_ids"]) for s in (a, b) for c in s.generate_calls()) == [3, 3]
    assert all(c["return_logprob"] for s in (a, b) for c in s.generate_calls())


def test_trajectories_stick_to_their_server(servers):
    a, b = servers("ok", "ok")
    client = EngineClient([a.url, b.url])
    first = client.generate([[1], [2], [3], [4]], {}, sticky_keys=["t0", "t1", "t2", "t3"])
    again = client.generate([[1, 1], [2, 2], [3, 3], [4, 4]], {}, sticky_keys=["t3", "t2", "t1", "t0"])
    served = {k: o.server for k, o in zip(["t0", "t1", "t2", "t3"], first)}
    assert {k: o.server for k, o in zip(["t3", "t2", "t1", "t0"], again)} == served
    assert len(set(served.values())) == 2


def test_dead_server_requests_go_elsewhere_and_are_logged(servers, caplog):
    good, dropping = servers("ok", "drop")
    client = EngineClient([dropping.url, good.url])
    with caplog.at_level(logging.WARNING, logger="rollout.engine_client"):
        outs = client.generate([[1] * n for n in range(1, 5)], {}, sticky_keys=list("abcd"))
    assert [o.output_ids for o in outs] == [[n, 0] for n in range(1, 5)]
    assert all(o.server == good.url for o in outs)
    assert client.alive == [good.url]
    assert any(dropping.url in r.getMessage() and "dead" in r.getMessage() for r in caplog.records)
    # stickiness moved with the re-sent requests
    assert all(o.server == good.url for o in client.generate([[9]] * 4, {}, sticky_keys=list("abcd")))


def test_no_engine_left_is_a_clear_error(servers):
    a, b = servers("ok", "ok")
    client = EngineClient([a.url, b.url], max_attempts=5)
    a.stop()
    b.stop()
    with pytest.raises(NoEngineLeft, match="no rollout engine left"):
        client.generate([[1], [2]], {})


def test_bad_request_is_not_retried(servers):
    (bad,) = servers("bad")
    client = EngineClient([bad.url])
    with pytest.raises(EngineError, match="HTTP 400"):
        client.generate([[1]], {})
    assert len(bad.generate_calls()) == 1 and client.alive == [bad.url]


def test_health_check_retires_and_revives(servers):
    a, b = servers("ok", "ok")
    client = EngineClient([a.url, b.url])
    b.mode = "unhealthy"
    assert client.check_health() == {a.url: True, b.url: False}
    assert client.alive == [a.url]
    b.mode = "ok"
    assert client.check_health() == {a.url: True, b.url: True}
    assert client.alive == [a.url, b.url]


def test_weight_update_calls_reach_every_server_with_their_ranks_and_token(servers):
    a, b = servers("ok", "ok")
    client = EngineClient([a.url, b.url], auth_token="s3cret")
    pending, world_size = client.init_weights_update_group("10.0.0.1", 1234, "wu", backend="gloo")
    pending.result(timeout=10)
    assert world_size == 3
    ranks = [s.calls[-1][1]["rank_offset"] for s in (a, b)]
    assert ranks == [1, 2] and all(s.calls[-1][1]["world_size"] == 3 for s in (a, b))
    assert all(r["auth"] == "Bearer s3cret" for r in client.begin_weight_update())
    client.update_weights_from_distributed(["w"], ["float32"], [[2]], "wu", weight_version="7",
                                           load_format="flattened_bucket").result(timeout=10)
    body = a.calls[-1][1]
    assert body["names"] == ["w"] and body["load_format"] == "flattened_bucket" and body["weight_version"] == "7"
    for call, path in [(client.end_weight_update, "/end_weight_update"), (client.flush_cache, "/flush_cache"),
                       (client.continue_generation, "/continue_generation")]:
        call()
        assert a.calls[-1][0] == b.calls[-1][0] == path
    client.pause_generation("in_place")
    assert a.calls[-1] == ("/pause_generation", {"mode": "in_place"})
    client.destroy_weights_update_group("wu")
    assert b.calls[-1] == ("/destroy_weights_update_group", {"group_name": "wu"})


def test_update_group_counts_every_rank_of_every_server(servers):
    a, b, c = servers("ok", "ok", "ok")
    a.info = {"tp_size": 2, "pp_size": 1, "dp_size": 1}  # SGLang: /server_info
    b.info, b.info_paths = {"tp_size": 4}, ("/get_server_info",)  # older SGLang, the embedded engine
    c.info_paths = ()  # reports nothing: one rank
    client = EngineClient([a.url, b.url, c.url])
    assert client.server_ranks() == {a.url: 2, b.url: 4, c.url: 1}

    def offsets(**kwargs):
        pending, world_size = client.init_weights_update_group("127.0.0.1", 1234, "wu", **kwargs)
        pending.result(timeout=10)
        bodies = [s.last("/init_weights_update_group") for s in (a, b, c)]
        assert all(body["world_size"] == world_size for body in bodies)
        return [body["rank_offset"] for body in bodies], world_size

    assert offsets() == ([1, 3, 7], 8)  # asked: 1 (the trainer) + 2 + 4 + 1
    assert offsets(ranks_per_server={a.url: 1, b.url: 3, c.url: 2}) == ([1, 2, 5], 7)
    assert offsets(ranks_per_server=2) == ([1, 3, 5], 7)
    assert offsets(ranks_per_server={a.url: 2}) == ([1, 3, 7], 8)  # the others asked


def test_update_group_skips_dead_servers_and_refuses_pipeline_stages(servers):
    a, b = servers("ok", "ok")
    a.info = b.info = {"tp_size": 2}
    client = EngineClient([a.url, b.url])
    client._mark_dead(a.url, "test")
    pending, world_size = client.init_weights_update_group("127.0.0.1", 1234, "wu")
    pending.result(timeout=10)
    assert world_size == 3 and b.last("/init_weights_update_group")["rank_offset"] == 1
    assert not [p for p, _ in a.calls if p == "/init_weights_update_group"]
    b.info = {"tp_size": 2, "pp_size": 2}
    with pytest.raises(EngineError, match="2 pipeline stages"):
        client.init_weights_update_group("127.0.0.1", 1234, "wu")


def test_plain_text_and_status_bodies_are_answers_not_failures(servers):
    """What the real SGLang server sends: /flush_cache in plain text, pause/continue as
    {"status": "ok"}; the engine stays live."""
    a, b = servers("ok", "ok")
    for s in (a, b):
        s.replies = {"/flush_cache": "Cache flushed.\nPlease check backend logs for more details.\n",
                     "/pause_generation": {"message": "Generation paused successfully.", "status": "ok"},
                     "/continue_generation": {"message": "Generation continued successfully.", "status": "ok"}}
    client = EngineClient([a.url, b.url])
    assert client.flush_cache() == ["Cache flushed.\nPlease check backend logs for more details.\n"] * 2
    assert [r["status"] for r in client.pause_generation("abort")] == ["ok", "ok"]
    client.continue_generation()
    assert client.alive == [a.url, b.url] and client.dead_events == []
    assert client.generate([[1, 2]], {})[0].output_ids[0] == 2


def test_a_refused_control_call_raises(servers):
    (bad,) = servers("bad")
    with pytest.raises(EngineError, match="begin_weight_update: HTTP 400"):
        EngineClient([bad.url]).begin_weight_update()


def test_configured_urls_need_no_local_engines(servers):
    from rollout.engine_launch import EngineConfig, start_engines

    a, b = servers("ok", "ok")
    client, started = start_engines(EngineConfig(urls=(a.url, b.url + "/"), max_attempts=2))
    assert started == [] and client.urls == [a.url, b.url] and client.max_attempts == 2
    assert client.generate([[1, 2]], {})[0].output_ids == [2, 0]
    with pytest.raises(ValueError, match="no engine URLs"):
        start_engines(EngineConfig())


def test_submitted_requests_stick_fail_over_and_stay_within_the_bound(servers, caplog):
    """submit(): one HTTP call per request, a Future each; trajectories keep their server;
    a dead server's requests are re-sent to the others."""
    a, b = servers("ok", "ok")
    client = EngineClient([a.url, b.url], max_inflight_per_engine=2)
    futures = [client.submit([1] * n, {"temperature": 1.0}, rid=f"r{n}", sticky_key=f"t{n % 4}")
               for n in range(1, 9)]
    outs = [f.result(timeout=30) for f in futures]
    assert [o.output_ids[0] for o in outs] == list(range(1, 9))
    assert all(len(c["input_ids"]) == 1 for s in (a, b) for c in s.generate_calls())
    served = {n % 4: o.server for n, o in zip(range(1, 9), outs)}
    assert all(o.server == served[n % 4] for n, o in zip(range(1, 9), outs)) and len(set(served.values())) == 2
    assert all(len(lane._threads) <= 2 for lane in client.lanes.values())
    assert client.load == {a.url: 0, b.url: 0}

    a.mode = "drop"
    with caplog.at_level(logging.WARNING, logger="rollout.engine_client"):
        again = [client.submit([1] * n, {}, sticky_key=f"t{n % 4}") for n in range(1, 9)]
        assert all(f.result(timeout=30).server == b.url for f in again)
    assert client.alive == [b.url]
    b.mode = "drop"
    with pytest.raises(NoEngineLeft):
        client.submit([1], {}).result(timeout=30)
    client.close()


def test_submitted_requests_that_queue_share_calls_up_to_requests_per_call(servers, caplog):
    """An engine that runs a call's prompts as one batch gets the queued requests together;
    each Future still gets its own answer, and a dead server's share is re-sent."""
    a, = servers("ok")
    a.generate_delay_s = 0.2  # the first call is out while the rest queue
    client = EngineClient([a.url], max_inflight_per_engine=1, requests_per_call=16)
    futures = [client.submit([1] * n, {}, rid=f"r{n}") for n in range(1, 21)]
    assert [f.result(timeout=30).output_ids[0] for f in futures] == list(range(1, 21))
    calls = a.generate_calls()
    assert len(calls) <= 3 and max(len(c["input_ids"]) for c in calls) == 16
    assert sorted(r for c in calls for r in c["rid"]) == sorted(f"r{n}" for n in range(1, 21))
    client.close()

    dead, b = servers("drop", "ok")[-2:]
    client = EngineClient([dead.url, b.url], requests_per_call=8)
    with caplog.at_level(logging.WARNING, logger="rollout.engine_client"):
        outs = [f.result(timeout=30) for f in [client.submit([1] * n, {}) for n in range(1, 11)]]
    assert [o.output_ids[0] for o in outs] == list(range(1, 11)) and {o.server for o in outs} == {b.url}
    assert client.load == {dead.url: 0, b.url: 0}
    client.close()


def test_a_refused_submitted_request_raises_at_once(servers):
    bad, = servers("bad")
    client = EngineClient([bad.url])
    with pytest.raises(EngineError, match="HTTP 400"):
        client.submit([1, 2], {}).result(timeout=30)
    assert client.alive == [bad.url]


def _answer(ids="[1]", logprobs="[[-0.5, 1, null]]", item=None) -> str:
    return "[" + (item or f'{{"text": "x", "output_ids": {ids}, "meta_info": {{"output_token_logprobs": '
                          f'{logprobs}, "finish_reason": {{"type": "length"}}}}}}') + "]"


# /generate answers an engine might send, and what the client says of each
MALFORMED = {
    "oops": "malformed /generate answer for 1 prompt(s): str where 1 answer(s) were due",
    "[" * 50_000: "str where 1 answer(s) were due",  # nested past the JSON parser: kept as text
    _answer(logprobs="[[NaN, 1, null]]"): "logprob nan, not a finite number",
    _answer(logprobs="[[-Infinity, 1, null]]"): "logprob -inf, not a finite number",
    _answer(logprobs="[[null, 1, null]]"): "logprob None, not a finite number",
    _answer(logprobs='[[-0.5, "1", null]]'): "token id is not a token id",
    _answer(ids="[1, 2]"): "2 output ids but 1 logprobs",
    _answer(ids="[2]"): "name other tokens than its output_ids",
    _answer(ids='["1"]'): "output_ids[0] is not a token id",
    _answer(ids="[-1]", logprobs="[[-0.5, 1, null]]"): "output_ids[0] is not a token id: -1",
    _answer(logprobs="[0.5]"): "is not a [logprob, token_id, text] entry",
    _answer(item="5"): "answer 0 is not an object",
    _answer(item='{"text": "x", "output_ids": []}'): "has no meta_info object",
    _answer() + _answer(): "malformed /generate answer",  # not JSON as a whole
    "[" + _answer()[1:-1] + "," + _answer()[1:-1] + "]": "a list of 2 where 1 answer(s) were due",
}


@pytest.mark.parametrize("body", list(MALFORMED), ids=lambda b: b[:40])
def test_a_malformed_answer_is_the_engine_s_fault_and_goes_elsewhere(servers, body, caplog):
    """An engine that answers /generate with something that is not the protocol's (not
    JSON, NaN or infinite logprobs, wrong lengths or types) is a failed server: marked
    dead naming the problem, its requests re-sent; alone, a clear EngineError."""
    broken, good = servers("ok", "ok")
    broken.replies["/generate"] = body
    client = EngineClient([broken.url, good.url])
    with caplog.at_level(logging.WARNING, logger="rollout.engine_client"):
        outs = client.generate([[1, 2]], {})
    assert outs[0].output_ids == [2, 1] and outs[0].server == good.url
    assert client.alive == [good.url]
    assert client.dead_events[0][0] == broken.url and MALFORMED[body] in client.dead_events[0][1]
    alone = EngineClient([broken.url], max_attempts=2)
    with pytest.raises(EngineError, match="no rollout engine left|failed on 2 attempts") as err:
        alone.generate([[1, 2]], {})
    assert MALFORMED[body] in str(err.value)
    submitted = EngineClient([broken.url, good.url])
    assert submitted.submit([1, 2], {}).result(timeout=30).server == good.url
    for c in (client, alone, submitted):
        c.close()


def test_an_answer_that_is_not_http_is_the_engine_s_fault(servers):
    broken, good = servers("ok", "ok")
    broken.raw["/generate"] = b"garbage\r\n\r\n"  # http.client: BadStatusLine, not an OSError
    client = EngineClient([broken.url, good.url])
    assert client.generate([[1, 2]], {})[0].server == good.url
    assert client.dead_events[0][0] == broken.url and "BadStatusLine" in client.dead_events[0][1]
    client.close()


def test_a_server_that_reports_no_integer_ranks_is_an_engine_error(servers):
    a, = servers("ok")
    client = EngineClient([a.url])
    for value in ("abc", 1.5, True, 0, None):
        a.info = {"tp_size": value}
        if value is None:
            assert client.server_ranks() == {a.url: 1}
            continue
        with pytest.raises(EngineError, match="reports tp_size=.*not a positive integer"):
            client.server_ranks()
    client.close()


def _counting_server(close_after_each: bool):
    """A JSON server on loopback that counts the connections it accepted; with
    `close_after_each` it drops each connection after answering, without saying so (as a
    server whose idle keep-alive timeout ran out between two calls)."""
    import socketserver
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    accepted = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            accepted.append(self.client_address)
            super().setup()

        def do_GET(self):
            data = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            if close_after_each:
                self.close_connection = True

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    assert isinstance(server, socketserver.TCPServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, accepted


def test_calls_keep_one_connection_open_and_survive_its_close():
    from rollout.engine_client import http_json

    server, accepted = _counting_server(close_after_each=False)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        assert [http_json("GET", url) for _ in range(5)] == [(200, {"ok": True})] * 5
        assert len(accepted) == 1  # one TCP connection for the five calls of this thread
    finally:
        server.shutdown()
    server, accepted = _counting_server(close_after_each=True)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        assert [http_json("GET", url) for _ in range(3)] == [(200, {"ok": True})] * 3
        assert len(accepted) == 3  # each call after a dropped connection opens a new one
    finally:
        server.shutdown()
