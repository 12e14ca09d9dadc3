"""EngineCore: the token-generation loop, one `step()` at a time; it owns no I/O.

step(): the scheduler picks requests and token counts, the executor computes logits over the
paged KV cache, the sampler picks tokens, the scheduler advances requests and frees finished ones.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from treadle.config import EngineConfig
from treadle.core.executor import Executor, build_executor
from treadle.core.kv_cache import KVCacheManager
from treadle.core.lora_request import LoRARequest
from treadle.core.messages import EngineCoreOutput, TokenLogprobs
from treadle.core.request import DEFAULT_TENANT, Request, RequestStatus
from treadle.core.sampler import (
    Sampler,
    SamplingOptions,
    apply_token_bitmask,
    gather_logprobs,
)
from treadle.core.sampling_params import SamplingParams, check_max_logprobs
from treadle.core.sched.policy import make_policy
from treadle.core.sched.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from treadle.core.spec_decode.draft import DraftProposer, TargetModel
from treadle.core.spec_decode.rejection import verify_drafts
from treadle.core.spec_decode.speculator import Speculator
from treadle.core.step_loop import (
    StepLoop,
    StepStats,
    SystemClock,
    latency_breakdown,
)
from treadle.core.structured_output import (
    StructuredOutputManager,
    grammar_drafts,
    grammar_error,
    grammar_failed,
)
from treadle.errors import PROMPT, InvalidField
from treadle.model.batch import ModelInput, ModelOutput, ScheduledSequence, cat_outputs
from treadle.model.lora import LoraError, check_adapter
from treadle.model.memory import gib
from treadle.model.pooling import PooledHidden
from treadle.model.source import resolve_model
from treadle.plugins import load_plugins

logger = logging.getLogger(__name__)

MAX_CHECKED_LORAS = 1024  # adapters remembered as checked (least recently used dropped)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        """Loads the model (the executor `build_executor` picks) and sizes the KV cache."""
        load_plugins()  # in the engine process too: the policy may be a plugin's
        scheduling_policy = make_policy(config.policy, config.scheduler, config.policy_settings)
        if config.model.seed is not None:  # vLLM's --seed: the global generator, for unseeded
            torch.manual_seed(config.model.seed)
        self.max_logprobs = config.model.max_logprobs
        self.pooling = config.model.pooling  # how embedding requests pool: last or mean
        self.enable_lora = config.model.enable_lora
        self.max_lora_rank = config.model.max_lora_rank
        # Adapters already checked, by (id, path): an id names one adapter for good (the
        # frontend never reuses one), so its files are read once, not at every request.
        self.checked_loras: OrderedDict[tuple[int, str], None] = OrderedDict()
        self.executor: Executor = build_executor(config)
        facts = self.executor.facts
        active = (f", {facts.active_parameters / 1e9:.2f} B active per token"
                  if facts.active_parameters != facts.num_parameters else "")
        logger.info("weights %s (%.2f B parameters%s); %s", gib(facts.weights_bytes),
                    facts.num_parameters / 1e9, active, facts.kv_cache.describe())
        self.kv_cache_manager = KVCacheManager(facts.num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache_manager, scheduling_policy, facts.max_model_len,
            facts.eos_token_ids, adapter_ready=lambda lora: self.executor.lora_ready(
                lora.lora_int_id, lora.lora_path),
            attention_break_even=facts.spec.attention_break_even())
        self.sampler = Sampler()
        self.structured_output = StructuredOutputManager(
            resolve_model(config.model.model).folder / "tokenizer.json", facts.vocab_size,
            sorted(facts.eos_token_ids))
        # Constrained requests whose grammar is still compiling: the scheduler gets them when
        # it is ready, so that a slow grammar never stalls a step.
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self.generators: dict[str, torch.Generator] = {}  # per-request seeded generators
        self.loop = StepLoop(self.scheduler, self.kv_cache_manager, SystemClock())
        # None: no speculation, and nothing of it in a step.
        speculative = config.speculative_config
        proposer = None  # the lookups' the speculator makes; a draft model needs the target's
        if speculative is not None and speculative.method == "draft_model":
            proposer = DraftProposer.from_config(speculative, TargetModel(
                config.model, facts.max_model_len, facts.vocab_size, config.cache.block_size))
        self.speculator = None if speculative is None else Speculator(speculative, proposer)

    @property
    def last_step_stats(self) -> StepStats | None:
        """Of the last step that ran a batch."""
        return self.loop.last_step_stats

    @property
    def spec_decode_counts(self) -> tuple[int, int, int]:
        """Speculative decoding since the engine started: (proposals, proposed tokens, accepted
        tokens) checked; zeros without speculation."""
        if self.speculator is None:
            return (0, 0, 0)
        counts = self.speculator.counts
        return (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens)

    @property
    def spec_decode_accepted_per_position(self) -> tuple[int, ...]:
        """Position i: the proposals whose first i + 1 tokens were accepted, since the engine
        started; () without speculation."""
        if self.speculator is None:
            return ()
        return tuple(self.speculator.counts.accepted_per_position)

    @property
    def max_model_len(self) -> int:
        return self.executor.facts.max_model_len

    @property
    def num_queue_timeouts(self) -> int:
        """Requests ended with finish_reason "queue_timeout" so far (a counter, for metrics)."""
        return self.scheduler.num_queue_timeouts

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None, *, tenant: str | None = None,
                    ttft: float | None = None, tpot: float | None = None,
                    pooling: bool = False, lora_request: LoRARequest | None = None,
                    held: float = 0.0) -> None:
        """Queue a request; InvalidField (the client's fault) if it can never run. `tenant`: whose
        share it uses under the fair policy (None: "default"); `ttft`, `tpot`: objectives in
        seconds, for the policies that read them (None: none). `pooling`: an embedding request,
        prefill only, whose finishing output carries the prompt's pooled hidden states (sampling
        parameters unused). `lora_request`: the adapter it runs with (None: the base model).
        `held`: seconds the frontend held it before sending (Request.held)."""
        if lora_request is not None:
            self._check_lora(lora_request)
        check_max_logprobs(sampling_params, self.max_logprobs)
        vocab = self.executor.facts.vocab_size
        ids_by_field = ((PROMPT, "prompt token ids", prompt_token_ids),
                        ("stop_token_ids", "stop_token_ids", sampling_params.stop_token_ids),
                        ("logit_bias", "logit_bias token ids", sampling_params.logit_bias))
        for param, what, ids in ids_by_field:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidField(param, f"{what} must be in [0, {vocab}); got {bad[0]}")
        request = Request(request_id, prompt_token_ids, sampling_params, priority=priority,
                          cache_salt=cache_salt, tenant=tenant or DEFAULT_TENANT, ttft=ttft,
                          tpot=tpot, pooling=self.pooling if pooling else None,
                          lora_request=lora_request, held=held)
        if pooling:
            request.pooled_hidden = PooledHidden(self.pooling, len(prompt_token_ids))
        if sampling_params.structured_outputs is None:
            self.scheduler.add_request(request)
        else:
            if request_id in self.compiling:
                raise ValueError(f"request id {request_id!r} is already in use")
            template = self.structured_output.compile(sampling_params.structured_outputs)
            if template.done():  # a cached grammar: queue it now, as any request
                self._add_constrained(request, template)
            else:
                self.compiling[request_id] = (request, template)
        if sampling_params.seed is not None:
            self.generators[request_id] = torch.Generator().manual_seed(sampling_params.seed)

    def refusal(self, prompt_token_ids: list[int], *, priority: int = 0,
                tenant: str | None = None, ttft: float | None = None,
                tpot: float | None = None) -> str | None:
        """Admission: why the policy refuses a request like this one arriving now (deadline:
        its TTFT or TPOT objective, in seconds, is out of reach given the queue ahead of it and
        the step time fitted over measured steps); None: queue it. Not None: refuse it now (429,
        its reason the policy's name) rather than serve it late."""
        probe = Request("", prompt_token_ids, priority=priority,
                        tenant=tenant or DEFAULT_TENANT, ttft=ttft, tpot=tpot)
        return self.scheduler.refusal(probe)

    def abort_request(self, request_id: str) -> bool:
        """True if the request was still unfinished (and is now aborted, its blocks freed)."""
        self.generators.pop(request_id, None)
        if self.compiling.pop(request_id, None) is not None:
            return True
        return self.scheduler.abort_request(request_id) is not None

    def _check_lora(self, lora: LoRARequest) -> None:
        """InvalidField on `model` unless LoRA is enabled and the adapter servable here."""
        if not self.enable_lora:
            raise InvalidField("model", "LoRA adapters are not enabled (--enable-lora)")
        key = (lora.lora_int_id, lora.lora_path)
        if key in self.checked_loras:
            self.checked_loras.move_to_end(key)
            return
        try:
            check_adapter(lora.lora_path, self.max_lora_rank, self.executor.facts.spec)
        except LoraError as e:
            raise InvalidField("model", str(e)) from e
        self.checked_loras[key] = None
        if len(self.checked_loras) > MAX_CHECKED_LORAS:
            self.checked_loras.popitem(last=False)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.compiling)

    def _add_constrained(self, request: Request, template: Future) -> None:
        """Queue a constrained request with its own matcher; raises the grammar's compile error
        (a ValueError) or the scheduler's refusal."""
        request.grammar = self.structured_output.new_matcher(template)
        self.scheduler.add_request(request)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar has compiled; end with an error those whose grammar
        failed (the frontend checks grammars first, so this is rare: one it could not see)."""
        failed = []
        for request_id, (request, template) in list(self.compiling.items()):
            if not template.done():
                continue
            del self.compiling[request_id]
            try:
                self._add_constrained(request, template)
            except Exception as e:
                logger.warning("request %s cannot run: %s", request_id, e)
                failed.append(EngineCoreOutput(request_id, [], True, "error"))
        return failed

    def _admit_and_propose(self) -> list[EngineCoreOutput]:
        """Before a speculating engine's schedule: the compiled grammars' requests, then each
        running request's proposed tokens."""
        failed = self._admit_compiled()
        assert self.speculator is not None
        self.speculator.propose(self.scheduler.running)
        for request in self.speculator.proposing:
            if request.grammar is not None:
                request.spec_token_ids = grammar_drafts(request.grammar, request.spec_token_ids)
        return failed

    def step(self) -> list[EngineCoreOutput]:
        """Outputs of the step's requests, and of those that waited past max_queue_wait."""
        outputs = self.loop.step(self._run, self._admit_compiled if self.speculator is None
                                 else self._admit_and_propose)
        for output in outputs:
            if output.finished:
                self.generators.pop(output.request_id, None)
        return outputs

    def _run(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        # Proposed tokens are scored at every position, each as a decode row: logits for each.
        sequences = [ScheduledSequence(s.token_ids, s.num_computed_tokens, s.block_ids,
                                       all_logits=bool(s.spec_token_ids) or wants_prompt_logprobs(
                                           s.request, s.num_computed_tokens),
                                       decode_rows=bool(s.spec_token_ids),
                                       num_hidden_rows=num_hidden_rows(s.request,
                                                                       s.num_computed_tokens,
                                                                       s.num_new_tokens),
                                       **lora_fields(s.request))
                     for s in scheduler_output.scheduled]
        try:
            started = time.perf_counter()
            output = self.executor.execute_model(ModelInput(sequences))
            self.loop.model_seconds = time.perf_counter() - started
            self.loop.experts_read = output.experts_read
        except Exception:  # model_seconds stays 0: not split out when retried one by one
            logger.exception("model step of %d requests failed; retrying each alone",
                             len(sequences))
            return self._step_one_by_one(scheduler_output, sequences)
        return self._sample_and_update(scheduler_output, output)

    def _step_one_by_one(self, scheduler_output: SchedulerOutput,
                         sequences: list[ScheduledSequence]) -> list[EngineCoreOutput]:
        """A batched pass cannot say whose input broke it: rerun each request alone (rewriting
        its KV slots with the same values), fail those that fail again, go on with the rest."""
        kept, rows, outputs = [], [], []
        for scheduled, sequence in zip(scheduler_output.scheduled, sequences, strict=True):
            try:
                rows.append(self.executor.execute_model(ModelInput([sequence])))
                kept.append(scheduled)
            except Exception:
                logger.exception("request %s failed", scheduled.request.request_id)
                outputs.append(self._fail(scheduled.request))
        # The failed requests' blocks may be published with half-written KV.
        self.kv_cache_manager.reset_prefix_cache()
        if kept:
            outputs += self._sample_and_update(
                SchedulerOutput(kept, scheduler_output.preempted), cat_outputs(rows))
        return outputs

    def _sample_and_update(self, scheduler_output: SchedulerOutput,
                           output: ModelOutput) -> list[EngineCoreOutput]:
        """`output.logits` rows: per scheduled generating request in order, one per token of its
        chunk when it collects prompt logprobs, else one for its last token; its hidden states:
        the rows each pooling request asked for."""
        logits = output.logits
        self._pool(scheduler_output, output.hidden_states)
        producing: list[tuple[int, Request]] = []
        speculating: list[tuple[int, ScheduledRequest]] = []  # (first row, share)
        row = 0
        for s in scheduler_output.scheduled:
            if s.request.pooling:
                continue
            if s.spec_token_ids:  # a row for its last token and each proposed one
                speculating.append((row, s))
                row += s.num_new_tokens
                continue
            collects = wants_prompt_logprobs(s.request, s.num_computed_tokens)
            num_rows = s.num_new_tokens if collects else 1
            if collects:
                self._collect_prompt_logprobs(s.request, s.num_computed_tokens,
                                              logits[row:row + num_rows])
            row += num_rows
            if s.produces_token:
                producing.append((row - 1, s.request))
        requests = [r for _, r in producing]
        options = [sampling_options(r, self.scheduler.eos_token_ids) for r in requests]
        penalties = any(o.uses_penalties for o in options)
        matchers = [r.grammar for r in requests]
        bitmask = (torch.from_numpy(self.structured_output.fill_bitmask(matchers))
                   if any(m is not None for m in matchers) else None)
        sampler_output = self.sampler(
            logits[[row for row, _ in producing]], options,
            [self.generators.get(r.request_id) for r in requests],
            [r.prompt_token_ids for r in requests] if penalties else None,
            [r.output_token_ids for r in requests] if penalties else None,
            token_bitmask=bitmask)
        sampled = {r.request_id: t
                   for r, t in zip(requests, sampler_output.token_ids, strict=True)}
        accepted, spec_logprobs = (self._verify(speculating, logits, sampled)
                                   if speculating else ({}, {}))
        num_before = {s.request.request_id: s.request.num_output_tokens for _, s in speculating}
        constrained = [(r, [t]) for r, t in zip(requests, sampler_output.token_ids, strict=True)]
        constrained += [(s.request, [*accepted[s.request.request_id],
                                     sampled[s.request.request_id]]) for _, s in speculating]
        grammar_complete, grammar_failed = advance_matchers(constrained)
        failed = {r.request_id for r in grammar_failed}
        for request_id in failed:  # ended before its token is appended: the token breaks it
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_GRAMMAR_ERROR)
        first_tokens = {r.request_id for r in requests if r.num_output_tokens == 0}
        finished_requests = self.scheduler.update_from_output(scheduler_output, sampled,
                                                              accepted)
        finished = {r.request_id for r in finished_requests} | failed
        if self.speculator is not None:
            for request in finished_requests:
                self.speculator.finished(request)
        for request in grammar_complete:  # its grammar admits nothing more: it stops here
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id,
                                              RequestStatus.FINISHED_STOPPED)
                finished.add(request.request_id)
        now = time.monotonic()
        outputs = [embedding_output(r, now) for r in finished_requests if r.pooling]
        for i, request in enumerate(requests):
            done = request.request_id in finished
            if request.request_id in first_tokens:
                request.first_token_time = now
                request.events.append((now, "first_token", 0))
            if done:
                request.events.append((now, "finished", 0))
            logprobs = sampler_output.logprobs and sampler_output.logprobs[i]
            first = request.request_id in first_tokens
            outputs.append(EngineCoreOutput(
                request.request_id,
                [] if request.request_id in failed else [sampled[request.request_id]], done,
                request.finish_reason,
                request.num_cached_tokens, logprobs=[logprobs] if logprobs else None,
                prompt_logprobs=[None, *request.prompt_logprobs]
                if first and request.sampling_params.prompt_logprobs is not None else None,
                timings=latency_breakdown(request, now) if done else None,
                events=request.events if done else None,
                stats=request.stats if done else None))
        for _, s in speculating:
            request = s.request
            # Those appended: a stop token or max_tokens may end it before all it accepted;
            # none when it was aborted while the step ran.
            num_new = request.num_output_tokens - num_before[request.request_id]
            if not num_new and request.request_id not in failed:
                continue
            done = request.is_finished
            if done:
                request.events.append((now, "finished", 0))
            token_logprobs = spec_logprobs.get(request.request_id)
            outputs.append(EngineCoreOutput(
                request.request_id, request.output_token_ids[num_before[request.request_id]:],
                done,
                request.finish_reason, request.num_cached_tokens,
                logprobs=token_logprobs[:num_new] if token_logprobs else None,
                timings=latency_breakdown(request, now) if done else None,
                events=request.events if done else None,
                stats=request.stats if done else None))
        return outputs

    def _verify(self, speculating: list[tuple[int, ScheduledRequest]], logits: torch.Tensor,
                sampled: dict[str, int]) -> tuple[dict[str, list[int]],
                                                  dict[str, list[TokenLogprobs]]]:
        """Check the speculating requests' proposed tokens (core/spec_decode/rejection.py):
        their accepted tokens by request, and the sampled token after them added to `sampled`;
        with the logprobs of each of those tokens for the requests that ask."""
        assert self.speculator is not None
        rows, drafts, options = [], [], []
        eos = self.scheduler.eos_token_ids
        for start, s in speculating:
            num_rows = s.num_new_tokens
            rows.extend(range(start, start + num_rows))
            drafts.append(s.spec_token_ids)
            # Row i samples output token num_output_tokens + i: min_tokens may pass inside.
            options.extend(sampling_options(s.request, eos, s.request.num_output_tokens + i)
                           for i in range(num_rows))
        spec_logits = logits[rows]
        matchers = [s.request.grammar for _, s in speculating]
        masked = spec_logits if all(m is None for m in matchers) else apply_token_bitmask(
            spec_logits, torch.from_numpy(self.structured_output.fill_draft_bitmasks(
                matchers, drafts)))
        emitted = verify_drafts(masked, drafts, options)
        accepted, logprobs = {}, {}
        first_row = 0
        for (_, s), tokens, proposed in zip(speculating, emitted, drafts, strict=True):
            request_id = s.request.request_id
            accepted[request_id], sampled[request_id] = tokens[:-1], tokens[-1]
            self.speculator.verified(s.request, len(proposed), len(tokens) - 1)
            num_logprobs = s.request.sampling_params.logprobs
            if num_logprobs is not None:  # raw logprobs: the row each token was drawn at
                logprobs[request_id] = gather_logprobs(
                    spec_logits[first_row:first_row + len(tokens)],
                    torch.tensor(tokens, device=logits.device), [num_logprobs] * len(tokens))
            first_row += len(proposed) + 1
        self.loop.num_accepted_tokens = sum(len(a) for a in accepted.values())
        return accepted, logprobs

    def _pool(self, scheduler_output: SchedulerOutput, hidden: torch.Tensor | None) -> None:
        """Hand each pooling request its rows of the step's final hidden states (None: no
        request asked for any this step)."""
        if hidden is None:
            return
        row = 0
        for s in scheduler_output.scheduled:
            if s.request.pooling:
                end = s.num_computed_tokens + s.num_new_tokens
                num_rows = num_hidden_rows(s.request, s.num_computed_tokens, s.num_new_tokens)
                s.request.pooled_hidden.add(end, hidden[row:row + num_rows])
                row += num_rows

    def _collect_prompt_logprobs(self, request: Request, start: int,
                                 rows: torch.Tensor) -> None:
        """Row j holds the logits at position start + j, which predict prompt token
        start + j + 1. Positions seen before (recomputed after a preemption) are skipped."""
        collected = request.prompt_logprobs
        end = min(start + rows.shape[0], request.num_prompt_tokens - 1)
        if end <= len(collected):
            return
        first = len(collected)
        targets = torch.tensor(request.prompt_token_ids[first + 1:end + 1], device=rows.device)
        collected += gather_logprobs(rows[first - start:end - start], targets,
                                     [request.sampling_params.prompt_logprobs] * len(targets))

    def _fail(self, request: Request) -> EngineCoreOutput:
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request.request_id, [], True, "error", request.num_cached_tokens)


