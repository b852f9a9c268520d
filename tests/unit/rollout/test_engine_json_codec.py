"""The engine client's JSON (orjson where it gives the stdlib's value, rollout/engine_client.py):
every body written and read is the stdlib `json`'s value, exactly (types and float bits)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import random
import struct

import numpy as np
import pytest

from rollout import engine_client
from rollout.engine_client import _decode, decode_json, encode_json, token_id_list
from rollout.engine_responses import MalformedAnswer, generate_outputs


def same(a, b) -> bool:
    """Equal with the same types throughout, floats bit for bit (NaN included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def random_doubles(rng: random.Random, n: int) -> list[float]:
    values = [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(n)]
    return [v for v in values if math.isfinite(v)] + [-rng.random() * 20 for _ in range(n)] + [0.0, -0.0, 5e-324]


def answer(rng: random.Random, tokens: int = 350) -> dict:
    ids = [rng.randrange(150_000) for _ in range(tokens)]
    return {"text": "déjà 日本 😀 \\ \" \n", "output_ids": ids,
            "meta_info": {"id": "abc", "finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": 3000,
                          "weight_version": "3", "output_token_logprobs": [[-rng.random() * 5, t, None] for t in ids]}}


@pytest.fixture(params=["orjson", "json alone"])
def codec(request, monkeypatch):
    if request.param == "json alone":
        monkeypatch.setattr(engine_client, "orjson", None)
    elif engine_client.orjson is None:
        pytest.fail("orjson is a dependency (pyproject.toml) but is not installed")
    return request.param


def test_bodies_written_read_back_as_the_stdlib_writes_them(codec):
    rng = random.Random(0)
    bodies = [
        {"input_ids": [[rng.randrange(150_000) for _ in range(3000)], []], "return_logprob": True, "rid": ["r-1", "r-2"],
         "sampling_params": [{"temperature": 0.7, "top_p": 1.0, "top_k": -1, "stop": ["</action>"], "sampling_seed": 2**62 - 1,
                              "skip_special_tokens": False}] * 2, "image_data": [["data:image/png;base64,AAAA"], []]},
        {"names": ["a.weight"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "weight_version": None, "load_format": None},
        {"values": random_doubles(rng, 200), "text": "déjà 日本 😀 \x00 \u2028", "nested": [[[{"k": (1, 2)}]]]},
        {"big": 2**64, "small": -2**63 - 1},  # past 64 bits: orjson refuses, json writes them
        {1: "an int key"},  # json writes "1"; orjson refuses
        {"lone": "\ud800"},  # json escapes it; orjson refuses
    ]
    for body in bodies:
        assert same(json.loads(encode_json(body)), json.loads(json.dumps(body)))


def test_what_the_stdlib_refuses_to_write_is_refused(codec):
    @dataclasses.dataclass
    class Params:
        temperature: float = 1.0

    for body in ({"sampling_params": Params()}, {"at": datetime.datetime(2025, 1, 1)}, {"ids": {1, 2}}):
        with pytest.raises(TypeError):
            json.dumps(body)
        with pytest.raises(TypeError):
            encode_json(body)


def test_non_finite_floats_are_written_as_the_stdlib_writes_them(codec):
    """json writes NaN / Infinity (what a server then makes of them is today's behaviour);
    orjson would write null."""
    for body in ({"sampling_params": {"temperature": math.nan}}, {"v": [1.0, math.inf, None]}, {"v": -math.inf}):
        assert encode_json(body) == json.dumps(body).encode()


def test_answers_read_as_the_stdlib_reads_them(codec):
    rng = random.Random(1)
    floats = random_doubles(rng, 300)
    raws = [json.dumps([answer(rng)]).encode(), json.dumps(floats).encode(),
            json.dumps([repr(f) for f in floats]).encode(),
            b"[18446744073709551615, 18446744073709551616, -9223372036854775808, -9223372036854775809]",
            b'{"output_ids": [123456789012345678901234567890], "v": 1.0000000000000000000000001}',
            b"[1e400, -1e400, 1e-400, 0.1e1, 1E5, -0]", b'{"a": 1, "a": 2}', b'"\\ud800"', b"\xef\xbb\xbf[1]",
            b' {"a" : [1 , 2.5e-3]}\n', b'"\\u00e9\\ud83d\\ude00"', b"[NaN, Infinity, -Infinity]"]
    for raw in raws:
        assert same(decode_json(raw), json.loads(raw)), raw[:60]
    assert type(decode_json(b"[18446744073709551616]")[0]) is int  # orjson alone would read a float


def test_answers_with_long_fractions_are_read_by_orjson(monkeypatch):
    """A logprob near 0 prints as many digits after the point ("-0.00012345678901234567"):
    orjson reads it, as json would; only a long integer makes json read the body."""
    read_by_json, loads = [], json.loads
    near_zero = json.dumps({"output_token_logprobs": [[-0.00012345678901234567, 7, None], [-1.5e-7, 8, None]]})
    expected = loads(near_zero)
    monkeypatch.setattr(engine_client.json, "loads", lambda raw: read_by_json.append(raw) or loads(raw))
    assert decode_json(near_zero.encode()) == expected and not read_by_json
    assert decode_json(b"[-12345678901234567890]") == [-12345678901234567890] and len(read_by_json) == 1


def test_bodies_that_are_not_json_stay_text_as_before(codec):
    for raw in (b"", b"oops", b"{", b"[" * 5000, b"\xff\xfe{}", b'{"a": 1} x', b'"a\tb"', b"9" * 5000):
        if not raw:
            assert _decode(raw) is None
            continue
        try:
            expected = json.loads(raw)
        except (ValueError, RecursionError):
            expected = raw.decode(errors="replace")
        assert same(_decode(raw), expected)


def test_a_non_finite_logprob_is_still_a_malformed_answer(codec):
    """json reads NaN / Infinity; the answer check then refuses them (orjson alone would
    refuse the body, and the client would report a body that is not the protocol's)."""
    for literal, shown in ((b"NaN", "nan"), (b"-Infinity", "-inf"), (b"1e400", "inf")):
        raw = b'[{"text": "x", "output_ids": [1], "meta_info": {"output_token_logprobs": [[' + literal + b", 1, null]]}}]"
        with pytest.raises(MalformedAnswer, match=f"logprob {shown}, not a finite number"):
            generate_outputs(_decode(raw), 1, "u")


def test_token_id_lists_are_what_int_makes_of_them(codec):
    cases = [[5, 0, 151_645], [], [True, 2], [np.int64(7), 3], [1.9, -2.5], ["12"], (4, 5), range(3),
             np.arange(5, dtype=np.int32), np.arange(3, dtype=np.uint64), np.array([1.5, 2.0]), [2**70]]
    for ids in cases:
        got = token_id_list(ids)
        assert same(got, list(map(int, ids))) and all(type(i) is int for i in got)
    mine = [1, 2]
    assert token_id_list(mine) is not mine  # a copy: the caller may change its list
    for bad in ([[1, 2]], ["x"], [None], [math.nan]):
        with pytest.raises((TypeError, ValueError)) as raised:
            token_id_list(bad)
        with pytest.raises(raised.type):
            list(map(int, bad))
