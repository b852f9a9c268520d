"""The embedded engine behind SGLang's HTTP protocol (the subset we use).

    python -m rollout.engine_server --model DIR --port 30000 [--host 127.0.0.1] [--device cuda]

Endpoints (`ROUTES`; each answers GET and POST alike, a GET with an empty body):
/generate, /health, /health_generate, /model_info (/get_model_info), /weight_version
(/get_weight_version), /init_weights_update_group, /destroy_weights_update_group,
/begin_weight_update, /end_weight_update, /update_weights_from_distributed (per-tensor or
load_format "flattened_bucket"), /update_weights_from_tensor (tensor handles in shared
memory, SGLang's format: rollout/weight_tensors.py), /release_memory_occupation and
/resume_memory_occupation (tags weights, kv_cache: rollout/engine_memory.py; /model_info
reports `memory_released`), /update_weights_from_disk, /weights_checksum (not in
SGLang: the weight-sync check), /update_weight_version, /pause_generation,
/continue_generation, /flush_cache (no prefix cache is kept; always succeeds),
/get_server_info (/server_info; `tp_size`: the engine's weight-update ranks, `--ranks N`).

`--ranks N` (default 1) runs the engine as N weight-update ranks, N replicas dealt
each batch round-robin (`rollout/engine_ranks.py`); /weights_checksum then answers 500
when the ranks disagree, and with `"per_rank": true` gives every rank's checksums.

Images (a vision-language model's directory): /generate takes SGLang's `image_data`, per
prompt a list of "data:image/...;base64," strings, one per image pad of its input_ids
([] or null for a text prompt; one prompt's list alone when input_ids is one prompt);
files, URLs and anything else answer 400. `meta_info.prompt_tokens` counts the expanded
ids (each pad repeated its image's token count), as SGLang's does.

Errors: 400 for a bad request (`BadRequest`, a body that is not JSON, a missing field,
named), 404 for an unknown path, 500 with the exception for anything else.

Guards (docs/security.md): bound to 127.0.0.1 by default; bound anywhere else it refuses
to start without a token (--auth-token or MEGATRON_AGENT_ENGINE_TOKEN). With a token,
every weight-changing or control call (`CONTROL_PATHS`) must carry `Authorization: Bearer
<token>` (compared in constant time; 401 otherwise). /update_weights_from_disk loads only
directories under --allowed-weight-dirs (default: the model's directory), any other path
only with the token (403 otherwise, nothing loaded). A body over --max-body-bytes answers
413; max_new_tokens over --max-new-tokens or past the model's context, and input ids that
are not integers within the vocabulary, answer 400.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from rollout.embedded_engine import DEFAULT_GROUP, BadRequest, Completion, Engine, SamplingParams
from rollout.engine_guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_NEW_TOKENS,
    InsecureBind,
    bearer_ok,
    generation_problem,
    may_load_from,
    require_token,
    resolved_dirs,
)
from rollout.engine_memory import released_problem
from rollout.engine_ranks import RankedEngine, rank_checksums

log = logging.getLogger("rollout.engine_server")

TOKEN_ENV = "MEGATRON_AGENT_ENGINE_TOKEN"
# Calls that change the weights or stop generation: they need the token when one is set
# (always, off loopback).
CONTROL_PATHS = frozenset({
    "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/update_weights_from_distributed", "/update_weights_from_disk",
    "/update_weight_version", "/pause_generation", "/continue_generation", "/flush_cache",
    "/update_weights_from_tensor", "/release_memory_occupation", "/resume_memory_occupation",
})

# A route's handler takes the engine and the parsed JSON body and returns the 200 answer.
Handler = Callable[[Engine, dict], object]


def parse_sampling_params(p: dict) -> SamplingParams:
    """SGLang's `sampling_params` object -> SamplingParams (SGLang's defaults)."""
    temperature = float(p.get("temperature", 1.0))
    stop = p.get("stop") or []
    seed = p.get("sampling_seed")
    return SamplingParams(
        temperature=temperature,
        top_p=float(p.get("top_p", 1.0)),
        top_k=int(p.get("top_k", -1) or -1),
        max_new_tokens=int(p.get("max_new_tokens", 128)),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(map(int, p.get("stop_token_ids") or [])),
        ignore_eos=bool(p.get("ignore_eos", False)),
        skip_special_tokens=bool(p.get("skip_special_tokens", True)),
        sampling_seed=int(seed) if seed is not None and temperature > 0 else None,  # greedy takes no seed
    )


def completion_json(c: Completion, return_logprob: bool) -> dict:
    """One /generate answer in SGLang's layout."""
    meta = {"id": c.rid, "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.output_ids), "cached_tokens": 0, "weight_version": c.weight_version}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.output_ids)]
    meta["engine_rank"] = c.rank  # not in SGLang: which of the engine's ranks served it
    return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}


