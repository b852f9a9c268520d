"""The embedded engine's request schemas: one parser per endpoint (rollout/engine_server.py
calls it first), so a request is checked whole before anything is queued or changed.

Every parser takes the JSON body and returns the typed request, or raises `BadRequest`
naming the field at fault (`err.field`: "sampling_params[1].top_k", "input_ids", ...).
Types are strict: a boolean is not an integer, "5" is not a number, 1.5 is not an
integer, and NaN and +-Infinity (which Python's JSON parser reads) are no numbers.
`null` means the field's default, as in SGLang. Top-level keys the engine does not know
are ignored (SGLang's structs ignore them too); unknown keys in `sampling_params` are
refused (SGLang refuses them).

What SGLang 0.5.23 accepts, these accept; what it refuses, they refuse. Followed:
- /generate's JSON contract, `sglang/api/v1/api_types.py` (`decode_GenerateRequest`,
  `decode_SamplingParams`: strict JSON types, the known sampling keys), and
  `sglang/srt/managers/io_struct.py` `GenerateReqInput` (input_ids a list of ids or of
  lists, "input_ids cannot be empty"; rid a string, for a batch the prefix of
  "{rid}_{i}", or one unique string per prompt; one sampling_params object for all
  prompts or one per prompt; return_logprob a bool or one per prompt;
  return_routed_experts one bool for the call).
- `sglang/srt/sampling/sampling_params.py` `SamplingParams`: `__post_init__` (null is the
  default; a temperature in [0, 1e-6) is greedy), `verify` (temperature finite and >= 0;
  top_p in (0, 1]; top_k -1 or >= 1; max_new_tokens >= 0; sampling_seed an integer in
  [-2**63, 2**63 - 1]), `normalize` (stop: a string or a list of at most 32 strings).
- `sglang/srt/managers/tokenizer_manager.py` `_validate_one_request`: the prompt must be
  shorter than the model's context, and a given max_new_tokens fit in the rest; a null
  one means the rest of the context and an absent one the default 128, cut to the rest
  (scheduler.py `init_req_max_new_tokens`).
- The weight and memory endpoints: the `*ReqInput` structs of io_struct.py
  (`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`,
  `UpdateWeightsFromTensorReqInput`, `UpdateWeightFromDiskReqInput`,
  `Release/ResumeMemoryOccupationReqInput`, `UpdateWeightVersionReqInput`,
  `PauseGenerationReqInput`): the field names, types and defaults.

Where this engine differs, on purpose:
- SGLang's pydantic check of the weight endpoints is lax ("5" passes for an int); here
  every field's JSON type must be the declared one, as the /generate contract does.
- Sampling features the engine does not implement (min_p, penalties, n > 1, beams,
  grammars, logit_bias, stop_regex, watermarks, choice) are accepted at their neutral
  value only, and refused otherwise: a request is never served with a setting silently
  dropped. custom_params (for custom logit processors, of which this engine has none)
  and stream_interval (streaming) are accepted and unused, as SGLang without them.
- top_k beyond the vocabulary means the whole vocabulary; past 2**63 - 1 it is refused
  (the contract's i64: SGLang's Python decoder does not check it, and its int32 top_k
  tensor fails past 2**31 - 1). `stream: true` and text prompts are refused.
- Integers (ids, seeds, stop_token_ids) must fit in 64 bits, as the contract's i64.
- `rank_offset` of /init_weights_update_group defaults to 1 (required in SGLang).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import torch

from rollout.embedded_engine import DEFAULT_GROUP, BadRequest, SamplingParams
from rollout.json_fields import (
    boolean,
    describe,
    integer,
    json_object,
    listed,
    number,
    one_of,
    optional,
    required,
    string,
    strings,
)
from rollout.weight_group import dtype_from_name

GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature is greedy
MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT
DEFAULT_REQUEST_MAX_NEW_TOKENS = 128  # SGLang's default, when the request names none
MAX_GROUP_TIMEOUT_S = 86400.0
LOAD_FORMATS_DISTRIBUTED = (None, "direct", "flattened_bucket")
LOAD_FORMATS_TENSOR = (None, "flattened_bucket")
PAUSE_MODES = ("abort", "retract", "in_place")
GROUP_BACKENDS = ("gloo", "nccl")
SELECTORS = ("all", "target")  # SGLang's "draft" names a draft model, which this engine has none of
WIRE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
               torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
SAMPLING_KEYS = (  # SGLang's, in sglang/api/v1/api_types.py `_FIELDS_SamplingParams`
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
# Not implemented here; each accepted at its neutral value only (the value that changes nothing).
_NEUTRAL_NUMBERS = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
_NEUTRAL_INTEGERS = {"min_new_tokens": 0, "n": 1, "beam_width": 1}
_NEUTRAL_EMPTY = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "watermark", "choice")
_IGNORED_BOOLS = ("spaces_between_special_tokens", "no_stop_trim")  # the text is decoded whole, nothing trimmed

# -- /generate --------------------------------------------------------------------------------

@dataclass(frozen=True)
class GenerationLimits:
    """What bounds one request on this engine."""

    vocab_size: int
    context_length: int | None  # the model's max_position_embeddings
    max_new_tokens_cap: int | None  # the server's --max-new-tokens


@dataclass(frozen=True)
class GenerateRequest:
    prompts: list[list[int]]
    sampling: list[SamplingParams]
    rids: list[str]
    single: bool  # one prompt sent bare: answered with one object, not a list
    return_logprob: list[bool]
    image_data: object  # as sent; checked with the images (engine_server._request_images)
    routed_experts: bool = False  # return_routed_experts: the experts each fed token went to (MoE)
    adapters: list[str | None] | None = None  # lora_path: each prompt's LoRA adapter by name (None: the base)


def parse_sampling_params(p, field: str, *, prompt_tokens: int, limits: GenerationLimits) -> SamplingParams:
    """SGLang's `sampling_params` object for one prompt -> SamplingParams (SGLang's
    defaults and ranges; see the module docstring)."""
    if type(p) is not dict:
        raise BadRequest(f"{field} must be an object, got {describe(p)}", field)
    where = f"{field}."
    for key in p:
        if key not in SAMPLING_KEYS:
            raise BadRequest(f"{where}{key} is not a sampling parameter (SGLang's are {', '.join(SAMPLING_KEYS)})",
                             f"{where}{key}")
    for key, neutral in _NEUTRAL_NUMBERS.items():
        if optional(p, key, number, neutral, where=where) != neutral:
            raise _unsupported(where + key, p[key], neutral)
    for key, neutral in _NEUTRAL_INTEGERS.items():
        if optional(p, key, integer, neutral, where=where) != neutral:
            raise _unsupported(where + key, p[key], neutral)
    for key in _NEUTRAL_EMPTY:
        if p.get(key) not in (None, "", [], {}):
            raise _unsupported(where + key, p[key], None)
    for key in _IGNORED_BOOLS:
        optional(p, key, boolean, where=where)
    optional(p, "stream_interval", integer, where=where)  # streaming only: nothing to do here

    temperature = optional(p, "temperature", number, 1.0, where=where)
    if temperature < 0:
        raise BadRequest(f"{where}temperature must be a non-negative finite number, got {describe(p['temperature'])}",
                         where + "temperature")
    top_p = optional(p, "top_p", number, 1.0, where=where)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"{where}top_p must be in (0, 1], got {describe(p['top_p'])}", where + "top_p")
    top_k = optional(p, "top_k", integer, -1, where=where)
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"{where}top_k must be -1 (disable) or at least 1, got {top_k}", where + "top_k")
    stop = p.get("stop")
    if stop is not None:
        stop = [string(stop, where + "stop")] if type(stop) is str else strings(stop, where + "stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"{where}stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                             where + "stop")
    stop_ids = optional(p, "stop_token_ids", listed, [], where=where)
    stop_ids = [integer(t, f"{where}stop_token_ids[{i}]") for i, t in enumerate(stop_ids)]
    seed = optional(p, "sampling_seed", integer, where=where)
    greedy = temperature < GREEDY_BELOW
    max_new_tokens = _max_new_tokens(p.get("max_new_tokens", DEFAULT_REQUEST_MAX_NEW_TOKENS), "max_new_tokens" not in p,
                                     where + "max_new_tokens", prompt_tokens, limits)
    return SamplingParams(
        temperature=0.0 if greedy else temperature,
        top_p=top_p,
        top_k=-1 if top_k >= limits.vocab_size else top_k,  # the whole vocabulary
        max_new_tokens=max_new_tokens,
        stop=tuple(stop or ()),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=optional(p, "ignore_eos", boolean, False, where=where),
        skip_special_tokens=optional(p, "skip_special_tokens", boolean, True, where=where),
        sampling_seed=None if greedy else seed,  # greedy takes no seed
    )


def _unsupported(field: str, value, neutral) -> BadRequest:
    return BadRequest(f"{field}={describe(value)} is not supported by the embedded engine "
                      f"(only {json.dumps(neutral)}, which changes nothing)", field)


def _max_new_tokens(value, absent: bool, field: str, prompt_tokens: int, limits: GenerationLimits) -> int:
    """The request's max_new_tokens, refused past the server's cap or the model's context.
    As SGLang: null is the rest of the context, within the cap; absent, the default 128 cut
    to the rest of the context (tokenizer_manager.py checks only a given value, the
    scheduler cuts the default)."""
    context, cap = limits.context_length, limits.max_new_tokens_cap
    if context is not None and prompt_tokens >= context:
        raise BadRequest(f"the prompt ({prompt_tokens} tokens) is as long as the model's context of {context} "
                         "tokens or longer", "input_ids")
    room = [n for n in (cap, None if context is None else context - prompt_tokens) if n is not None]
    if value is None:
        return min(room) if room else DEFAULT_REQUEST_MAX_NEW_TOKENS
    if absent:
        return min([value, *room])
    if type(value) is not int or value < 0:
        shown = value if type(value) is int else describe(value)
        raise BadRequest(f"max_new_tokens={shown} must be an integer >= 0", field)
    if cap is not None and value > cap:
        raise BadRequest(f"max_new_tokens={value} is over this server's limit of {cap}", field)
    if context is not None and prompt_tokens + value > context:
        raise BadRequest(f"the prompt ({prompt_tokens} tokens) plus max_new_tokens={value} exceed the model's "
                         f"context of {context} tokens", field)
    return value


def _prompt(ids, field: str, vocab_size: int) -> list[int]:
    """One prompt's token ids: a non-empty list of integers within the vocabulary."""
    if type(ids) is not list or not ids:
        raise BadRequest(f"input_ids must be a non-empty list of token ids, got {describe(ids)}", field)
    if not all(type(t) is int for t in ids):
        bad = next(t for t in ids if type(t) is not int)
        raise BadRequest(f"input_ids must be integers (token ids), got {describe(bad)}", field)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise BadRequest(f"input_ids out of range [0, {vocab_size}): {lo if lo < 0 else hi}", field)
    return ids


