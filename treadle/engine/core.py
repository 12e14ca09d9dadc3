"""EngineCore: the token-generation loop, one `step()` at a time; it owns no I/O.

step(): the scheduler picks requests and token counts, the runner computes logits over the paged
KV cache, the sampler picks tokens, the scheduler advances requests and frees finished ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from treadle.config import CacheConfig, ModelConfig, SchedulerConfig
from treadle.engine.kv_cache import KVCacheManager
from treadle.engine.policies import FCFSPolicy, PriorityPolicy, SchedulingPolicy
from treadle.engine.request import Request, RequestStatus
from treadle.engine.sampling_params import SamplingParams
from treadle.engine.scheduler import Scheduler, SchedulerOutput, assert_scheduler_empty
from treadle.model.loader import LoadedModel
from treadle.model.runner import ModelInput, ModelRunner, ScheduledSequence
from treadle.model.sampler import Sampler, SamplingOptions

logger = logging.getLogger(__name__)

POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # stop, length, abort, error
    num_cached_tokens: int = 0


class EngineCore:
    def __init__(self, loaded: LoadedModel, model_config: ModelConfig,
                 cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, policy: str = "fcfs") -> None:
        cache_config = cache_config or CacheConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
        self.runner = ModelRunner(loaded, model_config, cache_config)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, POLICIES[policy](),
                                   self.runner.max_model_len, loaded.spec.eos_token_ids)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}  # per-request seeded generators

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Queue a request; ValueError (the client's fault) if it can never run."""
        vocab = self.runner.spec.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[0]}")
        request = Request(request_id, prompt_token_ids, sampling_params, priority=priority,
                          cache_salt=cache_salt)
        self.scheduler.add_request(request)
        if sampling_params.seed is not None:
            self.generators[request_id] = torch.Generator().manual_seed(sampling_params.seed)

    def abort_request(self, request_id: str) -> bool:
        """True if the request was still unfinished (and is now aborted, its blocks freed)."""
        self.generators.pop(request_id, None)
        return self.scheduler.abort_request(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return []
        sequences = [ScheduledSequence(s.token_ids, s.num_computed_tokens, s.block_ids)
                     for s in scheduler_output.scheduled]
        try:
            logits = self.runner.execute(ModelInput(sequences))
        except Exception:
            logger.exception("model step of %d requests failed; retrying each alone",
                             len(sequences))
            return self._step_one_by_one(scheduler_output, sequences)
        return self._sample_and_update(scheduler_output, logits)

    def _step_one_by_one(self, scheduler_output: SchedulerOutput,
                         sequences: list[ScheduledSequence]) -> list[EngineCoreOutput]:
        """A batched pass cannot say whose input broke it: rerun each request alone (rewriting
        its KV slots with the same values), fail those that fail again, go on with the rest."""
        kept, rows, outputs = [], [], []
        for scheduled, sequence in zip(scheduler_output.scheduled, sequences, strict=True):
            try:
                rows.append(self.runner.execute(ModelInput([sequence])))
                kept.append(scheduled)
            except Exception:
                logger.exception("request %s failed", scheduled.request.request_id)
                outputs.append(self._fail(scheduled.request))
        # The failed requests' blocks may be published with half-written KV.
        self.kv_cache_manager.reset_prefix_cache()
        if kept:
            outputs += self._sample_and_update(
                SchedulerOutput(kept, scheduler_output.preempted), torch.cat(rows))
        return outputs

    def _sample_and_update(self, scheduler_output: SchedulerOutput,
                           logits: torch.Tensor) -> list[EngineCoreOutput]:
        producing = [(row, s.request) for row, s in enumerate(scheduler_output.scheduled)
                     if s.produces_token]
        requests = [r for _, r in producing]
        options = [sampling_options(r.sampling_params) for r in requests]
        generators = [self.generators.get(r.request_id) for r in requests]
        rows = logits[[row for row, _ in producing]] if producing else logits[:0]
        tokens = self.sampler(rows, options, generators)
        sampled = {r.request_id: t for r, t in zip(requests, tokens, strict=True)}
        finished = {r.request_id for r in self.scheduler.update_from_output(scheduler_output,
                                                                            sampled)}
        outputs = []
        for request in requests:
            done = request.request_id in finished
            if done:
                self.generators.pop(request.request_id, None)
            outputs.append(EngineCoreOutput(request.request_id, [sampled[request.request_id]],
                                            done, request.finish_reason,
                                            request.num_cached_tokens))
        return outputs

    def _fail(self, request: Request) -> EngineCoreOutput:
        self.generators.pop(request.request_id, None)
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request.request_id, [], True, "error", request.num_cached_tokens)


def sampling_options(params: SamplingParams) -> SamplingOptions:
    return SamplingOptions(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def assert_engine_empty(core: EngineCore) -> None:
    """After every request has ended: no requests, every block free with ref count 0, the free
    list and hash map consistent, no seeded generators left behind."""
    assert_scheduler_empty(core.scheduler)
    assert not core.generators, f"generators left: {sorted(core.generators)}"