def generate(engine: Engine, body: dict):
    """SGLang's /generate: one prompt -> one object, a batch -> a list."""
    input_ids = body.get("input_ids")
    if input_ids is None:
        raise BadRequest("the embedded engine takes input_ids (no text prompts)")
    single = bool(input_ids) and isinstance(input_ids[0], int)
    prompts = [input_ids] if single else input_ids
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids = body.get("rid")
    rids = [rids] if isinstance(rids, str) else (rids or [f"req-{time.monotonic_ns()}-{i}" for i in range(len(prompts))])
    if not (len(params) == len(rids) == len(prompts)):
        raise BadRequest("input_ids, sampling_params and rid differ in length")
    try:
        sampling = [parse_sampling_params(p) for p in params]
    except (AttributeError, TypeError, ValueError) as e:
        raise BadRequest(f"bad sampling_params: {e}") from None
    _check_prompts(engine, prompts, sampling)
    images = _request_images(engine, prompts, body.get("image_data"), single)
    if any(im is not None for im in images):  # the expanded prompts within the context too
        _check_prompts(engine, [im.input_ids if im is not None else ids for ids, im in zip(prompts, images)],
                       sampling)
    completions = engine.generate(prompts, sampling, rids, images)
    results = [completion_json(c, bool(body.get("return_logprob", False))) for c in completions]
    return results[0] if single else results


def _request_images(engine: Engine, prompts: list, image_data, single: bool) -> list:
    """Each prompt's images (`Engine.prepare_images`; None: a text prompt) from SGLang's
    `image_data`: for a batch, one list of data URLs per prompt ([] or null: no images);
    for one prompt, its list (or one data URL). Anything else is a BadRequest."""
    if image_data is None:
        return [None] * len(prompts)
    if single:
        image_data = [[image_data] if isinstance(image_data, str) else image_data]
    if not isinstance(image_data, list) or len(image_data) != len(prompts):
        raise BadRequest(f"image_data must be a list with one entry per prompt ({len(prompts)}), each a list of "
                         f"'data:image/...;base64,' strings; got {type(image_data).__name__}"
                         f"{f' of length {len(image_data)}' if isinstance(image_data, list) else ''}")
    out = []
    for i, (ids, items) in enumerate(zip(prompts, image_data)):
        if not items:
            out.append(None)
            continue
        try:
            out.append(engine.prepare_images(ids, items))
        except BadRequest as err:
            raise BadRequest(err if len(prompts) == 1 else f"prompt {i}: {err}") from None
    return out


def _check_prompts(engine: Engine, prompts: list, sampling: list[SamplingParams]) -> None:
    """Every prompt, before any is queued (an engine with ranks deals them out): integer ids
    within the vocabulary, max_new_tokens within the server's cap and the model's context;
    none while the engine's memory is released."""
    released = released_problem(engine.released)
    if released:
        raise BadRequest(released)
    vocab = engine.model.get_input_embeddings().weight.shape[0]
    context = engine.context_length
    for i, (ids, sp) in enumerate(zip(prompts, sampling)):
        problem = generation_problem(ids, sp.max_new_tokens, vocab_size=vocab, context_length=context,
                                     max_new_tokens_cap=engine.max_new_tokens_cap)
        if problem:
            raise BadRequest(problem if len(prompts) == 1 else f"prompt {i}: {problem}")


def _version(body: dict, key: str = "weight_version") -> str | None:
    return None if body.get(key) is None else str(body[key])


def _ok(**extra) -> dict:
    return {"success": True, "message": "ok", **extra}


def _health_generate(engine: Engine, body: dict) -> dict:
    engine.health_generate()
    return {}


def _init_group(engine: Engine, body: dict) -> dict:
    engine.init_group(body["master_address"], int(body["master_port"]), int(body["world_size"]),
                      rank_offset=int(body.get("rank_offset", 1)), group_name=body.get("group_name", DEFAULT_GROUP),
                      backend=body.get("backend", "nccl"), timeout_s=float(body.get("timeout_s", 300)))
    return _ok()


def _destroy_group(engine: Engine, body: dict) -> dict:
    engine.destroy_group(body.get("group_name", DEFAULT_GROUP))
    return _ok()


def _begin_update(engine: Engine, body: dict) -> dict:
    engine.begin_weight_update()
    return _ok()