def _per_prompt(value, field: str, n: int) -> list:
    """A field given once for all prompts or as a list with one entry per prompt."""
    if type(value) is not list:
        return [value] * n
    if len(value) != n:
        raise BadRequest(f"{field} has {len(value)} entries for {n} prompt(s)", field)
    return value


def parse_generate(body: dict, limits: GenerationLimits, prompt_tokens: list[int] | None = None) -> GenerateRequest:
    """SGLang's /generate body (token ids in; see the module docstring). `prompt_tokens`:
    each prompt's length with its images expanded (default: its ids'), which its
    max_new_tokens must fit the context with."""
    for key in ("text", "input_embeds"):
        if body.get(key) is not None:
            raise BadRequest("the embedded engine takes input_ids (no text prompts or embeddings)", key)
    if optional(body, "stream", boolean, False):
        raise BadRequest("stream: true is not supported by the embedded engine (one answer per request)", "stream")
    input_ids = body.get("input_ids")
    if input_ids is None:
        raise BadRequest("the embedded engine takes input_ids (no text prompts)", "input_ids")
    if type(input_ids) is not list:
        raise BadRequest(f"input_ids must be a list of token ids or a list of such lists, got {describe(input_ids)}",
                         "input_ids")
    if not input_ids:
        raise BadRequest("input_ids cannot be empty", "input_ids")
    single = type(input_ids[0]) is not list
    prompts = [input_ids] if single else input_ids
    n = len(prompts)
    name = (lambda i: "input_ids") if n == 1 else (lambda i: f"input_ids[{i}]")
    for i, ids in enumerate(prompts):
        try:
            _prompt(ids, name(i), limits.vocab_size)
        except BadRequest as err:
            raise BadRequest(str(err) if n == 1 else f"prompt {i}: {err}", err.field) from None
    rids = _rids(body.get("rid"), n, single)
    params = body.get("sampling_params")
    params_field = "sampling_params" if type(params) is not list else None
    params = _per_prompt({} if params is None else params, "sampling_params", n)
    sampling = []
    lengths = prompt_tokens or [len(ids) for ids in prompts]
    for i, (length, p) in enumerate(zip(lengths, params)):
        field = params_field or f"sampling_params[{i}]"
        try:
            sampling.append(parse_sampling_params(p, field, prompt_tokens=length, limits=limits))
        except BadRequest as err:
            raise BadRequest(str(err) if n == 1 else f"prompt {i}: {err}", err.field) from None
    logprob = _per_prompt(body.get("return_logprob"), "return_logprob", n)
    logprob = [optional({"return_logprob": v}, "return_logprob", boolean, False) for v in logprob]
    routed = optional(body, "return_routed_experts", boolean, False)  # one for the call, as SGLang's
    adapters = _per_prompt(body.get("lora_path"), "lora_path", n)
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            string(adapter, "lora_path" if n == 1 else f"lora_path[{i}]", non_empty=True)
    return GenerateRequest(prompts, sampling, rids, single, logprob, body.get("image_data"), routed,
                           adapters if any(a is not None for a in adapters) else None)


