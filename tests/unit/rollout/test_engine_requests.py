"""The embedded engine's request schemas (rollout/engine_requests.py) against SGLang
0.5.23's own judgement: its /generate JSON contract (`sglang/api/v1/api_types.py`) and its
`SamplingParams` (`__post_init__`, `normalize`, `verify`), run in SGLang's venv on the same
requests. What SGLang accepts, the engine accepts; what it refuses, the engine refuses,
but for the differences the module names (each checked here to be what SGLang does)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from rollout.embedded_engine import BadRequest, SamplingParams
from rollout.engine_launch import sglang_cpu_python
from rollout.engine_requests import (
    GenerationLimits,
    parse_distributed_update,
    parse_generate,
    parse_init_group,
    parse_sampling_params,
)
from rollout.json_fields import parse_json_object

VOCAB = 1000
LIMITS = GenerationLimits(vocab_size=VOCAB, context_length=512, max_new_tokens_cap=None)
NAN, INF = math.nan, math.inf

# (sampling_params, the field our refusal names; None: accepted)
SAMPLING_CASES = [
    ({}, None), ({"temperature": 0}, None), ({"temperature": 1e-40}, None), ({"temperature": None}, None),
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 5}, None), ({"top_p": 1}, None), ({"top_k": -1}, None),
    ({"top_k": 2**40}, None), ({"max_new_tokens": 0}, None), ({"max_new_tokens": None}, None),
    ({"sampling_seed": -1}, None), ({"sampling_seed": 2**63 - 1}, None), ({"sampling_seed": -(2**63)}, None),
    ({"stop": "x"}, None), ({"stop": ["a"] * 32}, None), ({"stop": None}, None), ({"stop_token_ids": [1, 2]}, None),
    ({"stop_token_ids": [-1]}, None), ({"ignore_eos": True, "skip_special_tokens": False}, None),
    ({"n": 1, "min_p": 0.0, "repetition_penalty": 1.0, "json_schema": ""}, None),
    ({"no_stop_trim": True, "spaces_between_special_tokens": False}, None),
    ({"temperature": -0.5}, "temperature"), ({"temperature": NAN}, "temperature"), ({"temperature": INF}, "temperature"),
    ({"temperature": "0.5"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": -1}, "top_p"), ({"top_p": 2}, "top_p"), ({"top_p": NAN}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"top_k": -5}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"top_k": "5"}, "top_k"),
    ({"top_k": True}, "top_k"), ({"top_k": INF}, "top_k"),
    ({"max_new_tokens": "5"}, "max_new_tokens"), ({"max_new_tokens": 3.7}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": INF}, "max_new_tokens"),
    ({"sampling_seed": 2**63}, "sampling_seed"), ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"sampling_seed": 1.5}, "sampling_seed"), ({"sampling_seed": "1"}, "sampling_seed"),
    ({"sampling_seed": INF}, "sampling_seed"),
    ({"stop": [1]}, "stop[0]"), ({"stop": ["a"] * 33}, "stop"), ({"stop": 5}, "stop"),
    ({"stop_token_ids": [INF]}, "stop_token_ids[0]"), ({"stop_token_ids": ["1"]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"foo": 1}, "foo"), ({"min_p": 2.0}, "min_p"),
]
# Accepted by SGLang, refused here on purpose (engine_requests' docstring says why).
DELIBERATE = [
    ({"n": 2}, "n"), ({"min_p": 0.5}, "min_p"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"regex": "a+"}, "regex"), ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"stop_regex": "a"}, "stop_regex"),
    ({"top_k": 10**20}, "top_k"),  # the contract says i64; SGLang's decoder does not check, its int32 tensor fails
]

# (a /generate body's fields besides input_ids and sampling_params, or a whole body; field refused)
BODY_CASES = [
    ({"input_ids": [1, 2]}, None), ({"input_ids": [[1, 2], [3]]}, None), ({"input_ids": [1], "rid": "r"}, None),
    ({"input_ids": [[1], [2]], "rid": ["a", "b"], "return_logprob": [True, False]}, None),
    ({"input_ids": [1], "logprob_start_len": -1, "unknown_key": {"x": NAN}}, None),
    ({"input_ids": 5}, "input_ids"), ({"input_ids": True}, "input_ids"), ({"input_ids": 1.5}, "input_ids"),
    ({"input_ids": [1.5, 2]}, "input_ids"), ({"input_ids": [1, [2]]}, "input_ids"), ({"input_ids": ["1"]}, "input_ids"),
    ({"input_ids": [1], "rid": 5}, "rid"), ({"input_ids": [[1], [2]], "rid": ["a", 1]}, "rid[1]"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"), ({"input_ids": [1], "stream": "no"}, "stream"),
    ({"input_ids": [1], "sampling_params": 5}, "sampling_params"),
    ({"input_ids": [1], "sampling_params": [5]}, "sampling_params[0]"),
]
DELIBERATE_BODIES = [({"input_ids": [1], "stream": True}, "stream"), ({"text": "hello"}, "text")]

# SGLang's judgement, in its venv: its generated contract module and its SamplingParams,
# loaded by file path (the package's __init__ would import the whole server).
_SGLANG_JUDGE = r"""
import importlib.util, json, sys, sysconfig, types
root = sysconfig.get_paths()["purelib"] + "/sglang"
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
contract = load("sglang_api_types", root + "/api/v1/api_types.py")
for name in ("sglang", "sglang.srt", "sglang.srt.sampling", "sglang.srt.sampling.watermarking"):
    sys.modules[name] = types.ModuleType(name)
