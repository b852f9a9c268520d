"""The embedded engine behind SGLang's HTTP protocol (the subset we use).

    python -m rollout.engine_server --model DIR --port 30000 [--host 127.0.0.1]

Endpoints (`ROUTES`; each answers GET and POST alike, a GET with an empty body):
/generate, /health, /health_generate, /model_info (/get_model_info), /weight_version
(/get_weight_version), /init_weights_update_group, /destroy_weights_update_group,
/begin_weight_update, /end_weight_update, /update_weights_from_distributed (per-tensor or
load_format "flattened_bucket"), /update_weights_from_disk, /weights_checksum (not in
SGLang: the weight-sync check), /update_weight_version, /pause_generation,
/continue_generation, /flush_cache (no prefix cache is kept; always succeeds).

Errors: 400 for a bad request (`BadRequest`, a body that is not JSON, a missing field,
named), 404 for an unknown path, 500 with the exception for anything else.

Bound to 127.0.0.1 by default. Bound anywhere else, it needs a token (--auth-token or
MEGATRON_AGENT_ENGINE_TOKEN), and every weight-changing or control call must carry
`Authorization: Bearer <token>` (401 otherwise).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from rollout.embedded_engine import DEFAULT_GROUP, BadRequest, Completion, Engine, SamplingParams

log = logging.getLogger("rollout.engine_server")

TOKEN_ENV = "MEGATRON_AGENT_ENGINE_TOKEN"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Calls that change the weights or stop generation: token-protected off localhost.
CONTROL_PATHS = frozenset({
    "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/update_weights_from_distributed", "/update_weights_from_disk",
    "/update_weight_version", "/pause_generation", "/continue_generation", "/flush_cache",
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
    completions = engine.generate(prompts, [parse_sampling_params(p) for p in params], rids)
    results = [completion_json(c, bool(body.get("return_logprob", False))) for c in completions]
    return results[0] if single else results


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


def _update_from_disk(engine: Engine, body: dict) -> dict:
    engine.update_from_disk(body["model_path"], _version(body))
    return _ok(weight_version=engine.weight_version)


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
    "/weights_checksum": lambda engine, body: {"checksums": engine.weight_checksums(list(body["names"]))},
    "/update_weight_version": _update_weight_version,
    "/pause_generation": _pause,
    "/continue_generation": _resume,
    "/flush_cache": lambda engine, body: _ok(),  # no prefix cache is kept
}
# (method, path) -> handler. Every path answers GET and POST alike, as it always has.
ROUTES: dict[tuple[str, str], Handler] = {(m, p): h for p, h in _HANDLERS.items() for m in ("GET", "POST")}


def make_handler(engine: Engine, token: str | None):
    class RequestHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # the default logs every request to stderr
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            if not n:
                return {}
            try:
                return json.loads(self.rfile.read(n))
            except json.JSONDecodeError as e:
                raise BadRequest(f"body is not JSON: {e}") from None

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?")[0]
            try:
                body = {} if method == "GET" else self._body()
                if token is not None and path in CONTROL_PATHS:
                    if self.headers.get("Authorization") != f"Bearer {token}":
                        return self._send(401, {"success": False, "message": "missing or wrong token"})
                handler = ROUTES.get((method, path))
                if handler is None:
                    return self._send(404, {"success": False, "message": f"no endpoint {path}"})
                self._send(200, handler(engine, body))
            except BadRequest as e:
                self._send(400, {"success": False, "message": str(e)})
            except KeyError as e:
                self._send(400, {"success": False, "message": f"missing field {e}"})
            except Exception as e:
                log.error("%s failed:\n%s", path, traceback.format_exc())
                self._send(500, {"success": False, "message": f"{type(e).__name__}: {e}"})

    return RequestHandler


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, *, token: str | None = None,
          threads: int = 1, max_batch_size: int = 256, dtype: str = "float32") -> None:
    if host not in LOCAL_HOSTS and not token:
        raise SystemExit(f"binding to {host} needs a token: pass --auth-token or set {TOKEN_ENV}")
    torch.set_num_threads(threads)
    engine = Engine(model, dtype=dtype, max_batch_size=max_batch_size)
    server = ThreadingHTTPServer((host, port), make_handler(engine, token if host not in LOCAL_HOSTS else None))
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(args.model, args.host, args.port, token=args.auth_token, threads=args.threads,
          max_batch_size=args.max_batch_size, dtype=args.dtype)


if __name__ == "__main__":
    main()
