"""JSON fields checked one by one: strict types (a boolean is not an integer, "5" is not a
number, 1.5 is not an integer; NaN and +-Infinity, which Python's JSON parser reads, are no
numbers), ranges and lengths, each failure a `BadRequest` naming the field. The embedded
engine's request schemas (rollout/engine_requests.py) are written with these."""

from __future__ import annotations

import json
import math
import reprlib

from rollout.embedded_engine import BadRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_brief = reprlib.Repr()
_brief.maxstring, _brief.maxlong, _brief.maxother, _brief.maxlevel, _brief.maxlist, _brief.maxdict = 40, 30, 40, 1, 3, 3


def describe(value) -> str:
    """A value in an error message: its JSON kind and a short, bounded rendering."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {'true' if value else 'false'}"
    kind = {int: "integer", float: "number", str: "string", list: "list", dict: "object"}.get(type(value))
    return f"{kind or type(value).__name__} {_brief.repr(value)}"


def parse_json_object(raw: bytes) -> dict:
    """A request body -> its JSON object. BadRequest for anything else: not UTF-8, not
    JSON, an integer longer than Python converts (4300 digits), nesting too deep for the
    parser (json.loads raises RecursionError: 50,000 '[' did), or a value that is not an
    object."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("body is nested too deeply to parse") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, the digit limit
        raise BadRequest(f"body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {describe(body)}")
    return body


def integer(value, field: str, *, lo: int | None = INT64_MIN, hi: int | None = INT64_MAX) -> int:
    if type(value) is not int:  # bool is a subclass of int: refused here
        raise BadRequest(f"{field} must be an integer, got {describe(value)}", field)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{field} must be an integer {bounds}, got {describe(value)}", field)
    return value


def number(value, field: str) -> float:
    """A finite JSON number (an integer too), as a float."""
    if type(value) not in (int, float):
        raise BadRequest(f"{field} must be a number, got {describe(value)}", field)
    try:
        out = float(value)
    except OverflowError:  # an integer past float range
        out = math.inf
    if not math.isfinite(out):
        raise BadRequest(f"{field} must be a finite number, got {describe(value)}", field)
    return out


def boolean(value, field: str) -> bool:
    if type(value) is not bool:
        raise BadRequest(f"{field} must be true or false, got {describe(value)}", field)
    return value


def string(value, field: str, *, non_empty: bool = False, path: bool = False) -> str:
    if type(value) is not str:
        raise BadRequest(f"{field} must be a string, got {describe(value)}", field)
    if non_empty and not value:
        raise BadRequest(f"{field} must not be empty", field)
    if path and "\x00" in value:
        raise BadRequest(f"{field} must not contain a NUL byte", field)
    return value


def one_of(value, field: str, choices: tuple) -> object:
    if value not in choices or type(value) not in (str, type(None)):
        raise BadRequest(f"{field} must be one of {', '.join(map(json.dumps, choices))}; got {describe(value)}", field)
    return value


def listed(value, field: str) -> list:
    if type(value) is not list:
        raise BadRequest(f"{field} must be a list, got {describe(value)}", field)
    return value


def json_object(value, field: str) -> dict:
    if type(value) is not dict:
        raise BadRequest(f"{field} must be an object, got {describe(value)}", field)
    return value


def strings(value, field: str, *, non_empty_items: bool = False) -> list[str]:
    return [string(v, f"{field}[{i}]", non_empty=non_empty_items) for i, v in enumerate(listed(value, field))]


def optional(body: dict, key: str, parse, default=None, *, where: str = ""):
    """body[key] parsed, or `default` when it is missing or null."""
    value = body.get(key)
    return default if value is None else parse(value, f"{where}{key}")


def required(body: dict, key: str, parse, *, where: str = ""):
    if body.get(key) is None:
        raise BadRequest(f"missing field {where}{key}", f"{where}{key}")
    return parse(body[key], f"{where}{key}")