core = types.ModuleType("sglang.srt.sampling.watermarking.core")
core.WatermarkRequestConfig = type("WatermarkRequestConfig", (), {})
core.normalize_watermark_request = lambda w: w
sys.modules[core.__name__] = core
srt = load("sglang_sampling_params", root + "/srt/sampling/sampling_params.py")
class Tokenizer:  # normalize() measures stop strings with one
    def encode(self, text, add_special_tokens=False):
        return list(text.encode())
def accepts(kind, value):
    try:
        if kind == "body":
            contract.decode_GenerateRequest(value)
            return True
        contract.decode_SamplingParams(value)
        params = srt.SamplingParams(**value)
        params.normalize(Tokenizer())
        params.verify(int(sys.argv[1]))
        return True
    except Exception:
        return False
print(json.dumps([accepts(kind, value) for kind, value in json.loads(sys.stdin.read())]))
"""


@pytest.fixture(scope="module")
def sglang_accepts():
    python = sglang_cpu_python()
    if python is None:
        # the real SGLang is part of the test set-up (docs/testing.md), never skipped
        pytest.fail("no SGLang venv: run `make .venv-sglang/.installed` (make test installs it) or set "
                    "MEGATRON_AGENT_SGLANG_PYTHON to a Python with sglang installed")
    cases = [("sampling", p) for p, _ in SAMPLING_CASES + DELIBERATE] + \
            [("body", b) for b, _ in BODY_CASES + DELIBERATE_BODIES]
    out = subprocess.run([python, "-c", _SGLANG_JUDGE, str(VOCAB)], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(zip((json.dumps(c) for c in cases), json.loads(out.stdout)))


def refused_field(parse) -> str | None:
    """The field a parser's BadRequest names, None when it accepts."""
    try:
        parse()
    except BadRequest as err:
        return err.field or "?"
    return None


def ours_sampling(p) -> str | None:
    field = refused_field(lambda: parse_sampling_params(p, "sampling_params", prompt_tokens=3, limits=LIMITS))
    return field if field is None else field.removeprefix("sampling_params.")


def ours_body(body) -> str | None:
    return refused_field(lambda: parse_generate(body, LIMITS))