def _rids(rid, n: int, single: bool) -> list[str]:
    """SGLang's rids: none (fresh ones), one string (a batch: its prefix, "{rid}_{i}"), or
    one unique string per prompt."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if type(rid) is str:
        return [rid] if single else [f"{rid}_{i}" for i in range(n)]
    rids = strings(rid, "rid")
    if len(rids) != n:
        raise BadRequest(f"rid has {len(rids)} entries for {n} prompt(s)", "rid")
    if len(set(rids)) != n:
        raise BadRequest("rid has duplicate request ids", "rid")
    return rids


# -- the weight-update group ---------------------------------------------------------------------

@dataclass(frozen=True)
class InitGroupRequest:
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    group_name: str
    backend: str
    timeout_s: float


def parse_init_group(body: dict, ranks: int) -> InitGroupRequest:
    """SGLang's InitWeightsUpdateGroupReqInput; this engine joins at ranks rank_offset ..
    rank_offset + ranks - 1, which must fit in world_size (rank 0 is the sender)."""
    address = required(body, "master_address", lambda v, f: string(v, f, non_empty=True, path=True))
    port = required(body, "master_port", lambda v, f: integer(v, f, lo=1, hi=65535))
    rank_offset = optional(body, "rank_offset", lambda v, f: integer(v, f, lo=1, hi=2**31 - 1), 1)
    world_size = required(body, "world_size", lambda v, f: integer(v, f, lo=2, hi=2**31 - 1))
    if rank_offset + ranks > world_size:
        raise BadRequest(f"this engine has {ranks} rank{'s' if ranks != 1 else ''}: rank_offset={rank_offset} and "
                         f"world_size={world_size} leave no room for group ranks {rank_offset}.."
                         f"{rank_offset + ranks - 1} (count the engine's tp_size from /get_server_info)", "world_size")
    group_name = parse_group_name(body)
    backend = optional(body, "backend", lambda v, f: one_of(v, f, GROUP_BACKENDS), "nccl")
    timeout_s = optional(body, "timeout_s", number, 300.0)
    if not 0 < timeout_s <= MAX_GROUP_TIMEOUT_S:
        raise BadRequest(f"timeout_s must be in (0, {MAX_GROUP_TIMEOUT_S:g}], got {timeout_s}", "timeout_s")
    return InitGroupRequest(address, port, world_size, rank_offset, group_name, backend, timeout_s)


def parse_group_name(body: dict) -> str:
    return optional(body, "group_name", lambda v, f: string(v, f, non_empty=True), DEFAULT_GROUP)


def parse_selector(body: dict) -> str:
    return optional(body, "selector", lambda v, f: one_of(v, f, SELECTORS), "all")


def _update_options(body: dict) -> str | None:
    """The fields every weight update shares: flush_cache and abort_all_requests (no cache
    to flush, nothing to abort here: checked, then unused), the selector; the weight
    version it sets (None: unchanged)."""
    for key in ("flush_cache", "abort_all_requests", "torch_empty_cache"):
        optional(body, key, boolean)
    parse_selector(body)
    return optional(body, "weight_version", string)


@dataclass(frozen=True)
class DistributedUpdateRequest:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    load_format: str | None
    weight_version: str | None


def parse_distributed_update(body: dict) -> DistributedUpdateRequest:
    """SGLang's UpdateWeightsFromDistributedReqInput: names, dtypes and shapes of one
    bucket, one entry each per tensor."""
    names = required(body, "names", lambda v, f: strings(v, f, non_empty_items=True))
    dtypes = required(body, "dtypes", strings)
    for i, name in enumerate(dtypes):
        try:
            dtype = dtype_from_name(name)
        except ValueError:
            dtype = None
        if dtype not in WIRE_DTYPES:
            raise BadRequest(f"dtypes[{i}]={describe(name)} is not one of the dtypes weights are sent in "
                             f"({', '.join(str(d).removeprefix('torch.') for d in WIRE_DTYPES)})", f"dtypes[{i}]")
    shapes = required(body, "shapes", listed)
    shapes = [[integer(d, f"shapes[{i}][{j}]", lo=0) for j, d in enumerate(listed(s, f"shapes[{i}]"))]
              for i, s in enumerate(shapes)]
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})",
                         "shapes")
    return DistributedUpdateRequest(
        names, dtypes, shapes, parse_group_name(body),
        optional(body, "load_format", lambda v, f: one_of(v, f, LOAD_FORMATS_DISTRIBUTED)), _update_options(body))


@dataclass(frozen=True)
class TensorUpdateRequest:
    serialized_named_tensors: list[str]
    load_format: str | None
    weight_version: str | None


def parse_tensor_update(body: dict) -> TensorUpdateRequest:
    """SGLang's UpdateWeightsFromTensorReqInput (rollout/weight_tensors.py): one non-empty
    base64 string per engine rank."""
    serialized = required(body, "serialized_named_tensors", lambda v, f: strings(v, f, non_empty_items=True))
    if not serialized:
        raise BadRequest("serialized_named_tensors is empty (one entry per engine rank)", "serialized_named_tensors")
    return TensorUpdateRequest(serialized, optional(body, "load_format", lambda v, f: one_of(v, f, LOAD_FORMATS_TENSOR)),
                               _update_options(body))


@dataclass(frozen=True)
class DiskUpdateRequest:
    model_path: str
    weight_version: str | None


def parse_disk_update(body: dict) -> DiskUpdateRequest:
    """SGLang's UpdateWeightFromDiskReqInput: a directory path (no NUL byte); load_format
    null or "auto" (the checkpoint's own format)."""
    optional(body, "load_format", lambda v, f: one_of(v, f, (None, "auto")))
    return DiskUpdateRequest(required(body, "model_path", lambda v, f: string(v, f, non_empty=True, path=True)),
                             _update_options(body))


# -- LoRA adapters (rollout/engine_lora.py) ---------------------------------------------------

@dataclass(frozen=True)
class AdapterRequest:
    lora_name: str
    lora_path: str | None = None  # /load_lora_adapter: a PEFT adapter directory
    config_dict: dict | None = None  # /load_lora_adapter_from_tensors: its adapter_config.json
    serialized_named_tensors: list[str] | None = None
    load_format: str | None = None


def parse_load_adapter(body: dict) -> AdapterRequest:
    """SGLang's LoadLoRAAdapterReqInput: lora_name and lora_path (`pinned` ignored)."""
    optional(body, "pinned", boolean)
    return AdapterRequest(_lora_name(body), required(body, "lora_path",
                                                     lambda v, f: string(v, f, non_empty=True, path=True)))


def parse_load_adapter_from_tensors(body: dict) -> AdapterRequest:
    """SGLang's LoadLoRAAdapterFromTensorsReqInput: lora_name, config_dict (an object),
    serialized_named_tensors (one base64 entry per engine rank), load_format."""
    optional(body, "pinned", boolean)
    config = required(body, "config_dict", json_object)
    serialized = required(body, "serialized_named_tensors", strings)
    if not serialized:
        raise BadRequest("serialized_named_tensors is empty (one entry per engine rank)", "serialized_named_tensors")
    load_format = optional(body, "load_format", lambda v, f: one_of(v, f, LOAD_FORMATS_TENSOR))
    return AdapterRequest(_lora_name(body), None, config, serialized, load_format)


def parse_unload_adapter(body: dict) -> AdapterRequest:
    """SGLang's UnloadLoRAAdapterReqInput: lora_name."""
    return AdapterRequest(_lora_name(body))


def _lora_name(body: dict) -> str:
    return required(body, "lora_name", lambda v, f: string(v, f, non_empty=True))


# -- the others --------------------------------------------------------------------------------

def parse_memory_tags(body: dict) -> list[str] | None:
    """SGLang's Release/ResumeMemoryOccupationReqInput: tags, a list of strings or null
    (all); which tags exist is the engine's check (engine_memory.memory_tags)."""
    return optional(body, "tags", strings)


def parse_weights_checksum(body: dict) -> tuple[list[str], bool]:
    """/weights_checksum (not in SGLang): names, a list of HF names; per_rank, a bool."""
    return required(body, "names", strings), optional(body, "per_rank", boolean, False)


def parse_weight_version(body: dict) -> str:
    """SGLang's UpdateWeightVersionReqInput: new_version, a string."""
    optional(body, "abort_all_requests", boolean)
    return required(body, "new_version", string)


def parse_pause(body: dict) -> str:
    """SGLang's PauseGenerationReqInput: mode abort (default), retract or in_place."""
    return optional(body, "mode", lambda v, f: one_of(v, f, PAUSE_MODES), "abort")


def parse_continue(body: dict) -> None:
    """SGLang's ContinueGenerationReqInput: torch_empty_cache, a bool (nothing to empty here)."""
    optional(body, "torch_empty_cache", boolean)


def parse_flush_cache(body: dict) -> None:
    """SGLang's FlushCacheReqInput: timeout_s, a number >= 0 (no cache is kept here)."""
    timeout = optional(body, "timeout_s", number)
    if timeout is not None and timeout < 0:
        raise BadRequest(f"timeout_s must be >= 0, got {timeout}", "timeout_s")