def advance_matchers(requests: list[tuple[Request, list[int]]]
                     ) -> tuple[list[Request], list[Request]]:
    """Feed each constrained request its step's tokens (sampled; a speculating one's accepted
    and sampled): the requests whose grammar is now complete, and those whose grammar failed
    (its matcher refused a token its mask allowed, or gave up computing the mask: a grammar it
    compiled but cannot follow; logged)."""
    complete, failed = [], []
    for request, tokens in requests:
        matcher = request.grammar
        if matcher is None:
            continue
        if not matcher.consume_tokens(tokens) or grammar_failed(matcher):
            logger.warning("request %s: its grammar failed at tokens %s: %s",
                           request.request_id, tokens, grammar_error(matcher))
            failed.append(request)
        elif matcher.is_stopped():
            complete.append(request)
    return complete, failed


def num_hidden_rows(request: Request, start: int, num_new: int) -> int | None:
    """Final hidden-state rows a step's chunk must return: None for a generating request."""
    if not request.pooling:
        return None
    return request.pooled_hidden.rows_wanted(start, num_new)


def embedding_output(request: Request, now: float) -> EngineCoreOutput:
    """A pooling request's one output, when its prompt is computed: prefill time counts from
    its first schedule to now, as a first token's would."""
    request.first_token_time = now
    request.events.append((now, "finished", 0))
    return EngineCoreOutput(request.request_id, [], True, request.finish_reason,
                            request.num_cached_tokens, timings=latency_breakdown(request, now),
                            events=request.events, stats=request.stats,
                            embedding=request.pooled_hidden.embedding())


def wants_prompt_logprobs(request: Request, num_computed_tokens: int) -> bool:
    return (request.sampling_params.prompt_logprobs is not None
            and num_computed_tokens < request.num_prompt_tokens - 1)


def sampling_options(request: Request, eos_token_ids: frozenset[int],
                     num_output_tokens: int | None = None) -> SamplingOptions:
    """The sampler's options for `request`'s next token, or, given `num_output_tokens`, for
    the token after that many outputs (a proposed token's position)."""
    params = request.sampling_params
    if num_output_tokens is None:
        num_output_tokens = request.num_output_tokens
    # Before min_tokens, EOS (even with ignore_eos, as vLLM) and stop tokens cannot be sampled.
    suppressed = (tuple(eos_token_ids) + tuple(params.stop_token_ids)
                  if num_output_tokens < params.min_tokens else ())
    return SamplingOptions(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
        suppressed_token_ids=suppressed, num_logprobs=params.logprobs)


def lora_fields(request: Request) -> dict:
    """A scheduled sequence's adapter fields, from its request's LoRARequest."""
    lora = request.lora_request
    return {} if lora is None else {"lora_id": lora.lora_int_id, "lora_path": lora.lora_path}