@pytest.mark.parametrize("params,field", SAMPLING_CASES, ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_sampling_params_judged_as_sglang_judges_them(params, field, sglang_accepts):
    assert sglang_accepts[json.dumps(["sampling", params])] == (field is None), "SGLang's verdict"
    assert ours_sampling(params) == field


@pytest.mark.parametrize("body,field", BODY_CASES)
def test_generate_bodies_judged_as_sglang_s_contract_judges_them(body, field, sglang_accepts):
    assert sglang_accepts[json.dumps(["body", body])] == (field is None), "SGLang's verdict"
    assert ours_body(body) == field


def test_the_deliberate_differences_are_what_sglang_does(sglang_accepts):
    for params, field in DELIBERATE:
        assert sglang_accepts[json.dumps(["sampling", params])], params
        assert ours_sampling(params) == field, params
    for body, field in DELIBERATE_BODIES:
        assert sglang_accepts[json.dumps(["body", body])], body
        assert ours_body(body) == field, body


def parsed(p, prompt_tokens=3, limits=LIMITS) -> SamplingParams:
    return parse_sampling_params(p, "sampling_params", prompt_tokens=prompt_tokens, limits=limits)


def test_sglang_s_meanings():
    # sampling_params.py __post_init__: 0 <= temperature < 1e-6 is greedy (top_k 1); greedy takes no seed
    assert parsed({"temperature": 1e-40, "sampling_seed": 5}) == SamplingParams(temperature=0.0, max_new_tokens=128)
    assert parsed({"temperature": 1e-6}).temperature == 1e-6
    # null is the default (SGLang's defaults: temperature 1, top_p 1, all of the vocabulary, 128 tokens)
    assert parsed({"temperature": None, "top_p": None, "top_k": None, "max_new_tokens": 128}) == SamplingParams()
    assert parsed({"top_k": VOCAB}).top_k == parsed({"top_k": 2**40}).top_k == -1
    assert parsed({"top_k": VOCAB - 1}).top_k == VOCAB - 1
    assert parsed({"sampling_seed": -1, "stop": "x"}).sampling_seed == -1
    assert parsed({"stop": "x"}).stop == ("x",)
    # scheduler.py init_req_max_new_tokens: null max_new_tokens is the rest of the context, here within the cap
    assert parsed({"max_new_tokens": None}, prompt_tokens=500).max_new_tokens == 12
    capped = GenerationLimits(vocab_size=VOCAB, context_length=512, max_new_tokens_cap=64)
    assert parsed({}, prompt_tokens=500, limits=capped).max_new_tokens == 128 - 116 == 12
    assert parsed({"max_new_tokens": None}, limits=capped).max_new_tokens == 64
    # io_struct.py _normalize_rid: a batch's one string is the prefix of every request's id
    req = parse_generate({"input_ids": [[1], [2], [3]], "rid": "r"}, LIMITS)
    assert req.rids == ["r_0", "r_1", "r_2"] and not req.single and req.return_logprob == [False] * 3
    assert parse_generate({"input_ids": [7, 8], "rid": "r"}, LIMITS).rids == ["r"]
    assert len(set(parse_generate({"input_ids": [[1], [2]]}, LIMITS).rids)) == 2


def test_refusals_name_the_field_and_the_prompt():
    cases = [
        ({"input_ids": []}, "input_ids", "input_ids cannot be empty"),  # io_struct.py's words
        ({"input_ids": [[1], []]}, "input_ids[1]", "prompt 1: input_ids must be a non-empty list"),
        ({"input_ids": [[1], [VOCAB]]}, "input_ids[1]", f"prompt 1: input_ids out of range [0, {VOCAB}): {VOCAB}"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid", "duplicate"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid", "1 entries for 2 prompt(s)"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"top_k": 0}]}, "sampling_params[1].top_k",
         "prompt 1: sampling_params[1].top_k must be -1 (disable) or at least 1, got 0"),
        ({"input_ids": [[1], [2]], "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "prompt 0:"),
        ({"input_ids": [1] * 512}, "input_ids", "as long as the model's context of 512"),  # tokenizer_manager.py
        ({"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 13}}, "sampling_params.max_new_tokens",
         "plus max_new_tokens=13 exceed the model's context of 512 tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": NAN}}, "sampling_params.temperature",
         "must be a finite number, got number nan"),
    ]
    for body, field, words in cases:
        with pytest.raises(BadRequest) as err:
            parse_generate(body, LIMITS)
        assert err.value.field == field and words in str(err.value), (body, err.value, err.value.field)


def test_control_schemas():
    ok = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 3}
    assert parse_init_group(ok, ranks=2).rank_offset == 1
    for body, field in [({**ok, "master_port": "abc"}, "master_port"), ({**ok, "master_port": 70000}, "master_port"),
                        ({**ok, "world_size": 2}, "world_size"), ({**ok, "timeout_s": INF}, "timeout_s"),
                        ({**ok, "backend": "mpi"}, "backend"), ({**ok, "master_address": ""}, "master_address"),
                        ({"master_port": 1, "world_size": 2}, "master_address")]:
        assert refused_field(lambda body=body: parse_init_group(body, ranks=2)) == field, body
    update = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]}
    assert parse_distributed_update(update).shapes == [[2, 3]]
    for change, field in [({"names": "w"}, "names"), ({"shapes": [[2, -3]]}, "shapes[0][1]"),
                          ({"shapes": [2]}, "shapes[0]"), ({"dtypes": ["Size"]}, "dtypes[0]"),
                          ({"dtypes": ["complex64"]}, "dtypes[0]"), ({"names": ["w", "v"]}, "shapes"),
                          ({"load_format": "zip"}, "load_format"), ({"weight_version": 5}, "weight_version")]:
        assert refused_field(lambda change=change: parse_distributed_update({**update, **change})) == field, change


def test_bodies_that_are_no_json_object_are_refused():
    assert parse_json_object(b'{"t": NaN}')["t"] != 0  # NaN parses: the fields refuse it
    for raw, words in [(b"[" * 50_000, "nested too deeply"), (b'{"a": ' + b"1" * 5000 + b"}", "not JSON"),
                       (b"\xff\xfe", "not JSON"), (b"{", "not JSON"), (b"[1]", "JSON object")]:
        with pytest.raises(BadRequest, match=words):
            parse_json_object(raw)
