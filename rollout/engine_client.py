"""Client for rollout engines that speak SGLang's HTTP protocol (SGLang servers, an
SGLang router, or the embedded CPU engine): token ids in, token ids and logprobs out.

Several servers are balanced here: each request goes to the least-loaded live server,
and a request with a sticky key (the trajectory) goes back to the server that served
that key before, so its growing prefix can hit that server's prefix cache, unless that
server holds more than `rebalance_threshold` requests (in flight or queued) over the
least-loaded one: then the key moves there (as SGLang's router balances cache-aware
routing). Behind an SGLang router, pass the router's URL alone; it balances and routes
by cache itself.

Two ways to generate: `generate(batch)` sends each server its share of the batch in one
request and returns when all are back (the lock-step agent loop); `submit(one prompt)`
returns a Future at once (the asynchronous loop keeps thousands in flight). Submitted
requests queue per server and at most `max_inflight_per_engine` calls are open at a
time on each (from that server's pool of as many threads), so a server that batches
continuously (SGLang) always has work and is never flooded. A call carries one request
(`requests_per_call=1`, SGLang: a long response holds up no other) or up to
`requests_per_call` of those queued for the server (an engine that runs each call's
prompts as one batch, the embedded engine: fewer, fuller batches and HTTP round trips).

A server that fails a request (connection refused or reset, timeout, HTTP 5xx, or an
answer that is not HTTP or not the protocol's: not JSON, nested past the parser, wrong
lengths or types, a NaN or infinite logprob: rollout/engine_responses.py) is marked
dead, logged with a warning naming it and the problem, and its requests are re-sent to
the others; when none is left `NoEngineLeft` is raised (an `EngineError`: the run
reports it, never a TypeError from deep inside). `check_health()` revives servers that
answer /health again. HTTP 4xx (a bad request) raises `EngineError` at once.

Images (vision-language models): a request may carry `image_data` (PNG data URLs, one
per image pad of its ids: rollout/vision.py), sent as SGLang's per-request
`"image_data"` lists ([] for a text request in a mixed call); its `prompt_tokens` (the
expanded prompt's length) is checked against the server's `meta_info.prompt_tokens`.

Bodies are taken as the servers send them: JSON when it parses, else the text (SGLang's
/flush_cache answers 200 with plain text); only the status code says whether a call
failed, plus `"success": false` in a JSON answer.

LoRA (`lora_adapters`: the trainer syncs its adapters alone, weight_sync.lora=adapters):
each /generate call first asks its server's weight version and names that version's
adapter (`lora_path`; none before the first sync); its answers carry that version.

JSON: bodies are written and read with orjson wherever it gives the value the stdlib's
`json` gives, else (or without orjson installed) with `json` itself, so every value sent
and read is the stdlib's (`encode_json`, `decode_json`; `token_id_list` makes a prompt's
ids Python ints without a per-id int() when they are already): a 3,000-id request and a
350-token answer cost 0.11 ms instead of 0.44.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import reprlib
import socket
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from rollout.engine_lora import adapter_name
from rollout.engine_responses import GenerateOutput, MalformedAnswer, generate_outputs

try:
    import orjson
except ImportError:  # the stdlib's json alone
    orjson = None

log = logging.getLogger("rollout.engine_client")

TOKEN_ENV = "MEGATRON_AGENT_ENGINE_TOKEN"


class EngineError(RuntimeError):
    """An engine refused a request (HTTP 4xx) or a request failed on every attempt."""


class NoEngineLeft(EngineError):
    """Every engine server is dead."""


class _ServerFailed(Exception):
    pass


# orjson's options: a subclass of a JSON type, a dataclass or a datetime raise (as
# json.dumps raises on the latter two and writes the former its own way), so json writes them.
_ORJSON_WRITE = 0 if orjson is None else (orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS
                                          | orjson.OPT_PASSTHROUGH_DATETIME)
# For finding 19 or more digits that begin a number (an integer past 64 bits maybe, which
# orjson reads as a float): digits -> "0", what comes before a fraction or an exponent's
# digits -> ".", other bytes -> " ". A float's fraction (a logprob near 0 prints as
# "-0.00012345678901234567") then follows a "." and does not count: orjson reads floats as
# json does.
_NUMBER_STARTS = bytes(48 if 48 <= b <= 57 else 46 if b in b".eE+" else 32 for b in range(256))
_LONG_NUMBER_START = b" " + b"0" * 19


def encode_json(body) -> bytes:
    """`json.dumps(body).encode()`'s JSON value, written by orjson where it writes the same
    one. json writes a NaN or infinite float as NaN / Infinity, orjson as null: a body
    whose orjson form holds a null and that holds such a float is written by json, as is
    one orjson refuses (an integer past 64 bits, a key that is not a string, a lone
    surrogate, a subclass of a JSON type, a type json refuses too). (orjson writes an Enum
    or UUID, which json refuses; nothing here sends one.)"""
    if orjson is not None:
        try:
            out = orjson.dumps(body, option=_ORJSON_WRITE)
        except TypeError:  # orjson.JSONEncodeError
            out = None
        if out is not None and (b"null" not in out or not _holds_non_finite(body)):
            return out
    return json.dumps(body).encode()


def _holds_non_finite(value) -> bool:
    if type(value) is float:
        return not math.isfinite(value)
    if type(value) is dict:
        return any(_holds_non_finite(v) for v in value.values())
    if type(value) in (list, tuple):
        return any(_holds_non_finite(v) for v in value)
    return False


def decode_json(raw: bytes):
    """`json.loads(raw)`, read by orjson where it reads the same value. orjson refuses what
    json reads otherwise (NaN, Infinity, a number past the float range, a UTF-8 BOM, a
    lone surrogate, nesting past 1024) and reads an integer past 64 bits as a float: a
    body with an integer of 19 or more digits goes to json (one of 18 digits or fewer is
    within 64 bits)."""
    if orjson is not None and _LONG_NUMBER_START not in b" " + raw.translate(_NUMBER_STARTS):
        try:
            return orjson.loads(raw)
        except ValueError:  # orjson.JSONDecodeError: json decides (it reads more, or raises)
            pass
    return json.loads(raw)


def token_id_list(ids) -> list[int]:
    """`list(map(int, ids))`, which is what is sent: a list of Python ints, or a 1-D integer
    numpy array, is only copied (a list whose orjson form holds anything but digits,
    minus signs, commas and its two brackets goes through int())."""
    if type(ids) is list and orjson is not None:
        try:
            encoded = orjson.dumps(ids, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
        except TypeError:
            encoded = None
        if encoded is not None and encoded.translate(None, b"0123456789,-") == b"[]":
            return ids.copy()
    elif getattr(ids, "ndim", None) == 1 and getattr(getattr(ids, "dtype", None), "kind", None) in ("i", "u"):
        return ids.tolist()
    return list(map(int, ids))


def _decode(raw: bytes) -> object:
    """A response body: parsed JSON, else its text (None when empty): a body that is not
    UTF-8 or JSON, an integer past Python's 4300 digits, or nesting past the parser."""
    if not raw:
        return None
    try:
        return decode_json(raw)
    except (ValueError, RecursionError):
        return raw.decode(errors="replace")


