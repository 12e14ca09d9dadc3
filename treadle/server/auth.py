"""API keys, checked the same way by both frontends: `authorization: Bearer <key>`, the scheme
in any case (RFC 9110), the key compared in constant time against every configured key.

A key has a name, the tenant of every request that carries it: `--api-key-file` lines are `KEY`,
`NAME:KEY` or `NAME:KEY:WEIGHT` (the tenant's weight under the fair policy); a key without a
name is called `key-N`, N its 1-based place among all keys. A key reads only its own tenant's
request records (explain, timelines, the dashboard's rows); the keys named `admin` read every
tenant's.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Iterable, Sequence

from treadle.config import APIKey
from treadle.frontend.admission import check_tenant_name

ADMIN_KEY_NAME = "admin"  # keys of this name read every tenant's request records


def parse_key_line(line: str, number: int) -> APIKey:
    """One `KEY`, `NAME:KEY` or `NAME:KEY:WEIGHT`; `number` names a bare key (key-N)."""
    parts = line.split(":")
    if len(parts) == 1:
        return APIKey(f"key-{number}", line)
    if len(parts) > 3:
        raise ValueError(f"API key line {number}: expected KEY, NAME:KEY or NAME:KEY:WEIGHT")
    name, key = parts[0].strip(), parts[1].strip()
    check_tenant_name(name, f"API key line {number}: the name")
    if not key:
        raise ValueError(f"API key line {number}: the key is empty")
    weight = None
    if len(parts) == 3:
        try:
            weight = float(parts[2])
        except ValueError:
            raise ValueError(f"API key line {number}: weight {parts[2]!r} is not a number") \
                from None
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"API key line {number}: weight must be > 0, got {parts[2]!r}")
    return APIKey(name, key, weight)


def parse_api_keys(bare: Iterable[str], lines: Iterable[str] = ()) -> list[APIKey]:
    """`--api-key` values (bare keys) then key-file lines (blank lines and `#` comments
    skipped). ValueError for a malformed line or two weights for one name."""
    keys = [APIKey(f"key-{i + 1}", key) for i, key in enumerate(bare)]
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(parse_key_line(line, len(keys) + 1))
    weights: dict[str, float] = {}
    for key in keys:
        if key.weight is not None and weights.setdefault(key.name, key.weight) != key.weight:
            raise ValueError(f"API keys named {key.name!r} give different weights")
    return keys


def records_scope(key_name: str | None) -> str | None:
    """The tenant whose request records a caller may read: its key's; None (every tenant's) for
    an admin key, or when the server has no keys (then tenants are unauthenticated names)."""
    return None if key_name is None or key_name == ADMIN_KEY_NAME else key_name


def key_weights(keys: Iterable[APIKey]) -> dict[str, float]:
    return {key.name: key.weight for key in keys if key.weight is not None}


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None for any other header."""
    scheme, _, token = (header or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class APIKeys:
    def __init__(self, keys: Sequence[str | APIKey]) -> None:
        """Bare strings are named key-N in order."""
        named = [k if isinstance(k, APIKey) else APIKey(f"key-{i + 1}", k)
                 for i, k in enumerate(keys)]
        self.names = [k.name for k in named]
        self.keys = [k.key.encode() for k in named]

    def match(self, header: str | None) -> str | None:
        """The name of the key the Authorization header carries, or None. Header values arrive
        as latin-1 text (how Starlette decodes them; gRPC metadata is ASCII), so their bytes are
        what the client sent."""
        token = bearer_token(header)
        try:
            presented = (token or "").encode("latin-1")
        except UnicodeEncodeError:
            presented = b""
        # Compare against every key, so the time taken tells nothing about which one is near.
        matches = [hmac.compare_digest(presented, key) for key in self.keys]
        if token is None:
            return None
        return next((name for name, hit in zip(self.names, matches, strict=True) if hit), None)

    def authorized(self, header: str | None) -> bool:
        """Whether the Authorization header carries one of the keys."""
        return self.match(header) is not None
