"""The embedded engine's HTTP server under a faulty client: a few hundred requests on
loopback (a fixed seed), malformed in every way issue 32 lists, to every endpoint, with
and without the token, shuffled among valid ones and sent eight at a time.

Asserted of every answer: no 5xx; no malformed request accepted (a 4xx, JSON with an
`error` and the `field` at fault, no traceback); no valid request failed (a valid
/generate gets the tokens it gets alone, sent first one by one); and after all of it the
weights are bit for bit what they were. docs/security.md's table lists the answers.
Then the request deadline, the connection cap, and other methods and HTTP versions."""

from __future__ import annotations

import base64
import http.client
import json
import os
import pickle
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

import pytest
import torch

from rollout.embedded_engine import Completion, Engine, SamplingParams
from rollout.engine_server import CONTROL_PATHS, ROUTES, make_server
from rollout.weight_tensors import serialize, tensor_payload

TOKEN = "fuzz-key"
NAN, INF = float("nan"), float("inf")
PATHS = sorted({p for _, p in ROUTES})
GREEDY = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}


@dataclass
class Case:
    name: str
    server: str  # "open" (no token) or "keyed" (started with TOKEN)
    path: str
    body: bytes | None = None  # sent with its Content-Length; None: no body
    method: str = "POST"
    token: bool = False
    status: int | None = None  # the status it must get; None: any 4xx
    field: str | None = None  # the field a 400 must name
    valid: bool = False
    raw: bytes | None = None  # bytes sent on a socket as they are, instead of a request
    reference: list | None = dataclass_field(default=None, repr=False)  # a valid /generate's output ids, alone


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def engine(model_dir):
    torch.set_num_threads(1)
    return Engine(str(model_dir))


@pytest.fixture(scope="module")
def broken_dirs(tmp_path_factory, model_dir):
    """Directories a disk load is pointed at: none holds loadable weights."""
    root = tmp_path_factory.mktemp("broken")
    dirs = {name: root / name for name in ("no_config", "bad_json", "deep_json", "json_list", "no_weights")}
    for d in dirs.values():
        d.mkdir()
    (dirs["bad_json"] / "config.json").write_text("{not json")
    (dirs["deep_json"] / "config.json").write_text("[" * 50_000)
    (dirs["json_list"] / "config.json").write_text("[1, 2]")
    (dirs["no_weights"] / "config.json").write_text((Path(model_dir) / "config.json").read_text())
    return root, dirs


@pytest.fixture(scope="module")
def servers(engine, model_dir, broken_dirs):
    """The engine behind two servers: one without a token, one with; 3 s to send a request."""
    made = {}
    for name, token in (("open", None), ("keyed", TOKEN)):
        server = make_server(engine, "127.0.0.1", 0, token=token, request_timeout_s=3.0, max_body_bytes=2**20,
                             allowed_weight_dirs=[str(model_dir), str(broken_dirs[0])])
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made[name] = server
    yield {name: s.server_address[1] for name, s in made.items()}
    for s in made.values():
        s.shutdown()
        s.server_close()


@dataclass
class Answer:
    status: int
    headers: dict
    body: object
    text: str


def send(port: int, case: Case) -> Answer:
    """The server's answer to `case` (status 0: none came)."""
    try:
        return _send_raw(port, case.raw) if case.raw is not None else _send(port, case)
    except (OSError, http.client.HTTPException, ValueError, IndexError) as err:
        return Answer(0, {}, None, f"no answer: {type(err).__name__}: {err}")


def _send(port: int, case: Case) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(case.method, case.path, skip_accept_encoding=True)
        if case.token:
            conn.putheader("Authorization", f"Bearer {TOKEN}")
        if case.body is not None:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(case.body)))
        conn.endheaders(case.body)
        resp = conn.getresponse()
        data = resp.read()
        return _answer(resp.status, dict(resp.getheaders()), data)
    finally:
        conn.close()


def _send_raw(port: int, data: bytes) -> Answer:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)  # and nothing more: the rest is left to the server's deadline
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return _answer(int(lines[0].split()[1]), headers, body)


def _answer(status: int, headers: dict, data: bytes) -> Answer:
    text = data.decode("utf-8", "replace")
    try:
        body = json.loads(data) if data else None
    except ValueError:
        body = None
    return Answer(status, headers, body, text)


# -- the requests ------------------------------------------------------------------------------