def _end_update(engine: Engine, body: dict) -> dict:
    engine.end_weight_update()
    return _ok()


def _update_from_distributed(engine: Engine, body: dict) -> dict:
    names = list(body["names"])
    shapes = [list(s) for s in body["shapes"]]
    dtypes = list(body["dtypes"])
    engine.update_from_distributed(names, dtypes, shapes, group_name=body.get("group_name", DEFAULT_GROUP),
                                   load_format=body.get("load_format"), weight_version=_version(body))
    return _ok(weight_version=engine.weight_version)


def _update_from_tensor(engine: Engine, body: dict) -> dict:
    engine.update_from_tensor(list(body["serialized_named_tensors"]), load_format=body.get("load_format"),
                              weight_version=_version(body))
    return _ok(weight_version=engine.weight_version)


def _release_memory(engine: Engine, body: dict) -> dict:
    engine.release_memory(body.get("tags"))
    return _ok()


def _resume_memory(engine: Engine, body: dict) -> dict:
    engine.resume_memory(body.get("tags"))
    return _ok()


def _update_from_disk(engine: Engine, body: dict) -> dict:
    engine.update_from_disk(body["model_path"], _version(body))
    return _ok(weight_version=engine.weight_version)


def _weights_checksum(engine: Engine, body: dict) -> dict:
    names = list(body["names"])
    if body.get("per_rank"):
        return {"rank_checksums": rank_checksums(engine, names)}
    return {"checksums": engine.weight_checksums(names)}  # RankedEngine: raises when its ranks disagree