def http_json(method: str, url: str, body: dict | None = None, *, timeout_s: float = 30.0,
              token: str | None = None) -> tuple[int, object]:
    """One HTTP call; (status, body): the JSON body parsed, or its text when it is not
    JSON (SGLang answers some calls in plain text). Transport failures raise OSError, an
    answer that is not HTTP `http.client.HTTPException`."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else encode_json(body)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    key = (parts.scheme, parts.netloc)
    for attempt in range(2):
        conn, reused = _connection(key, timeout_s)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            _drop_connection(key)
            if reused and attempt == 0:
                continue  # the server closed the connection this thread kept open: once on a new one
            raise
        except BaseException:
            _drop_connection(key)
            raise
        if resp.will_close:
            _drop_connection(key)
        return resp.status, _decode(payload)
    raise AssertionError("unreachable")


_THREAD_CONNECTIONS = threading.local()  # per thread: (scheme, host:port) -> HTTPConnection, kept alive


def _connection(key: tuple[str, str], timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
    """This thread's open connection to `key`, or a new one; (connection, whether it was open)."""
    pool = getattr(_THREAD_CONNECTIONS, "pool", None)
    if pool is None:
        pool = _THREAD_CONNECTIONS.pool = {}
    conn = pool.get(key)
    reused = conn is not None and conn.sock is not None
    if conn is None:
        scheme, netloc = key
        conn = (http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection)(netloc)
    conn.timeout = timeout_s
    if conn.sock is None:
        pool.pop(key, None)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pool[key] = conn
    conn.sock.settimeout(timeout_s)
    return conn, reused


