"""What guards an engine (docs/security.md): who may start one where, who may change its
weights, which directories it loads weights from, and how large a request may be.

- `require_token(host, token, what)`: an engine bound to anything but loopback needs a
  token (the embedded engine's `--auth-token`, SGLang's `--api-key`); `InsecureBind`
  otherwise, raised before anything starts.
- `bearer_ok(header, token)`: the `Authorization: Bearer <token>` check, in constant time.
- `may_load_from(path, allowed_dirs)`: a disk load stays inside the directories the
  engine was started with (symlinks resolved).
- `generation_problem(...)`: what is wrong with one prompt and its `max_new_tokens`
  (integer ids within the vocabulary, a length within the server's cap and the model's
  context), or None.
"""

from __future__ import annotations

import hmac
import ipaddress
import numbers
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from rollout.engine_client import TOKEN_ENV

DEFAULT_MAX_BODY_BYTES = 64 * 2**20  # a /generate of 256 prompts x 8k tokens is ~15 MB of JSON
DEFAULT_MAX_NEW_TOKENS = 16384  # the server's cap; the model's context caps it too


class InsecureBind(ValueError):
    """An engine would listen beyond loopback without a token."""


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1); False for
    0.0.0.0, "", any other address or any host name (it may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_token(token: str | None) -> str | None:
    """`token`, or MEGATRON_AGENT_ENGINE_TOKEN when it is None; "" means none."""
    if token is None:
        token = os.environ.get(TOKEN_ENV)
    return token or None


def require_token(host: str, token: str | None, what: str) -> None:
    """Raise `InsecureBind` when `what` would listen on `host` (not loopback) without a token."""
    if not token and not is_loopback(host):
        raise InsecureBind(
            f"{what} bound to {host or 'every address'} needs a token: anyone who reaches the port could "
            f"push weights or load files into it. Set engine.auth_token or {TOKEN_ENV} (slurm/train.sbatch "
            f"creates one per job), or bind to 127.0.0.1 (docs/security.md)")


def bearer_ok(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token`, compared in constant time."""
    expected = f"Bearer {token}".encode("utf-8", "surrogateescape")
    given = (header or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected)


def resolved_dirs(dirs: Iterable[str | os.PathLike]) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(Path(d).expanduser().resolve() for d in dirs))


def may_load_from(path: str | os.PathLike, allowed_dirs: Sequence[Path]) -> bool:
    """Whether `path` (symlinks and `..` resolved) is one of `allowed_dirs` or lies under one."""
    real = Path(path).expanduser().resolve()
    return any(real.is_relative_to(d) for d in allowed_dirs)


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def generation_problem(input_ids, max_new_tokens, *, vocab_size: int, context_length: int | None,
                       max_new_tokens_cap: int | None) -> str | None:
    """What makes one prompt unservable, in words, or None when it is fine."""
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        return "input_ids must be a non-empty list of token ids"
    if not all(_is_token_id(t) for t in input_ids):
        return "input_ids must be integers (token ids)"
    lo, hi = min(input_ids), max(input_ids)
    if lo < 0 or hi >= vocab_size:
        return f"input_ids out of range [0, {vocab_size}): {lo if lo < 0 else hi}"
    if not _is_token_id(max_new_tokens) or max_new_tokens < 0:
        return f"max_new_tokens={max_new_tokens!r} must be an integer >= 0"
    if max_new_tokens_cap is not None and max_new_tokens > max_new_tokens_cap:
        return f"max_new_tokens={max_new_tokens} is over this server's limit of {max_new_tokens_cap}"
    if context_length is not None and len(input_ids) + max_new_tokens > context_length:
        return (f"the prompt ({len(input_ids)} tokens) plus max_new_tokens={max_new_tokens} exceed the "
                f"model's context of {context_length} tokens")
    return None