def dumps(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN and Infinity as Python writes them


def valid_generates(prompts: list[list[int]]) -> list[dict]:
    p0, p1, p2 = prompts
    sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3, "ignore_eos": True}
    return [
        {"input_ids": p0, "sampling_params": GREEDY, "return_logprob": True},
        {"input_ids": p0, "sampling_params": {**GREEDY, "temperature": 1e-40}},  # SGLang's greedy
        {"input_ids": p1, "sampling_params": {**sampled, "sampling_seed": 7}, "rid": "one"},
        {"input_ids": [p0, p2], "sampling_params": [GREEDY, {**sampled, "sampling_seed": 8}], "rid": ["a", "b"]},
        {"input_ids": [p1, p2], "sampling_params": {**sampled, "sampling_seed": 9}, "rid": "batch",
         "return_logprob": [True, False]},
        {"input_ids": p2, "sampling_params": {**sampled, "sampling_seed": -1}},
        {"input_ids": p2, "sampling_params": {**sampled, "sampling_seed": 2**63 - 1}},
        {"input_ids": p1, "sampling_params": {**sampled, "top_k": 2**40, "sampling_seed": 3}},
        {"input_ids": p1, "sampling_params": {**sampled, "top_k": -1, "sampling_seed": 3}},
        {"input_ids": p0, "sampling_params": {**GREEDY, "max_new_tokens": 0}},
        {"input_ids": p0, "sampling_params": {"temperature": None, "top_p": None, "top_k": None, "stop": None,
                                              "sampling_seed": 11, "max_new_tokens": 3, "ignore_eos": True}},
        {"input_ids": p2, "sampling_params": {**GREEDY, "stop": "e", "stop_token_ids": [5], "n": 1, "min_p": 0}},
        {"input_ids": p0, "sampling_params": GREEDY, "logprob_start_len": -1, "not_a_field": {"x": NAN}},
    ]


def malformed_generates(prompts: list[list[int]], vocab: int) -> list[tuple[dict, str]]:
    """(body, the field its 400 names): the kinds of issue 32 and their neighbours."""
    p0, p1, _ = prompts
    base = {"input_ids": p0, "sampling_params": GREEDY}

    def sp(**change):
        return {**base, "sampling_params": {**GREEDY, **change}}, "sampling_params." + next(iter(change))

    return [
        *[({**base, "input_ids": v}, "input_ids") for v in (5, True, 1.5, [], ["1"], [1.5], [vocab], [-1], "hello",
                                                          [1, [2]], [True, 1], None)],
        ({**base, "input_ids": [p0, []]}, "input_ids[1]"), ({**base, "input_ids": [p0, [INF]]}, "input_ids[1]"),
        ({**base, "rid": 5}, "rid"), ({**base, "input_ids": [p0, p1], "rid": ["a", "a"]}, "rid"),
        ({**base, "input_ids": [p0, p1], "rid": ["a", 1]}, "rid[1]"),
        ({**base, "sampling_params": {**GREEDY, "stop": [1]}}, "sampling_params.stop[0]"), sp(sampling_seed=2**64), sp(top_k=10**20), sp(max_new_tokens=INF), sp(max_new_tokens="5"),
        sp(max_new_tokens=3.7), sp(max_new_tokens=True), sp(max_new_tokens=-1), sp(max_new_tokens=10**6),
        sp(top_k=INF), sp(top_k=0), sp(top_k=-5), sp(top_k=1.5), sp(sampling_seed=INF), sp(sampling_seed="1"),
        ({**base, "sampling_params": {**GREEDY, "stop_token_ids": [INF]}}, "sampling_params.stop_token_ids[0]"),
        sp(temperature=NAN), sp(temperature=-1), sp(temperature=INF), sp(temperature=1e400),
        sp(top_p=0), sp(top_p=-1), sp(top_p=2), sp(top_p=NAN), sp(ignore_eos="yes"), sp(min_p=0.5), sp(n=2),
        ({**base, "sampling_params": {**GREEDY, "made_up": 1}}, "sampling_params.made_up"),
        ({**base, "input_ids": [p0, p1], "sampling_params": [GREEDY, {**GREEDY, "top_p": 0}]},
         "sampling_params[1].top_p"),
        ({**base, "input_ids": [p0, p1], "sampling_params": [GREEDY]}, "sampling_params"),
        ({**base, "sampling_params": 5}, "sampling_params"), ({**base, "stream": True}, "stream"),
        ({"text": "hello"}, "text"), ({**base, "return_logprob": "yes"}, "return_logprob"),
        ({**base, "image_data": [["data:image/png;base64,AAAA"]]}, "image_data"),
    ]