def _drop_connection(key: tuple[str, str]) -> None:
    conn = getattr(_THREAD_CONNECTIONS, "pool", {}).pop(key, None)
    if conn is not None:
        conn.close()


_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 300, 300, 4, 8, 8


def _shown(payload) -> str:
    """An answer in a message: bounded in length and depth (an engine may send anything)."""
    return payload[:300] if isinstance(payload, str) else _SHOWN.repr(payload)


def _rank_count(url: str, info: dict, key: str) -> int:
    """A server's `tp_size` or `pp_size` (1 when absent); EngineError for anything but a
    positive integer."""
    value = info.get(key)
    if value is None:
        return 1
    if type(value) is not int or value < 1:
        raise EngineError(f"{url} reports {key}={str(value)[:40]!r}, not a positive integer")
    return value


def settle_future(done: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve a submitted request's Future unless its caller cancelled it meanwhile."""
    try:
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)
    except InvalidStateError:
        pass


@dataclass
class _Queued:
    """A submitted request waiting for its server's next call."""

    done: Future
    ids: list[int]
    params: dict
    rid: str | None
    key: str | None
    attempt: int
    image_data: list[str] | None = None
    prompt_tokens: int | None = None


class EngineClient:
    def __init__(self, urls: Sequence[str], *, timeout_s: float = 300.0, max_attempts: int = 3,
                 auth_token: str | None = None, max_sticky_keys: int = 1_000_000,
                 max_inflight_per_engine: int = 64, rebalance_threshold: int = 32, requests_per_call: int = 1,
                 transport=None, route_shape=None, lora_adapters: bool = False):
        if not urls:
            raise ValueError("EngineClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.alive = list(self.urls)
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.token = auth_token if auth_token is not None else os.environ.get(TOKEN_ENV)
        self.load = dict.fromkeys(self.urls, 0)  # requests in flight per server
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.max_sticky_keys = max_sticky_keys
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=max(8, 4 * len(self.urls)), thread_name_prefix="engine-http")
        self.max_inflight_per_engine = max_inflight_per_engine
        self.rebalance_threshold = rebalance_threshold
        self.requests_per_call = requests_per_call
        self.lanes: dict[str, ThreadPoolExecutor] = {}  # submit()'s calls, per server
        self.queued: dict[str, deque] = {}  # submit()'s requests not sent yet, per server
        # (method, url, body, timeout_s=, token=) -> (status, body); http_json unless a
        # benchmark or test serves the protocol in process.
        self.transport = transport or http_json
        self.dead_events: list[tuple[str, str]] = []  # (url, reason), for tests and metrics
        # asks every request for its routed experts, read in this shape (rollout/routed_experts.py)
        self.route_shape = route_shape
        # the engines serve the trainer's LoRA adapters (weight_sync.lora=adapters): every call
        # names the adapter of the server's weight version, asked first (`_serving_version`)
        self.lora_adapters = lora_adapters

    # -- generation --------------------------------------------------------------------
    def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling_params: dict | Sequence[dict],
        *,
        rids: Sequence[str] | None = None,
        sticky_keys: Sequence[str | None] | None = None,
        image_data: Sequence[list[str] | None] | None = None,
        prompt_tokens: Sequence[int | None] | None = None,
    ) -> list[GenerateOutput]:
        """One output per prompt. `image_data`: each prompt's images (PNG data URLs, one
        per image pad of its ids; None or [] for a text prompt); `prompt_tokens`: each
        prompt's expanded length (None: unchecked), which the server must report."""
        input_ids = [token_id_list(ids) for ids in input_ids]
        n = len(input_ids)
        images = list(image_data) if image_data is not None else [None] * n
        expected = list(prompt_tokens) if prompt_tokens is not None else [None] * n
        params = [sampling_params] * n if isinstance(sampling_params, dict) else list(sampling_params)
        keys = list(sticky_keys) if sticky_keys is not None else [None] * n
        results: list[GenerateOutput | None] = [None] * n
        attempts = [0] * n
        pending = list(range(n))
        while pending:
            by_server = self._assign(pending, keys)
            futures = {
                url: self.pool.submit(self._post_generate, url, [input_ids[i] for i in idx],
                                      [params[i] for i in idx], [rids[i] for i in idx] if rids else None,
                                      [images[i] for i in idx], [expected[i] for i in idx])
                for url, idx in by_server.items()
            }
            pending, refused = [], None
            for url, fut in futures.items():
                idx = by_server[url]
                try:
                    outs, error = fut.result(), None
                except _ServerFailed as e:
                    outs, error = None, e
                except EngineError as e:  # the request is wrong: raise after every answer is in
                    outs, error, refused = [], None, refused or e
                finally:
                    with self.lock:
                        self.load[url] -= len(idx)
                if error is None:
                    for i, out in zip(idx, outs):
                        results[i] = out
                    continue
                self._mark_dead(url, str(error))
                with self.lock:
                    for i in idx:
                        attempts[i] += 1
                        if keys[i] is not None:
                            self.sticky.pop(keys[i], None)
                pending.extend(idx)
            if refused is not None:
                raise refused
            failed = [i for i in pending if attempts[i] >= self.max_attempts]
            if failed:
                raise EngineError(f"{len(failed)} request(s) failed on {self.max_attempts} attempts "
                                  f"({self._dead_summary()})")
        return results  # type: ignore[return-value]

    def _assign(self, indices: list[int], keys: list[str | None]) -> dict[str, list[int]]:
        by_server: dict[str, list[int]] = {}
        for i in indices:
            by_server.setdefault(self._pick(keys[i]), []).append(i)
        return by_server

    def _pick(self, key: str | None) -> str:
        """The server for one request: its sticky server if alive and not overloaded,
        else the least loaded (counted as in flight or queued); the request counts as
        load until released."""
        with self.lock:
            if not self.alive:
                raise NoEngineLeft(f"no rollout engine left of {self.urls} ({self._dead_summary()})")
            url = self.sticky.get(key) if key is not None else None
            least = min(self.alive, key=lambda u: (self.load[u], self.urls.index(u)))
            if url not in self.alive or self.load[url] > self.load[least] + self.rebalance_threshold:
                url = least
                if key is not None:
                    self.sticky[key] = url
                    if len(self.sticky) > self.max_sticky_keys:
                        self.sticky.popitem(last=False)
            elif key is not None:
                self.sticky.move_to_end(key)
            self.load[url] += 1
            return url

    # -- one request at a time, many in flight ----------------------------------------
    def submit(self, input_ids: Sequence[int], sampling_params: dict, *, rid: str | None = None,
               sticky_key: str | None = None, image_data: list[str] | None = None,
               prompt_tokens: int | None = None) -> Future:
        """Queue one request; the Future's result is its GenerateOutput. A server that
        fails it is marked dead and the request re-sent elsewhere (up to max_attempts).
        Cancelling the Future before the request is sent drops it. `image_data` and
        `prompt_tokens`: as in `generate`, for this one request."""
        done: Future = Future()
        self._send(done, token_id_list(input_ids), sampling_params, rid, sticky_key, attempt=0,
                   image_data=list(image_data) if image_data else None, prompt_tokens=prompt_tokens)
        return done

    def _send(self, done: Future, ids: list[int], params: dict, rid, key, attempt: int,
              image_data: list[str] | None = None, prompt_tokens: int | None = None) -> None:
        try:
            url = self._pick(key)
        except NoEngineLeft as e:
            settle_future(done, error=e)
            return
        with self.lock:
            if url not in self.lanes:
                self.lanes[url] = ThreadPoolExecutor(max_workers=self.max_inflight_per_engine,
                                                     thread_name_prefix="engine-lane")
            lane = self.lanes[url]
            self.queued.setdefault(url, deque()).append(_Queued(done, ids, params, rid, key, attempt,
                                                                image_data, prompt_tokens))
        try:
            lane.submit(self._run_queued, url)  # one call per request at most; later ones may find it sent
        except RuntimeError as e:  # closed
            self._release(url, key, failed=False)
            settle_future(done, error=EngineError(f"client closed: {e}"))

    def _run_queued(self, url: str) -> None:
        """One call with up to `requests_per_call` of the server's queued requests."""
        with self.lock:
            queue = self.queued.get(url) or deque()
            taken = [queue.popleft() for _ in range(min(len(queue), self.requests_per_call))]
        items = []
        for q in taken:
            if q.done.cancelled():  # the caller gave up on it (an aborted rollout): never sent
                self._release(url, q.key, failed=False)
            elif url not in self.alive:  # marked dead while this request queued: no attempt spent
                self._release(url, q.key, failed=True)
                self._send(q.done, q.ids, q.params, q.rid, q.key, q.attempt, q.image_data, q.prompt_tokens)
            else:
                items.append(q)
        if not items:
            return
        rids = [q.rid for q in items] if all(q.rid for q in items) else None
        try:
            outs = self._post_generate(url, [q.ids for q in items], [q.params for q in items], rids,
                                       [q.image_data for q in items], [q.prompt_tokens for q in items])
        except _ServerFailed as e:
            self._mark_dead(url, str(e))
            for q in items:
                self._release(url, q.key, failed=True)
                if q.attempt + 1 >= self.max_attempts:
                    settle_future(q.done, error=EngineError(f"request {q.rid} failed on {self.max_attempts} attempts "
                                                      f"({self._dead_summary()})"))
                else:
                    self._send(q.done, q.ids, q.params, q.rid, q.key, q.attempt + 1, q.image_data, q.prompt_tokens)
            return
        except BaseException as e:  # noqa: BLE001 - handed to the callers
            for q in items:
                self._release(url, q.key, failed=False)
                settle_future(q.done, error=e)
            return
        for q, out in zip(items, outs):
            self._release(url, q.key, failed=False)
            settle_future(q.done, result=out)

    def _release(self, url: str, key: str | None, failed: bool) -> None:
        with self.lock:
            self.load[url] -= 1
            if failed and key is not None:
                self.sticky.pop(key, None)

    def _post_generate(self, url: str, input_ids: list[list[int]], params, rids, image_data=None,
                       prompt_tokens=None) -> list[GenerateOutput]:
        """`input_ids`: each prompt's ids as `token_id_list` gives them."""
        body = {"input_ids": list(input_ids), "sampling_params": params, "return_logprob": True}
        if self.route_shape is not None:
            body["return_routed_experts"] = True
        if rids:
            body["rid"] = list(rids)
        if image_data and any(image_data):  # SGLang's per-request lists; [] for a text request
            body["image_data"] = [list(images or []) for images in image_data]
        version = self._serving_version(url) if self.lora_adapters else None
        if version is not None and adapter_name(version) is not None:
            body["lora_path"] = adapter_name(version)
        status, payload = self._call(url, "/generate", body)
        if status >= 500:
            raise _ServerFailed(f"HTTP {status}: {_shown(payload)}")
        if status != 200:
            raise EngineError(f"{url}/generate answered HTTP {status}: {_shown(payload)}")
        try:
            answers = generate_outputs(payload, len(input_ids), url, self.route_shape)
        except MalformedAnswer as e:
            raise _ServerFailed(f"malformed /generate answer for {len(input_ids)} prompt(s): {e}") from None
        for k, (out, meta) in enumerate(answers):
            if version is not None:  # the adapter's version, whatever the server holds by the end
                out.weight_version, out.token_versions = version, None
            expected = prompt_tokens[k] if prompt_tokens else None
            if expected is not None and meta.get("prompt_tokens") != expected:
                raise EngineError(
                    f"{url} counted {meta.get('prompt_tokens')} prompt tokens for request {k} of the call, but its "
                    f"expanded ids (each image pad repeated its image's token count) are {expected} tokens: the "
                    "server's image processor or chat template differs from the rollout's")
        return [out for out, _ in answers]

    def _serving_version(self, url: str) -> str:
        """The server's weight version, whose adapter the call names: an adapter-only sync
        loads version N's adapter before it sets version N, and unloads it only once two
        newer ones are in, waiting for the requests that name it."""
        status, payload = self._call(url, "/model_info", None)  # SGLang 0.5.23 has no /get_weight_version
        version = payload.get("weight_version") if status == 200 and isinstance(payload, dict) else None
        if type(version) not in (str, int):
            raise _ServerFailed(f"/model_info answered HTTP {status} without a weight_version: {_shown(payload)}")
        return str(version)

    def _call(self, url: str, path: str, body: dict | None, timeout_s: float | None = None):
        try:
            return self.transport("GET" if body is None else "POST", url + path, body,
                                  timeout_s=timeout_s or self.timeout_s, token=self.token)
        except (OSError, ValueError, http.client.HTTPException) as e:  # refused, reset, timed out, garbled
            raise _ServerFailed(f"{type(e).__name__}: {e}") from None

    def _mark_dead(self, url: str, reason: str) -> None:
        with self.lock:
            if url not in self.alive:
                return
            self.alive.remove(url)
            self.dead_events.append((url, reason))
        log.warning("rollout engine %s failed (%s); marked dead, re-sending its requests to %s",
                    url, reason, self.alive or "no other server")

    def _dead_summary(self) -> str:
        return "; ".join(f"{u}: {r}" for u, r in self.dead_events) or "none answered"

    # -- health ------------------------------------------------------------------------
    def check_health(self, timeout_s: float = 5.0) -> dict[str, bool]:
        """GET /health on every server; revive the ones that answer, retire the others."""
        futures = {u: self.pool.submit(self._call, u, "/health", None, timeout_s) for u in self.urls}
        healthy = {}
        for url, fut in futures.items():
            try:
                healthy[url] = fut.result()[0] == 200
            except _ServerFailed:
                healthy[url] = False
        for url, ok in healthy.items():
            if ok:
                with self.lock:
                    if url not in self.alive:
                        self.alive.append(url)
                        self.alive.sort(key=self.urls.index)
                        log.warning("rollout engine %s is healthy again", url)
            else:
                self._mark_dead(url, "health check failed")
        return healthy

    # -- control and weight updates (sent to every live server at once) ------------------
    def post_all(self, path: str, body: dict | None = None, *, timeout_s: float | None = None) -> list:
        with self.lock:
            urls = list(self.alive)
        if len(urls) == 1:  # one server: the call runs on the caller's thread (no hand-offs)
            return self._answers(path, urls, [self._outcome(urls[0], path, body or {}, timeout_s)])
        return self.post_all_async(path, body, timeout_s=timeout_s).result()

    def post_all_async(self, path: str, body: dict | None = None, *, timeout_s: float | None = None,
                       bodies: dict[str, dict] | None = None) -> Future:
        """POST to every live server concurrently; the future's result is the list of
        response bodies (server order), or it raises EngineError naming the failures."""
        with self.lock:
            urls = list(self.alive)
        if not urls:
            raise NoEngineLeft(f"no rollout engine left of {self.urls} ({self._dead_summary()})")
        done: Future = Future()
        outcomes: list = [None] * len(urls)
        remaining = [len(urls)]
        count_lock = threading.Lock()

        def finished(index: int, call: Future) -> None:  # on the pool thread that made the call
            outcomes[index] = call.exception() or call.result()
            with count_lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            try:
                done.set_result(self._answers(path, urls, outcomes))
            except BaseException as err:  # EngineError, or what a call raised unexpectedly
                done.set_exception(err)

        for i, u in enumerate(urls):
            call = self.pool.submit(self._call, u, path, (bodies or {}).get(u, body or {}), timeout_s)
            call.add_done_callback(lambda c, i=i: finished(i, c))
        return done

    def _outcome(self, url: str, path: str, body: dict, timeout_s: float | None):
        """(status, payload), or the _ServerFailed that the call raised."""
        try:
            return self._call(url, path, body, timeout_s)
        except _ServerFailed as err:
            return err

    @staticmethod
    def _answers(path: str, urls: list[str], outcomes: list) -> list:
        """The response bodies in server order, or EngineError naming every failure."""
        out, errors = [], []
        for u, outcome in zip(urls, outcomes):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, _ServerFailed):
                    raise outcome
                errors.append(f"{u}: {outcome}")
                continue
            status, payload = outcome
            if status != 200 or (isinstance(payload, dict) and payload.get("success") is False):
                errors.append(f"{u}{path}: HTTP {status}: {_shown(payload)}")
            out.append(payload)
        if errors:
            raise EngineError("; ".join(errors))
        return out

    def server_ranks(self, urls: Sequence[str] | None = None, timeout_s: float = 30.0) -> dict[str, int]:
        """How many ranks each server (default: the live ones) puts in a weight-update
        group. An SGLang server joins with every TP rank, at `rank_offset + tp_rank`, so
        its count is `tp_size`, read from `/server_info` (SGLang), else
        `/get_server_info` (older SGLang; the embedded engine); 1 when neither reports
        it. A server with pipeline stages is refused: SGLang (0.5.23) numbers only the TP
        rank, so its stages would claim the same ranks of the group."""
        if urls is None:
            with self.lock:
                urls = list(self.alive)
        futures = {u: self.pool.submit(self._server_info, u, timeout_s) for u in urls}
        ranks = {}
        for url, fut in futures.items():
            info = fut.result()
            tp, pp = _rank_count(url, info, "tp_size"), _rank_count(url, info, "pp_size")
            if pp > 1:
                raise EngineError(f"{url} runs {pp} pipeline stages: its stages would join the weight-update "
                                  "group at the same ranks (rank_offset + tp_rank); serve with --pp-size 1")
            ranks[url] = tp
        return ranks

    def _server_info(self, url: str, timeout_s: float) -> dict:
        for path in ("/server_info", "/get_server_info"):
            try:
                status, info = self._call(url, path, None, timeout_s)
            except _ServerFailed as e:
                raise EngineError(f"{url}{path}: {e}") from None
            if status == 200 and isinstance(info, dict):
                return info
            if status != 404:
                raise EngineError(f"{url}{path} answered HTTP {status}: {_shown(info)}")
        return {}

    def init_weights_update_group(self, master_address: str, master_port: int, group_name: str,
                                  backend: str = "gloo", ranks_per_server: int | dict[str, int] | None = None,
                                  timeout_s: float = 300.0) -> tuple[Future, int]:
        """Ask every live server to join the weight-update group. Returns (future,
        world_size); the trainer joins as rank 0 (`weight_group.init_weight_update_group`)
        while the future is pending, then waits on it. Each server joins with its ranks
        at consecutive offsets: server i at `1 + sum(ranks of servers before it)`, so the
        world size is 1 + every rank of every server. `ranks_per_server`: one count for
        all, a count per URL, or None to ask each server (`server_ranks`)."""
        with self.lock:
            urls = list(self.alive)
        if ranks_per_server is None:
            ranks = self.server_ranks(urls)
        elif isinstance(ranks_per_server, int):
            ranks = dict.fromkeys(urls, ranks_per_server)
        else:  # servers not named (revived since) are asked
            ranks = {u: int(ranks_per_server[u]) for u in urls if u in ranks_per_server}
            ranks.update(self.server_ranks([u for u in urls if u not in ranks]) if len(ranks) < len(urls) else {})
        offsets, next_rank = {}, 1
        for u in urls:
            offsets[u] = next_rank
            next_rank += ranks[u]
        world_size = next_rank
        bodies = {u: {"master_address": master_address, "master_port": int(master_port),
                      "rank_offset": offsets[u], "world_size": world_size,
                      "group_name": group_name, "backend": backend}
                  for u in urls}
        return self.post_all_async("/init_weights_update_group", bodies=bodies, timeout_s=timeout_s), world_size

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, *, weight_version: str | None = None,
                                        load_format: str | None = None, flush_cache: bool = True,
                                        timeout_s: float = 600.0) -> Future:
        """Announce one bucket; the servers then receive it by broadcast from rank 0, so
        the caller broadcasts while this future is pending."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, "weight_version": weight_version, "load_format": load_format}
        return self.post_all_async("/update_weights_from_distributed", body, timeout_s=timeout_s)

    def begin_weight_update(self) -> list:
        return self.post_all("/begin_weight_update", {"selector": "all"})

    def end_weight_update(self) -> list:
        return self.post_all("/end_weight_update", {})

    def destroy_weights_update_group(self, group_name: str) -> list:
        return self.post_all("/destroy_weights_update_group", {"group_name": group_name})

    def pause_generation(self, mode: str = "abort") -> list:
        return self.post_all("/pause_generation", {"mode": mode})

    def continue_generation(self) -> list:
        return self.post_all("/continue_generation", {})

    def flush_cache(self) -> list:
        return self.post_all("/flush_cache", {})

    def update_weight_version(self, version: str) -> list:
        return self.post_all("/update_weight_version", {"new_version": str(version)})

    def model_info(self) -> list:
        with self.lock:
            urls = list(self.alive)
        return [self._call(u, "/model_info", None, 30.0)[1] for u in urls]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            lanes = list(self.lanes.values())
        for lane in lanes:
            lane.shutdown(wait=False, cancel_futures=True)
