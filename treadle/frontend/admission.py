"""Admission: what the frontend decides about a request before the engine sees it.

Tenants: each request's tenant (its API key's name, else the client's `user`, else "default";
`resolve_tenant`) goes to the engine (fair share, per-tenant KV caps), the metrics' `tenant`
label, the request log line and the timeline. Names from `user` are client-chosen, so at most
`max_tenants` distinct ones are tracked; later ones all run as the tenant "other".

Limits: the queue's (client requests, and prompt tokens, waiting for their first token) and
each tenant's (requests in flight, each prompt of a batch counting, and queued prompt tokens)
are checked here, at once, for a client request as a whole, against what this process has sent
and not yet seen answered: the engine's own counts arrive a step late. Where waiting can help,
a refusal is EngineOverloaded (429, retry); a request no wait could admit (more prompts than a
tenant may have in flight) is an InvalidField (400) naming the limit.

Cache isolation: with `isolate_prefix_cache_by_tenant`, a request's cache salt is its tenant
(joined to the client's own salt, if any), so no tenant can probe another's cached prompts
through timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.config import AdmissionConfig
from treadle.core.request import DEFAULT_TENANT
from treadle.errors import PROMPT, InvalidField

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
        # Requests sent to the engine that have produced no token yet: their client request
        # (batch) and prompt tokens (times n); counted per batch, in all and per tenant.
        self.queued: dict[str, tuple[str, int]] = {}
        self.queued_batches: dict[str, int] = {}
        self.queued_tokens = 0
        self.tenant_queued_tokens: dict[str, int] = {}

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

    def check_capacity(self, num_prompt_tokens: int = 0, tenant: str = DEFAULT_TENANT,
                       num_requests: int = 1) -> None:
        """EngineOverloaded if a client request of `num_requests` engine requests (the prompts
        of a batch) and that many prompt tokens in all would overfill the queue, or pass its
        tenant's limits now; InvalidField (the prompt) if it is larger than a tenant may ever
        have in flight, which no wait would help."""
        config = self.config
        queued = len(self.queued_batches)
        # A batch is one client request in the queue: an embeddings call of more inputs than
        # max_queued_requests still goes.
        if config.max_queued_requests is not None and queued >= config.max_queued_requests:
            raise EngineOverloaded(f"the server has {queued} requests queued, its limit; "
                                   f"retry later", reason="queue_full")
        # A prompt larger than the limit alone still goes when nothing is queued: it would
        # otherwise never go.
        limit, queued_tokens = config.max_queued_tokens, self.queued_tokens
        if limit is not None and queued_tokens and queued_tokens + num_prompt_tokens > limit:
            raise EngineOverloaded(f"the server has {queued_tokens} prompt tokens queued; "
                                   f"{num_prompt_tokens} more exceed its limit of {limit}; "
                                   f"retry later", reason="queued_tokens_full")
        limit = config.max_requests_per_tenant
        in_flight = self.tenant_in_flight.get(tenant, 0)
        if limit is not None and num_requests > limit:
            raise InvalidField(PROMPT, f"the request has {num_requests} prompts, more than a "
                               f"tenant may have in flight (max_requests_per_tenant {limit})")
        if limit is not None and in_flight + num_requests > limit:
            raise EngineOverloaded(f"tenant {tenant!r} has {in_flight} requests in flight; "
                                   f"{num_requests} more exceed the limit per tenant "
                                   f"(max_requests_per_tenant {limit}); retry later",
                                   reason="tenant_requests")
        limit = config.max_queued_tokens_per_tenant
        mine = self.tenant_queued_tokens.get(tenant, 0)
        if limit is not None and mine and mine + num_prompt_tokens > limit:
            raise EngineOverloaded(f"tenant {tenant!r} has {mine} prompt tokens queued; "
                                   f"{num_prompt_tokens} more exceed the limit per tenant "
                                   f"(max_queued_tokens_per_tenant {limit}); retry later",
                                   reason="tenant_queued_tokens")

    def admit(self, batch: str, request_ids: list[str], tenant: str,
              num_prompt_tokens: list[int]) -> None:
        """A client request's engine requests (`batch`: its key) go to the engine: in flight for
        its tenant, each queued until its first token."""
        self.tenant_in_flight[tenant] = self.tenant_in_flight.get(tenant, 0) + len(request_ids)
        self.queued_batches[batch] = len(request_ids)
        for request_id, num_tokens in zip(request_ids, num_prompt_tokens, strict=True):
            self.tenant_of[request_id] = tenant
            self.queued[request_id] = (batch, num_tokens)
            self._count_queued(tenant, num_tokens)

    def started(self, request_id: str) -> None:
        """The request has an update: no longer queued."""
        entry = self.queued.pop(request_id, None)
        if entry is None:
            return
        batch, num_tokens = entry
        self._count_queued(self.tenant_of[request_id], -num_tokens)
        self.queued_batches[batch] -= 1
        if not self.queued_batches[batch]:
            del self.queued_batches[batch]

    def release(self, request_id: str) -> None:
        """The request has ended."""
        self.started(request_id)
        tenant = self.tenant_of.pop(request_id, None)
        if tenant is not None:
            left = self.tenant_in_flight[tenant] - 1
            if left:
                self.tenant_in_flight[tenant] = left
            else:
                del self.tenant_in_flight[tenant]

    def drop_queued(self) -> None:
        """The engine is gone: nothing waits in it any more."""
        self.queued.clear()
        self.queued_batches.clear()
        self.queued_tokens = 0
        self.tenant_queued_tokens.clear()

    def _count_queued(self, tenant: str, num_tokens: int) -> None:
        self.queued_tokens += num_tokens
        left = self.tenant_queued_tokens.get(tenant, 0) + num_tokens
        if left:
            self.tenant_queued_tokens[tenant] = left
        else:
            self.tenant_queued_tokens.pop(tenant, None)
