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
/get_server_info (/server_info; `tp_size`: the engine's weight-update ranks, `--ranks N`),
/load_lora_adapter, /load_lora_adapter_from_tensors and /unload_lora_adapter (LoRA adapters
by name, which /generate's `lora_path` names: rollout/engine_lora.py).

`--ranks N` (default 1) runs the engine as N weight-update ranks, N replicas dealt
each batch round-robin (`rollout/engine_ranks.py`); /weights_checksum then answers 500
when the ranks disagree, and with `"per_rank": true` gives every rank's checksums.

Images (a vision-language model's directory): /generate takes SGLang's `image_data`, per
prompt a list of "data:image/...;base64," strings, one per image pad of its input_ids
([] or null for a text prompt; one prompt's list alone when input_ids is one prompt);
files, URLs and anything else answer 400. `meta_info.prompt_tokens` counts the expanded
ids (each pad repeated its image's token count), as SGLang's does.

Requests (rollout/engine_requests.py; its field checks: rollout/json_fields.py): every endpoint parses its body with its schema
before anything is queued or changed (SGLang 0.5.23's types, ranges and defaults; strict
JSON types). Errors are JSON, `{"success": false, "error": ..., "message": ...,
"field": ...}` (rollout/engine_http.py), never a traceback (that goes to the log): 400 for
a bad request, naming the field; 404 for an unknown path; 405 (with `Allow: GET, POST`)
for another method on a known one; 408 for a request not received within
--request-timeout-s; 503 past --max-connections; 500 for an engine fault (a request that
failed inside the batch, alone: the batch is run again without it; ranks that disagree).

Guards (docs/security.md): bound to 127.0.0.1 by default; bound anywhere else it refuses
to start without a token (--auth-token or MEGATRON_AGENT_ENGINE_TOKEN). With a token,
every weight-changing or control call (`CONTROL_PATHS`) must carry `Authorization: Bearer
<token>` (compared in constant time; 401 otherwise). /update_weights_from_disk (and
/load_lora_adapter) loads only directories under --allowed-weight-dirs (default: the model's directory), any other path
only with the token (403 otherwise, nothing loaded). A body over --max-body-bytes answers
413; max_new_tokens over --max-new-tokens or past the model's context, and input ids that
are not integers within the vocabulary, answer 400. A client has --request-timeout-s (60)
to send a whole request, and at most --max-connections (512) are open at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from rollout.embedded_engine import BadRequest, Completion, Engine, GenerationFailed
from rollout.engine_guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_NEW_TOKENS,
    InsecureBind,
    bearer_ok,
    may_load_from,
    require_token,
    resolved_dirs,
)
from rollout.engine_http import (
    ALLOWED_METHODS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT_S,
    EngineHTTPServer,
    JsonRequestHandler,
    Refused,
    error_body,
)
from rollout.engine_memory import released_problem
from rollout.engine_ranks import RankedEngine, RanksDisagree, rank_checksums
from rollout.engine_requests import (
    GenerationLimits,
    parse_continue,
    parse_disk_update,
    parse_distributed_update,
    parse_flush_cache,
    parse_generate,
    parse_group_name,
    parse_init_group,
    parse_load_adapter,
    parse_load_adapter_from_tensors,
    parse_memory_tags,
    parse_pause,
    parse_selector,
    parse_tensor_update,
    parse_unload_adapter,
    parse_weight_version,
    parse_weights_checksum,
)
from rollout.json_fields import describe, parse_json_object
from rollout.routed_experts import encode_routes

log = logging.getLogger("rollout.engine_server")

TOKEN_ENV = "MEGATRON_AGENT_ENGINE_TOKEN"
# Calls that change the weights or stop generation: they need the token when one is set
# (always, off loopback).
CONTROL_PATHS = frozenset({
    "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/update_weights_from_distributed", "/update_weights_from_disk",
    "/update_weight_version", "/pause_generation", "/continue_generation", "/flush_cache",
    "/update_weights_from_tensor", "/release_memory_occupation", "/resume_memory_occupation",
    "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
})

# A route's handler takes the engine and the parsed JSON body and returns the 200 answer;
# each first parses its body with its schema (rollout/engine_requests.py; its field checks: rollout/json_fields.py).
Handler = Callable[[Engine, dict], object]


def completion_json(c: Completion, return_logprob: bool) -> dict:
    """One /generate answer in SGLang's layout."""
    meta = {"id": c.rid, "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.output_ids), "cached_tokens": 0, "weight_version": c.weight_version}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.output_ids)]
    meta["engine_rank"] = c.rank  # not in SGLang: which of the engine's ranks served it
    if c.routed_experts is not None:
        meta["routed_experts"] = encode_routes(c.routed_experts)
    if c.token_versions is not None:  # not in SGLang: the tokens span a weight update
        meta["output_token_weight_versions"] = c.token_versions
    return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}


def generation_limits(engine: Engine) -> GenerationLimits:
    return GenerationLimits(vocab_size=engine.model.get_input_embeddings().weight.shape[0],
                            context_length=engine.context_length, max_new_tokens_cap=engine.max_new_tokens_cap)


def generate(engine: Engine, body: dict):
    """SGLang's /generate: one prompt -> one object, a batch -> a list."""
    released = released_problem(engine.released)  # first: released weights have no vocabulary to check against
    if released:
        raise BadRequest(released)
    limits = generation_limits(engine)
    req = parse_generate(body, limits)
    images = _request_images(engine, req.prompts, req.image_data, req.single)
    if any(im is not None for im in images):  # the expanded prompts within the context too
        try:
            expanded = [len(ids) if im is None else len(im.input_ids) for ids, im in zip(req.prompts, images)]
            req = replace(parse_generate(body, limits, expanded), rids=req.rids)
        except BadRequest as err:
            raise BadRequest(f"{err} (with each image pad expanded to its image's tokens)", err.field) from None
    completions = engine.generate(req.prompts, req.sampling, req.rids, images, req.routed_experts, req.adapters)
    results = [completion_json(c, lp) for c, lp in zip(completions, req.return_logprob)]
    return results[0] if req.single else results


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
                         f"{f' of length {len(image_data)}' if isinstance(image_data, list) else ''}", "image_data")
    out = []
    for i, (ids, items) in enumerate(zip(prompts, image_data)):
        if not items:
            out.append(None)
            continue
        try:
            out.append(engine.prepare_images(ids, items))
        except BadRequest as err:
            raise BadRequest(err if len(prompts) == 1 else f"prompt {i}: {err}", "image_data") from None
    return out


def _ok(**extra) -> dict:
    return {"success": True, "message": "ok", **extra}


def _no_fields(engine: Engine, body: dict) -> dict:
    """A read-only endpoint: no fields (unknown ones are ignored, as SGLang does)."""
    return {}


def _health_generate(engine: Engine, body: dict) -> dict:
    engine.health_generate()
    return {}


def _init_group(engine: Engine, body: dict) -> dict:
    req = parse_init_group(body, engine.ranks)
    engine.init_group(req.master_address, req.master_port, req.world_size, rank_offset=req.rank_offset,
                      group_name=req.group_name, backend=req.backend, timeout_s=req.timeout_s)
    return _ok()


def _destroy_group(engine: Engine, body: dict) -> dict:
    engine.destroy_group(parse_group_name(body))
    return _ok()


def _begin_update(engine: Engine, body: dict) -> dict:
    parse_selector(body)
    engine.begin_weight_update()
    return _ok()


def _end_update(engine: Engine, body: dict) -> dict:
    engine.end_weight_update()
    return _ok()


def _update_from_distributed(engine: Engine, body: dict) -> dict:
    req = parse_distributed_update(body)
    engine.update_from_distributed(req.names, req.dtypes, req.shapes, group_name=req.group_name,
                                   load_format=req.load_format, weight_version=req.weight_version)
    return _ok(weight_version=engine.weight_version)


def _update_from_tensor(engine: Engine, body: dict) -> dict:
    req = parse_tensor_update(body)
    engine.update_from_tensor(req.serialized_named_tensors, load_format=req.load_format,
                              weight_version=req.weight_version)
    return _ok(weight_version=engine.weight_version)


def _release_memory(engine: Engine, body: dict) -> dict:
    engine.release_memory(parse_memory_tags(body))
    return _ok()


def _resume_memory(engine: Engine, body: dict) -> dict:
    engine.resume_memory(parse_memory_tags(body))
    return _ok()


def _update_from_disk(engine: Engine, body: dict) -> dict:
    req = parse_disk_update(body)
    engine.update_from_disk(req.model_path, req.weight_version)
    return _ok(weight_version=engine.weight_version)


def _load_adapter(engine: Engine, body: dict) -> dict:
    req = parse_load_adapter(body)
    engine.load_lora_adapter(req.lora_name, req.lora_path)
    return _adapters_answer(engine)


def _load_adapter_from_tensors(engine: Engine, body: dict) -> dict:
    req = parse_load_adapter_from_tensors(body)
    engine.load_lora_adapter_from_tensors(req.lora_name, req.config_dict, req.serialized_named_tensors,
                                          req.load_format)
    return _adapters_answer(engine)


def _unload_adapter(engine: Engine, body: dict) -> dict:
    engine.unload_lora_adapter(parse_unload_adapter(body).lora_name)
    return _adapters_answer(engine)


def _adapters_answer(engine: Engine) -> dict:
    """SGLang's LoRAUpdateOutput: success, error_message, loaded_adapters {name: path}."""
    return {"success": True, "error_message": None,
            "loaded_adapters": {name: "__tensor__" for name in engine.adapters.loaded}}


def _weights_checksum(engine: Engine, body: dict) -> dict:
    names, per_rank = parse_weights_checksum(body)
    if per_rank:
        return {"rank_checksums": rank_checksums(engine, names)}
    return {"checksums": engine.weight_checksums(names)}  # RankedEngine: raises when its ranks disagree


def _server_info(engine: Engine, body: dict) -> dict:
    """SGLang's /get_server_info, the fields we have: `tp_size` is the number of ranks the
    engine joins a weight-update group with."""
    return {**engine.model_info(), "tp_size": engine.ranks, "pp_size": 1, "dp_size": 1,
            "max_running_requests": engine.max_batch_size, "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device)}  # not in SGLang: where the model runs


def _update_weight_version(engine: Engine, body: dict) -> dict:
    engine.set_weight_version(parse_weight_version(body))
    return _ok()


def _pause(engine: Engine, body: dict) -> dict:
    engine.pause(parse_pause(body))
    return _ok()


def _resume(engine: Engine, body: dict) -> dict:
    parse_continue(body)
    engine.resume()
    return _ok()


def _flush_cache(engine: Engine, body: dict) -> dict:
    parse_flush_cache(body)
    return _ok()  # no prefix cache is kept


_HANDLERS: dict[str, Handler] = {
    "/generate": generate,
    "/health": _no_fields,
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
    "/flush_cache": _flush_cache,
    "/load_lora_adapter": _load_adapter,
    "/load_lora_adapter_from_tensors": _load_adapter_from_tensors,
    "/unload_lora_adapter": _unload_adapter,
}
# (method, path) -> handler. Every path answers GET and POST alike, as it always has.
ROUTES: dict[tuple[str, str], Handler] = {(m, p): h for p, h in _HANDLERS.items() for m in ALLOWED_METHODS}
# Engine faults whose messages are ours (no paths, no traceback): sent with the 500.
_KNOWN_FAULTS = (GenerationFailed, RanksDisagree)


def make_handler(engine: Engine, token: str | None, *, allowed_weight_dirs: Sequence[str] | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The request handler class (for an `EngineHTTPServer`). `token`: when set,
    CONTROL_PATHS need it. Without it, /update_weights_from_disk loads only under
    `allowed_weight_dirs` (default: the model's directory). Bodies over `max_body_bytes`
    answer 413."""
    weight_dirs = resolved_dirs(allowed_weight_dirs if allowed_weight_dirs is not None else [engine.model_path])

    def disk_path(path: str, trusted: bool, field: str = "model_path") -> str:
        try:
            allowed = trusted or may_load_from(path, weight_dirs)
            real = Path(path).expanduser().resolve()
            is_dir = real.is_dir()
        except (OSError, RuntimeError, ValueError) as err:  # a name too long, "~nobody", ...
            raise BadRequest(f"{field} {describe(path)} is no usable path: {type(err).__name__}",
                             field) from None
        if not allowed:
            raise Refused(403, f"{field} {path} is outside the directories this engine loads weights from "
                               f"({', '.join(map(str, weight_dirs))}); start it with --allowed-weight-dirs, "
                               "or send its token", field)
        if not is_dir:
            raise BadRequest(f"{field} {path} is not a directory on the engine's machine", field)
        return str(real)

    class RequestHandler(JsonRequestHandler):
        known_paths = frozenset(_HANDLERS)

        def _length(self) -> int:
            if "Transfer-Encoding" in self.headers:
                raise Refused(411, "send a Content-Length (chunked bodies are not read)")
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise Refused(400, "Content-Length is not a number") from None
            if n < 0:
                raise Refused(400, "Content-Length is negative")
            if n > max_body_bytes:
                raise Refused(413, f"a body of {n} bytes is over this server's limit of {max_body_bytes} "
                                   "(--max-body-bytes)")
            return n

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
                    raise Refused(401, "missing or wrong token")
                raw = self.read_body(n)  # a GET's body is read and ignored
                handler = ROUTES.get((method, path))
                if handler is None:
                    return self.send_json(404, error_body(f"no endpoint {path}"))
                body = parse_json_object(raw) if method == "POST" and raw else {}
                if path == "/update_weights_from_disk":
                    body = {**body, "model_path": disk_path(parse_disk_update(body).model_path, trusted=authorized)}
                elif path == "/load_lora_adapter":
                    body = {**body, "lora_path": disk_path(parse_load_adapter(body).lora_path, trusted=authorized,
                                                           field="lora_path")}
                self.send_json(200, handler(engine, body))
            except Refused as e:
                self.send_json(e.code, error_body(str(e), e.field), close=True)
            except BadRequest as e:
                self.send_json(400, error_body(str(e), e.field))
            except _KNOWN_FAULTS as e:
                log.error("%s failed:\n%s", path, traceback.format_exc())
                self.send_json(500, error_body(f"{type(e).__name__}: {e}"))
            except Exception as e:
                log.error("%s failed:\n%s", path, traceback.format_exc())
                self.send_json(500, error_body(f"{path} failed inside the engine ({type(e).__name__}); the engine's "
                                               "log has the traceback"))

    return RequestHandler


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                allowed_weight_dirs: Sequence[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                max_connections: int = DEFAULT_MAX_CONNECTIONS) -> EngineHTTPServer:
    """`engine` behind its routes, bound to (host, port) (0: a free one), not yet serving
    (`serve_forever`)."""
    handler = make_handler(engine, token or None, allowed_weight_dirs=allowed_weight_dirs,
                           max_body_bytes=max_body_bytes)
    return EngineHTTPServer((host, port), handler, request_timeout_s=request_timeout_s,
                            max_connections=max_connections)


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, *, token: str | None = None,
          threads: int = 1, max_batch_size: int = 256, dtype: str = "float32", ranks: int = 1,
          device: str = "cpu", allowed_weight_dirs: Sequence[str] | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
          request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
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
    server = make_server(engine, host, port, token=token, allowed_weight_dirs=allowed_weight_dirs or [model],
                         max_body_bytes=max_body_bytes, request_timeout_s=request_timeout_s,
                         max_connections=max_connections)
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
    ap.add_argument("--request-timeout-s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                    help="seconds a client has to send a whole request (line, headers, body); 408 beyond")
    ap.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                    help="connections open at once; more wait up to twice --request-timeout-s, then get 503")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(args.model, args.host, args.port, token=args.auth_token, threads=args.threads,
          max_batch_size=args.max_batch_size, dtype=args.dtype, ranks=args.ranks, device=args.device,
          allowed_weight_dirs=args.allowed_weight_dirs, max_body_bytes=args.max_body_bytes,
          max_new_tokens=args.max_new_tokens, request_timeout_s=args.request_timeout_s,
          max_connections=args.max_connections)


if __name__ == "__main__":
    main()
