"""Admission: what the frontend decides about a request before the engine sees it.

Tenants: each request's tenant (its API key's name, else the client's `user`, else "default";
`resolve_tenant`) goes to the engine (fair share, per-tenant KV caps), the metrics' `tenant`
label, the request log line and the timeline. Names from `user` are client-chosen, so at most
`max_tenants` distinct ones are tracked; later ones all run as the tenant "other".

Limits: the queue's (requests, and prompt tokens, waiting for their first token) and each
tenant's (requests in flight, queued prompt tokens) are checked here, at once, against what this
process has sent and not yet seen answered: the engine's own counts arrive a step late.

Cache isolation: with `isolate_prefix_cache_by_tenant`, a request's cache salt is its tenant
(joined to the client's own salt, if any), so no tenant can probe another's cached prompts
through timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.config import AdmissionConfig
from treadle.core.request import DEFAULT_TENANT
from treadle.errors import InvalidField

OTHER_TENANT = "other"  # the tenant of `user` names past max_tenants
MAX_CACHE_SALT_CHARS = 256
MAX_TENANT_NAME = 64  # characters of a key's name or a `user` field taken as a tenant


def check_tenant_name(name: str, what: str) -> None:
    """InvalidField naming `what` (the field, or the setting, that gave the name) unless `name`
    can be a tenant's."""
    if not name or len(name) > MAX_TENANT_NAME or not name.isprintable() or name != name.strip():
        raise InvalidField(what, f"{what} must be 1 to {MAX_TENANT_NAME} printable characters "
                           f"without surrounding spaces, got {name[:80]!r}")


@dataclass(frozen=True)
class Admitted:
    """Who an admitted request is for and what it asks of the schedule, beside its sampling."""

    tenant: str
    cache_salt: str | None  # the client's; the engine gets `Admission.cache_salt`'s
    ttft: float | None  # objectives, seconds; None: the server's defaults apply
    tpot: float | None


MAX_OBJECTIVE_MS = 86_400_000.0  # a day: objectives past it mean nothing


def objective_seconds(name: str, ms: float | str | None) -> float | None:
    """A TTFT or TPOT objective given in milliseconds (a number, or a header's text), in
    seconds; None when not given."""
    if ms is None:
        return None
    if isinstance(ms, str):
        try:
            ms = float(ms)
        except ValueError:
            raise InvalidField(name, f"{name} must be a number of milliseconds, got "
                               f"{ms[:40]!r}") from None
    if isinstance(ms, bool) or not 0 < ms <= MAX_OBJECTIVE_MS:
        raise InvalidField(name, f"{name} must be > 0 and <= {MAX_OBJECTIVE_MS:.0f} "
                           f"milliseconds, got {ms}")
    return ms / 1e3


class EngineOverloaded(Exception):
    """The request cannot be taken now: the client should retry after `retry_after` seconds.
    `reason` names the limit: queue_full, queued_tokens_full, tenant_requests,
    tenant_queued_tokens, or deadline (its TTFT objective cannot be met)."""

    def __init__(self, message: str, retry_after: int = 1, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class Admission:
    """Tenants and limits over the requests in flight. Not thread-safe: the caller locks."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.tenants: set[str] = set()  # the distinct `user` tenants tracked so far
        self.tenant_in_flight: dict[str, int] = {}
        self.tenant_of: dict[str, str] = {}  # request id -> tenant, per request in flight
        # Requests sent to the engine that have produced no token yet, with their prompt tokens
        # (times n).
        self.queued: dict[str, int] = {}

    def resolve_tenant(self, key_name: str | None, user: str | None) -> str:
        """A request's tenant: its API key's name, else the client's `user` (InvalidField if
        malformed), else "default". At most max_tenants distinct `user` names are tracked;
        past that, new ones are "other"."""
        if key_name:
            return key_name
        if not user:
            return DEFAULT_TENANT
        check_tenant_name(user, "user")
        if user in self.tenants:
            return user
        if len(self.tenants) < self.config.max_tenants:
            self.tenants.add(user)
            return user
        return OTHER_TENANT

    def cache_salt(self, tenant: str, cache_salt: str | None) -> str | None:
        """The salt the engine gets: the client's, or with isolation by tenant, the tenant's
        joined to it (NUL cannot occur in a tenant name, so no two pairs collide)."""
        if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidField("cache_salt", f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} "
                               f"characters")
        cache_salt = cache_salt or None
        if not self.config.isolate_prefix_cache_by_tenant:
            return cache_salt
        return tenant if cache_salt is None else f"{tenant}\x00{cache_salt}"

    def objectives(self, ttft: float | None, tpot: float | None
                   ) -> tuple[float | None, float | None]:
        """A request's TTFT and TPOT objectives in seconds: its own, else the defaults."""
        config = self.config
        if ttft is None and config.default_ttft_ms is not None:
            ttft = config.default_ttft_ms / 1e3
        if tpot is None and config.default_tpot_ms is not None:
            tpot = config.default_tpot_ms / 1e3
        return ttft, tpot

    def check_capacity(self, num_prompt_tokens: int = 0, tenant: str = DEFAULT_TENANT) -> None:
        """EngineOverloaded if a request of that many prompt tokens would overfill the queue, or
        pass its tenant's limits."""
        config, queued = self.config, self.queued
        if config.max_queued_requests is not None and len(queued) >= config.max_queued_requests:
            raise EngineOverloaded(f"the server has {len(queued)} requests queued, its limit; "
                                   f"retry later", reason="queue_full")
        queued_tokens = sum(queued.values())
        # A prompt larger than the limit alone still goes when nothing is queued: it would
        # otherwise never go.
        limit = config.max_queued_tokens
        if limit is not None and queued_tokens and queued_tokens + num_prompt_tokens > limit:
            raise EngineOverloaded(f"the server has {queued_tokens} prompt tokens queued; "
                                   f"{num_prompt_tokens} more exceed its limit of {limit}; "
                                   f"retry later", reason="queued_tokens_full")
        limit = config.max_requests_per_tenant
        in_flight = self.tenant_in_flight.get(tenant, 0)
        if limit is not None and in_flight >= limit:
            raise EngineOverloaded(f"tenant {tenant!r} has {in_flight} requests in flight, the "
                                   f"limit per tenant (max_requests_per_tenant {limit}); retry "
                                   f"later", reason="tenant_requests")
        limit = config.max_queued_tokens_per_tenant
        if limit is not None:
            mine = sum(n for request_id, n in queued.items()
                       if self.tenant_of.get(request_id) == tenant)
            if mine and mine + num_prompt_tokens > limit:
                raise EngineOverloaded(f"tenant {tenant!r} has {mine} prompt tokens queued; "
                                       f"{num_prompt_tokens} more exceed the limit per tenant "
                                       f"(max_queued_tokens_per_tenant {limit}); retry later",
                                       reason="tenant_queued_tokens")

    def admit(self, request_id: str, tenant: str, num_prompt_tokens: int) -> None:
        """The request goes to the engine: in flight for its tenant, queued until its first
        token."""
        self.tenant_of[request_id] = tenant
        self.tenant_in_flight[tenant] = self.tenant_in_flight.get(tenant, 0) + 1
        self.queued[request_id] = num_prompt_tokens

    def started(self, request_id: str) -> None:
        """The request has an update: no longer queued."""
        self.queued.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """The request has ended."""
        self.queued.pop(request_id, None)
        tenant = self.tenant_of.pop(request_id, None)
        if tenant is not None:
            left = self.tenant_in_flight[tenant] - 1
            if left:
                self.tenant_in_flight[tenant] = left
            else:
                del self.tenant_in_flight[tenant]