def malformed_controls(weight: str) -> list[tuple[str, dict, str | None]]:
    """(path, body, the field its 400 names; None: the engine's own refusal)."""
    group = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2}
    update = {"names": [weight], "dtypes": ["float32"], "shapes": [[832, 64]]}
    return [
        ("/weights_checksum", {"names": 5}, "names"), ("/weights_checksum", {"names": [1]}, "names[0]"),
        ("/weights_checksum", {}, "names"), ("/weights_checksum", {"names": [weight], "per_rank": "yes"}, "per_rank"),
        ("/weights_checksum", {"names": ["no.such.weight"]}, None),
        ("/init_weights_update_group", {**group, "master_port": "abc"}, "master_port"),
        ("/init_weights_update_group", {**group, "master_port": 0}, "master_port"),
        ("/init_weights_update_group", {"master_port": 1, "world_size": 2}, "master_address"),
        ("/init_weights_update_group", {**group, "world_size": 1}, "world_size"),
        ("/init_weights_update_group", {**group, "timeout_s": NAN}, "timeout_s"),
        ("/init_weights_update_group", {**group, "backend": "smoke"}, "backend"),
        ("/destroy_weights_update_group", {"group_name": 5}, "group_name"),
        ("/destroy_weights_update_group", {"group_name": "none"}, None),
        ("/release_memory_occupation", {"tags": 5}, "tags"), ("/release_memory_occupation", {"tags": [1]}, "tags[0]"),
        ("/release_memory_occupation", {"tags": ["gpu_cache"]}, None),
        ("/resume_memory_occupation", {"tags": 5}, "tags"), ("/resume_memory_occupation", {"tags": "weights"}, "tags"),
        ("/update_weights_from_distributed", {**update, "names": 5}, "names"),
        ("/update_weights_from_distributed", {**update, "shapes": "x"}, "shapes"),
        ("/update_weights_from_distributed", {**update, "shapes": [[832, INF]]}, "shapes[0][1]"),
        ("/update_weights_from_distributed", {**update, "dtypes": ["bogus"]}, "dtypes[0]"),
        ("/update_weights_from_distributed", {**update, "names": [weight, weight]}, "shapes"),
        ("/update_weights_from_distributed", update, None),  # outside begin/end, no group
        ("/update_weights_from_tensor", {"serialized_named_tensors": 5}, "serialized_named_tensors"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": [""]}, "serialized_named_tensors[0]"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": [5]}, "serialized_named_tensors[0]"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"], "load_format": "zip"}, "load_format"),
        ("/update_weights_from_tensor", {}, "serialized_named_tensors"),
        ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
        ("/update_weights_from_disk", {"model_path": ""}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/tmp/a\x00b"}, "model_path"),
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weight_version", {"new_version": 5}, "new_version"), ("/update_weight_version", {}, "new_version"),
        ("/pause_generation", {"mode": "stop"}, "mode"), ("/pause_generation", {"mode": 5}, "mode"),
        ("/begin_weight_update", {"selector": "draft"}, "selector"),
        ("/continue_generation", {"torch_empty_cache": "yes"}, "torch_empty_cache"),
        ("/flush_cache", {"timeout_s": "x"}, "timeout_s"),
    ]


BODY_FAULTS = [  # (bytes, what they are): every endpoint must refuse them with 400
    (b"[" * 50_000, "nested 50,000 deep"), (b"{", "not JSON"), (b"\xff\xfe{}", "not UTF-8"), (b"[1, 2]", "no object"),
    (b'{"a": ' + b"9" * 5000 + b"}", "an integer of 5000 digits"), (b'"text"', "a string"), (b"NaN", "NaN"),
]


def transport_faults(path: str) -> list[tuple[bytes, int]]:
    """(bytes on the socket, the status): malformed HTTP, and requests that never arrive whole."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n"
    return [
        (b"GARBAGE\r\n\r\n", 400), (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
        ((head + "".join(f"X-{i}: y\r\n" for i in range(120)) + "\r\n").encode(), 431),
        ((head + "Content-Length: abc\r\n\r\n").encode(), 400), ((head + "Content-Length: -5\r\n\r\n").encode(), 400),
        ((head + "Content-Length: 1000000000000\r\n\r\n").encode(), 413),
        ((head + "Transfer-Encoding: chunked\r\n\r\n").encode(), 411),
        ((head + "Content-Length: 100\r\n\r\n{\"input_ids\"").encode(), 408),  # a body that stops coming
        (f"GET {path} HT".encode(), 408),  # a request line that stops coming
    ]


def build_cases(rng: random.Random, prompts, vocab: int, weight: str) -> list[Case]:
    cases: list[Case] = []
    for body in valid_generates(prompts):
        for server in ("open", "keyed", "open", "keyed"):
            cases.append(Case("valid /generate", server, "/generate", dumps(body), valid=True))
    for path in ("/health", "/health_generate", "/model_info", "/get_model_info", "/weight_version", "/server_info",
                 "/get_server_info"):
        cases += [Case(f"valid GET {path}", s, path, method="GET", valid=True) for s in ("open", "keyed")]
    for server, token in (("open", False), ("keyed", True)):
        cases += [Case("valid checksum", server, "/weights_checksum", dumps({"names": [weight]}), valid=True),
                  Case("valid flush", server, "/flush_cache", b"{}", token=token, valid=True),
                  Case("valid version", server, "/update_weight_version", dumps({"new_version": "fuzz"}),
                       token=token, valid=True)]
    for body, fld in malformed_generates(prompts, vocab):
        cases += [Case(f"generate {fld}", s, "/generate", dumps(body), status=400, field=fld) for s in ("open", "keyed")]
    for path, body, fld in malformed_controls(weight):
        cases.append(Case(f"{path} {fld}", "open", path, dumps(body), status=400, field=fld))
        cases.append(Case(f"{path} {fld} +token", "keyed", path, dumps(body), token=True, status=400, field=fld))
        if path in CONTROL_PATHS:
            cases.append(Case(f"{path} no token", "keyed", path, dumps(body), status=401))
    for path in PATHS:
        server, token = rng.choice([("open", False), ("keyed", True), ("keyed", False)])
        refused_first = 401 if server == "keyed" and not token and path in CONTROL_PATHS else 400
        for data, what in [BODY_FAULTS[0], rng.choice(BODY_FAULTS[1:])]:  # deep nesting on every endpoint
            cases.append(Case(f"{path} {what}", server, path, data, token=token, status=refused_first))
        method = rng.choice(["PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "BREW"])
        cases.append(Case(f"{method} {path}", rng.choice(["open", "keyed"]), path, method=method, status=405))
    cases.append(Case("PUT unknown", "open", "/nope", method="PUT", status=404))
    for data, status in transport_faults("/generate"):
        cases.append(Case(f"raw {data[:24]!r}", rng.choice(["open", "keyed"]), "/generate", raw=data, status=status))
    rng.shuffle(cases)
    return cases


_BUFFERS = []  # the shared memory the entries point to, alive until the engine has read them


def tensor_entry(named) -> str:
    buffer, payload = tensor_payload(named, flattened=False)
    _BUFFERS.append(buffer)
    return serialize(payload)


class _Exploit:
    def __reduce__(self):
        return os.system, ("true",)


def sequential_cases(weight: str, engine, broken_dirs) -> list[Case]:
    """Inside one weight update (begin ... end), the update bodies that reach the loaders."""
    root, dirs = broken_dirs
    shape = tuple(engine.weight_view(weight).shape)
    entries = [base64.b64encode(pickle.dumps(5)).decode(), "AAAA", base64.b64encode(pickle.dumps(_Exploit())).decode(),
               tensor_entry([(weight, torch.zeros(shape[0], shape[1] + 1))]), tensor_entry([("no.such", torch.zeros(2))]),
               base64.b64encode(pickle.dumps([(weight, "not a tensor")])).decode()]
    cases = [Case("begin", "keyed", "/begin_weight_update", b"{}", token=True, valid=True)]
    cases += [Case(f"tensor entry {i}", s, "/update_weights_from_tensor",
                   dumps({"serialized_named_tensors": [e], "load_format": None}), token=True, status=400,
                   field=None if i >= 3 else "serialized_named_tensors")
              for i, e in enumerate(entries) for s in ("open", "keyed")]
    cases.append(Case("flattened without its keys", "keyed", "/update_weights_from_tensor",
                      dumps({"serialized_named_tensors": [base64.b64encode(pickle.dumps({})).decode()],
                             "load_format": "flattened_bucket"}), token=True, status=400,
                      field="serialized_named_tensors"))
    paths = [*map(str, dirs.values()), "/no/such/dir", "~nobody_here/x", "/" + "a" * 5000, str(root / "..")]
    for p in paths:
        cases.append(Case(f"disk {p[:30]}", "keyed", "/update_weights_from_disk", dumps({"model_path": p}),
                          token=True, status=400, field="model_path"))
    for name in ("no_config", "bad_json", "no_weights"):  # allowed without the token: reach the loader
        cases.append(Case(f"disk open {name}", "open", "/update_weights_from_disk",
                          dumps({"model_path": str(dirs[name])}), status=400, field="model_path"))
    cases.append(Case("disk open outside", "open", "/update_weights_from_disk", dumps({"model_path": "/"}),
                      status=403, field="model_path"))
    cases += [Case("end", "keyed", "/end_weight_update", b"{}", token=True, valid=True),
              Case("pause", "keyed", "/pause_generation", dumps({"mode": "in_place"}), token=True, valid=True),
              Case("continue", "keyed", "/continue_generation", b"{}", token=True, valid=True),
              Case("release kv", "open", "/release_memory_occupation", dumps({"tags": ["kv_cache"]}), valid=True),
              Case("resume kv", "open", "/resume_memory_occupation", dumps({"tags": ["kv_cache"]}), valid=True)]
    return cases


def judge(case: Case, answer: Answer) -> str | None:
    """What is wrong with `answer` to `case` (None: nothing)."""
    if answer.status >= 500 or answer.status == 0:
        return f"{answer.status}: {answer.text[:300]}"
    if "Traceback" in answer.text or 'File "' in answer.text:
        return "a traceback in the answer"
    if case.valid:
        if answer.status != 200:
            return f"valid, answered {answer.status}: {answer.text[:300]}"
        if case.reference is not None:
            outs = answer.body if isinstance(answer.body, list) else [answer.body]
            if [o["output_ids"] for o in outs] != case.reference:
                return f"other tokens than alone: {[o['output_ids'] for o in outs]} != {case.reference}"
        return None
    if not 400 <= answer.status < 500:
        return f"malformed, answered {answer.status}: {answer.text[:300]}"
    if case.status is not None and answer.status != case.status:
        return f"answered {answer.status}, not {case.status}: {answer.text[:300]}"
    if case.method == "HEAD":
        return None if answer.headers.get("Allow") == "GET, POST" else "HEAD's 405 has no Allow header"
    if not isinstance(answer.body, dict) or not isinstance(answer.body.get("error"), str) or "field" not in answer.body:
        return f"not a JSON error: {answer.text[:300]}"
    if answer.status == 400 and case.field is not None and answer.body["field"] != case.field:
        return f"names field {answer.body['field']!r}, not {case.field!r}: {answer.body['error'][:200]}"
    if answer.status == 405 and answer.headers.get("Allow") != "GET, POST":
        return "405 without Allow: GET, POST"
    return None


def test_malformed_requests_fail_alone_and_change_nothing(engine, servers, broken_dirs):
    weight = "model.embed_tokens.weight"
    tok = engine.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("move left", "you are an agent", "step 3")]
    vocab = engine.model.get_input_embeddings().weight.shape[0]
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    cases = build_cases(random.Random(32), prompts, vocab, weight)
    references = {}
    for case in cases:  # each valid /generate alone first, one at a time
        if case.valid and case.path == "/generate":
            if case.body not in references:
                answer = send(servers["open"], Case("alone", "open", "/generate", case.body))
                assert answer.status == 200, answer.text[:500]
                outs = answer.body if isinstance(answer.body, list) else [answer.body]
                references[case.body] = [o["output_ids"] for o in outs]
            case.reference = references[case.body]
    refs = [references[dumps(body)] for body in valid_generates(prompts)]
    greedy = refs[0]
    assert refs[1] == greedy and refs[7] == refs[8] and refs[9] == [[]]  # SGLang's meanings: 1e-40 is greedy, ...

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: send(servers[c.server], c), cases))
    extra = sequential_cases(weight, engine, broken_dirs)
    answers += [send(servers[c.server], c) for c in extra]
    cases += extra

    wrong = [f"{c.name} ({c.server}{', token' if c.token else ''}): {why}"
             for c, a in zip(cases, answers) if (why := judge(c, a))]
    assert not wrong, f"{len(wrong)} of {len(cases)} answers wrong:\n" + "\n".join(wrong[:40])
    assert sum(c.valid for c in cases) >= 70 and len(cases) >= 400
    after = engine.model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before), "a malformed request changed the weights"
    again = engine.generate([prompts[0]], [SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)], ["x"])
    assert again[0].output_ids == greedy[0]


def wait_for(condition, polls: int = 3000) -> None:
    for _ in range(polls):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the server never got there")


@contextmanager
def serving(engine, **limits):
    server = make_server(engine, "127.0.0.1", 0, **limits)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_stalled_clients_hold_a_connection_only_until_the_request_deadline(engine):
    """Two clients that stall mid-request fill a cap of two connections; a third waits for
    a slot, which the deadline frees: the stalled get 408, the third its answer, and no
    more than two connections were ever open."""
    with serving(engine, request_timeout_s=1.0, max_connections=2) as server:
        port = server.server_address[1]
        stalled = [Case("stalled", "open", "/generate", raw=b"POST /generate HTTP/1.1\r\nContent-Length: 50\r\n\r\n{"),
                   Case("stalled", "open", "/health", raw=b"GET /health HTTP/1.1\r\nX-Slow: ")]
        with ThreadPoolExecutor(3) as pool:
            cut = [pool.submit(send, port, c) for c in stalled]
            wait_for(lambda: server.open_connections == 2)  # both hold their slots
            third = pool.submit(send, port, Case("third", "open", "/generate", dumps({"input_ids": [5, 6],
                                                                                     "sampling_params": GREEDY})))
            answers = [f.result() for f in cut]
            assert [a.status for a in answers] == [408, 408], [a.text for a in answers]
            assert "not received within 1 s" in answers[0].body["error"]
            assert third.result().status == 200 and len(third.result().body["output_ids"]) == 3
        assert server.peak_connections == 2


def test_past_the_connection_cap_a_client_waits_then_gets_503(engine):
    """Two requests held inside the engine (generation paused) keep both slots: a third
    connection waits twice the request deadline for one, then is answered 503; the held
    requests are served once generation continues."""
    body = dumps({"input_ids": [5, 6], "sampling_params": GREEDY})
    with serving(engine, request_timeout_s=0.5, max_connections=2) as server:
        port = server.server_address[1]
        engine.pause("in_place")
        try:
            with ThreadPoolExecutor(2) as pool:
                held = [pool.submit(send, port, Case("held", "open", "/generate", body)) for _ in range(2)]
                wait_for(lambda: server.open_connections == 2)
                refused = send(port, Case("third", "open", "/health", method="GET"))
                engine.resume()
                assert [f.result().status for f in held] == [200, 200]
        finally:
            engine.resume()
        assert refused.status == 503 and "2 connections open (its limit)" in refused.body["error"]
        assert server.peak_connections == 2


def test_other_methods_and_http_versions_answer_json(engine):
    with serving(engine) as server:
        port = server.server_address[1]
        for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):
            answer = send(port, Case(method, "open", "/generate", dumps({}), method=method))
            assert answer.status == 405 and answer.headers["Allow"] == "GET, POST", answer.text
            assert answer.body["error"] == f"{method} is not allowed on /generate; use GET or POST"
        answer = send(port, Case("HEAD", "open", "/health", method="HEAD"))
        assert answer.status == 405 and answer.headers["Allow"] == "GET, POST" and answer.body is None
        answer = send(port, Case("v2", "open", "/health", raw=b"GET /health HTTP/2.0\r\n\r\n"))
        assert answer.status == 505 and answer.body["error"].startswith("Invalid HTTP version")
        answer = send(port, Case("v0.9", "open", "/health", raw=b"POST /health\r\n\r\n"))
        assert answer.status == 400 and answer.body["error"] == "Bad HTTP/0.9 request type ('POST')"


def test_an_answer_holding_nan_is_an_engine_fault_not_invalid_json(engine, monkeypatch):
    """Python writes NaN into JSON, which other parsers refuse: an answer holding one (the
    logprobs of broken weights) is answered 500 with a JSON error instead."""
    broken = Completion("r", "x", [5], [NAN], {"type": "length", "length": 1}, 2, "v")
    monkeypatch.setattr(engine, "generate", lambda *args: [broken])
    with serving(engine) as server:
        answer = send(server.server_address[1], Case("nan", "open", "/generate",
                                                     dumps({"input_ids": [5, 6], "return_logprob": True})))
    assert answer.status == 500 and "NaN" not in answer.text
    assert answer.body["error"] == "/generate failed inside the engine (ValueError); the engine's log has the traceback"
