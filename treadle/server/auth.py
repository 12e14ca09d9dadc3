"""API keys, checked the same way by both frontends: `authorization: Bearer <key>`, the scheme
in any case (RFC 9110), the key compared in constant time against every configured key.

A key has a name, the tenant of every request that carries it. `--api-key-file` lines are

    KEY
    NAME:KEY
    NAME:KEY:WEIGHT
    NAME:KEY:[WEIGHT]:ADAPTER[,ADAPTER...]

WEIGHT is the tenant's weight under the fair policy (empty when only adapters are given:
`acme:sk-1::acme-sql,acme-chat`); a key without a name is called `key-N`, N its 1-based place
among all keys. A key with ADAPTERs is bound to those LoRA adapters: it may use them and the
base model, and any other adapter is, to it, a model that does not exist (REST 404
`model_not_found`, gRPC NOT_FOUND; /v1/models lists only what it may use); it may not load or
unload adapters (403), so that it can neither drop another tenant's adapter nor read the
server's files. The names need not be served yet: an unbound key may load them later. A key
without ADAPTERs may use, load and unload every adapter (as every key could before bindings).

A key reads only its own tenant's request records (explain, timelines, the dashboard's rows);
the keys named `admin` read every tenant's.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Iterable, Sequence

from treadle.config import APIKey
from treadle.core.lora_request import MAX_LORA_NAME_CHARS
from treadle.frontend.admission import check_tenant_name

ADMIN_KEY_NAME = "admin"  # keys of this name read every tenant's request records


def parse_key_line(line: str, number: int) -> APIKey:
    """One `KEY`, `NAME:KEY`, `NAME:KEY:WEIGHT` or `NAME:KEY:[WEIGHT]:ADAPTERS`; `number` names
    a bare key (key-N) and the line in errors."""
    parts = line.split(":")
    if len(parts) == 1:
        return APIKey(f"key-{number}", line)
    if len(parts) > 4:
        raise ValueError(f"API key line {number}: expected KEY, NAME:KEY, NAME:KEY:WEIGHT or "
                         "NAME:KEY:[WEIGHT]:ADAPTER[,ADAPTER...]")
    name, key = parts[0].strip(), parts[1].strip()
    check_tenant_name(name, f"API key line {number}: the name")
    if not key:
        raise ValueError(f"API key line {number}: the key is empty")
    # The weight may be left empty only where adapters follow it.
    weight = parse_weight(parts[2], number, required=len(parts) == 3) if len(parts) >= 3 \
        else None
    adapters = parse_adapters(parts[3], number) if len(parts) == 4 else None
    return APIKey(name, key, weight, adapters)


def parse_weight(text: str, number: int, required: bool = False) -> float | None:
    """A key line's WEIGHT: > 0 and finite; an empty one is None unless `required`."""
    if not text.strip() and not required:
        return None
    try:
        weight = float(text)
    except ValueError:
        raise ValueError(f"API key line {number}: weight {text!r} is not a number") from None
    if not (weight > 0 and math.isfinite(weight)):
        raise ValueError(f"API key line {number}: weight must be > 0, got {text!r}")
    return weight


def parse_adapters(text: str, number: int) -> tuple[str, ...]:
    """A key line's ADAPTER[,ADAPTER...]: at least one, each named once, each a name an
    adapter can have (1 to MAX_LORA_NAME_CHARS printable characters, spaces around it
    dropped)."""
    names = tuple(name.strip() for name in text.split(","))
    if names == ("",):  # an empty list would read as "every adapter" to some, "none" to others
        raise ValueError(f"API key line {number}: name at least one adapter after the third "
                         "':', or leave the field out for a key that may use every adapter")
    for name in names:
        if not name or len(name) > MAX_LORA_NAME_CHARS or not name.isprintable():
            raise ValueError(f"API key line {number}: adapter names must be 1 to "
                             f"{MAX_LORA_NAME_CHARS} printable characters, separated by ',', "
                             f"got {name[:80]!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"API key line {number}: an adapter is named twice in {text.strip()!r}")
    return names


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


def may_use_adapter(key: APIKey | None, adapter: str) -> bool:
    """Whether a caller may use (or see) an adapter: every caller may unless its key is bound
    to adapters (`key` None: the server has no keys)."""
    return key is None or key.adapters is None or adapter in key.adapters


def may_manage_adapters(key: APIKey | None) -> bool:
    """Whether a caller may load and unload adapters: not with a key bound to adapters."""
    return key is None or key.adapters is None


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
        self.records = [k if isinstance(k, APIKey) else APIKey(f"key-{i + 1}", k)
                        for i, k in enumerate(keys)]
        self.keys = [k.key.encode() for k in self.records]

    def find(self, header: str | None) -> APIKey | None:
        """The key the Authorization header carries, or None. Header values arrive as latin-1
        text (how Starlette decodes them; gRPC metadata is ASCII), so their bytes are what the
        client sent."""
        token = bearer_token(header)
        try:
            presented = (token or "").encode("latin-1")
        except UnicodeEncodeError:
            presented = b""
        # Compare against every key, so the time taken tells nothing about which one is near.
        matches = [hmac.compare_digest(presented, key) for key in self.keys]
        if token is None:
            return None
        return next((key for key, hit in zip(self.records, matches, strict=True) if hit), None)

    def match(self, header: str | None) -> str | None:
        """The name of the key the Authorization header carries, or None."""
        key = self.find(header)
        return None if key is None else key.name

    def authorized(self, header: str | None) -> bool:
        """Whether the Authorization header carries one of the keys."""
        return self.find(header) is not None