def _server_info(engine: Engine, body: dict) -> dict:
    """SGLang's /get_server_info, the fields we have: `tp_size` is the number of ranks the
    engine joins a weight-update group with."""
    return {**engine.model_info(), "tp_size": engine.ranks, "pp_size": 1, "dp_size": 1,
            "max_running_requests": engine.max_batch_size, "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device)}  # not in SGLang: where the model runs


def _update_weight_version(engine: Engine, body: dict) -> dict:
    engine.set_weight_version(str(body["new_version"]))
    return _ok()


def _pause(engine: Engine, body: dict) -> dict:
    engine.pause(body.get("mode", "abort"))
    return _ok()


def _resume(engine: Engine, body: dict) -> dict:
    engine.resume()
    return _ok()


_HANDLERS: dict[str, Handler] = {
    "/generate": generate,
    "/health": lambda engine, body: {},
    "/health_generate": _health_generate,
    "/model_info": lambda engine, body: engine.model_info(),
    "/get_model_info": lambda engine, body: engine.model_info(),
    "/weight_version": lambda engine, body: {"weight_version": engine.weight_version},
    "/get_weight_version": lambda engine, body: {"weight_version": engine.weight_version},
    "/init_weights_update_group": _init_group,
    "/destroy_weights_update_group": _destroy_group,
    "/begin_weight_update": _begin_update,
    "/end_weight_update": _end_update,
    "/update_weights_from_distributed": _update_from_distributed,
    "/update_weights_from_disk": _update_from_disk,
    "/update_weights_from_tensor": _update_from_tensor,
    "/release_memory_occupation": _release_memory,
    "/resume_memory_occupation": _resume_memory,
    "/weights_checksum": _weights_checksum,
    "/get_server_info": _server_info,
    "/server_info": _server_info,  # newer SGLang's name
    "/update_weight_version": _update_weight_version,
    "/pause_generation": _pause,
    "/continue_generation": _resume,
    "/flush_cache": lambda engine, body: _ok(),  # no prefix cache is kept
}
# (method, path) -> handler. Every path answers GET and POST alike, as it always has.
ROUTES: dict[tuple[str, str], Handler] = {(m, p): h for p, h in _HANDLERS.items() for m in ("GET", "POST")}


class _Refused(Exception):
    """A request answered with `code` before (or instead of) reading its body."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def make_handler(engine: Engine, token: str | None, *, allowed_weight_dirs: Sequence[str] | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The request handler class. `token`: when set, CONTROL_PATHS need it. Without it,
    /update_weights_from_disk loads only under `allowed_weight_dirs` (default: the model's
    directory). Bodies over `max_body_bytes` answer 413."""
    weight_dirs = resolved_dirs(allowed_weight_dirs if allowed_weight_dirs is not None else [engine.model_path])

    def disk_path(body: dict, trusted: bool) -> str:
        path = body["model_path"]
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path must be a directory path")
        if not trusted and not may_load_from(path, weight_dirs):
            raise _Refused(403, f"model_path {path} is outside the directories this engine loads weights from "
                                f"({', '.join(map(str, weight_dirs))}); start it with --allowed-weight-dirs, "
                                "or send its token")
        real = Path(path).expanduser().resolve()
        if not real.is_dir():
            raise BadRequest(f"model_path {path} is not a directory on the engine's machine")
        return str(real)

    class RequestHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 300  # seconds a client may stall mid-request before its connection is dropped

        def log_message(self, fmt, *args):  # the default logs every request to stderr
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, payload, close: bool = False) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:  # the body was left unread: end the connection
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _length(self) -> int:
            if "Transfer-Encoding" in self.headers:
                raise _Refused(411, "send a Content-Length (chunked bodies are not read)")
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise _Refused(400, "Content-Length is not a number") from None
            if n < 0:
                raise _Refused(400, "Content-Length is negative")
            if n > max_body_bytes:
                raise _Refused(413, f"a body of {n} bytes is over this server's limit of {max_body_bytes} "
                                    "(--max-body-bytes)")
            return n

        def _body(self, n: int) -> dict:
            if not n:
                return {}
            try:
                body = json.loads(self.rfile.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            return body

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?")[0]
            try:
                n = self._length()
                authorized = token is not None and bearer_ok(self.headers.get("Authorization"), token)
                if token is not None and path in CONTROL_PATHS and not authorized:
                    raise _Refused(401, "missing or wrong token")
                if method == "GET":
                    self.rfile.read(n)  # a GET's body is read and ignored
                body = self._body(n) if method == "POST" else {}
                handler = ROUTES.get((method, path))
                if handler is None:
                    return self._send(404, {"success": False, "message": f"no endpoint {path}"})
                if path == "/update_weights_from_disk":
                    body = {**body, "model_path": disk_path(body, trusted=authorized)}
                self._send(200, handler(engine, body))
            except _Refused as e:
                self._send(e.code, {"success": False, "message": str(e)}, close=True)
            except BadRequest as e:
                self._send(400, {"success": False, "message": str(e)})
            except KeyError as e:
                self._send(400, {"success": False, "message": f"missing field {e}"})
            except Exception as e:
                log.error("%s failed:\n%s", path, traceback.format_exc())
                self._send(500, {"success": False, "message": f"{type(e).__name__}: {e}"})

    return RequestHandler


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, *, token: str | None = None,
          threads: int = 1, max_batch_size: int = 256, dtype: str = "float32", ranks: int = 1,
          device: str = "cpu", allowed_weight_dirs: Sequence[str] | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS) -> None:
    try:  # before anything loads
        require_token(host, token, "the embedded engine")
    except InsecureBind as e:
        raise SystemExit(f"rollout.engine_server: error: {e}") from None
    if device != "cpu" and ranks != 1:
        raise SystemExit(f"rollout.engine_server: error: --device {device} runs one rank (--ranks 1)")
    torch.set_num_threads(threads)
    if ranks == 1:
        engine = Engine(model, dtype=dtype, max_batch_size=max_batch_size, device=device)
    else:  # a rank process that dies takes the server down, as a TP worker's death does SGLang's
        engine = RankedEngine(model, ranks=ranks, dtype=dtype, max_batch_size=max_batch_size, threads=threads,
                              on_rank_death=lambda why: os._exit(1))
    engine.max_new_tokens_cap = max_new_tokens
    handler = make_handler(engine, token or None, allowed_weight_dirs=allowed_weight_dirs or [model],
                           max_body_bytes=max_body_bytes)
    server = ThreadingHTTPServer((host, port), handler, bind_and_activate=False)
    # The asynchronous agent loop opens a connection per request, dozens at once: the
    # default backlog (5) overflows into SYN cookies and resets.
    server.request_queue_size = 1024
    server.server_bind()
    server.server_activate()
    server.daemon_threads = True
    log.info("embedded engine for %s on http://%s:%d", model, host, port)
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ranks", type=int, default=1, help="weight-update ranks (replicas), like SGLang's --tp-size")
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu, or cuda[:N] (one rank)")
    ap.add_argument("--allowed-weight-dirs", nargs="+", metavar="DIR",
                    help="where /update_weights_from_disk may load from without the token (default: --model)")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies answer 413")
    ap.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                    help="the most max_new_tokens one request may ask (the model's context caps it too)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(args.model, args.host, args.port, token=args.auth_token, threads=args.threads,
          max_batch_size=args.max_batch_size, dtype=args.dtype, ranks=args.ranks, device=args.device,
          allowed_weight_dirs=args.allowed_weight_dirs, max_body_bytes=args.max_body_bytes,
          max_new_tokens=args.max_new_tokens)


if __name__ == "__main__":
    main()
