"""Speculative decoding (n-gram prompt lookup): the proposer against a brute-force search, the
rejection rule's output distribution against the target's (chi-square), and the engine's
outputs with speculation against those without, token for token, leaving no KV blocks held."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from conftest import ROOT, assert_engine_empty
from model_utils import TINY, build_tiny_model

from treadle.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    build_config,
)
from treadle.core.engine_core import EngineCore
from treadle.core.sampler import Sampler, SamplingOptions
from treadle.core.sampling_params import SamplingParams
from treadle.core.spec_decode import draft as draft_module
from treadle.core.spec_decode.draft import DraftProposer, TargetModel
from treadle.core.spec_decode.ngram import NgramProposer
from treadle.core.spec_decode.rejection import verify_drafts
from treadle.core.spec_decode.suffix import SuffixProposer


def chisquare_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test's p-value (scipy.stats.chisquare's), by the regularized upper
    incomplete gamma function of torch."""
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix of min_n..max_n tokens found earlier (ending before the last token),
    its latest occurrence; the k tokens after it."""
    n = len(tokens)
    for length in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = tokens[n - length:]
        starts = [i for i in range(n - length) if tokens[i:i + length] == suffix]
        if starts:
            start = starts[-1] + length
            return tokens[start:start + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8, 50])
def test_ngram_proposer_matches_brute_force(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        tokens = rng.integers(0, vocab, n).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        expected = brute_force_lookup(tokens, min_n, max_n, k)
        assert NgramProposer(min_n, max_n).propose("r", tokens, k) == expected, (tokens, min_n,
                                                                           max_n, k)


def test_ngram_proposer_copies_a_repeated_passage():
    passage = list(range(100, 140))
    tokens = [1, 2, 3, *passage, 7, 8, *passage[:10]]
    assert NgramProposer(2, 5).propose("r", tokens, 4) == passage[10:14]
    assert NgramProposer(2, 5).propose("r", [5, 6, 7, 8], 4) == []  # nothing recurs


def test_ngram_proposer_is_fast_enough_for_long_prompts():
    """Behaviour on a 1,000-token prompt: the same answer as brute force (its speed is measured
    in the bench, not asserted here)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 500, 1000).tolist()
    tokens += tokens[300:310]
    assert NgramProposer(2, 5).propose("r", tokens, 5) == brute_force_lookup(tokens, 2, 5, 5)


def brute_force_suffix(tokens: list[int], cached: list[list[int]], min_n: int, max_n: int,
                       k: int) -> list[int]:
    """The own sequence's lookup, unless a longer suffix (with a token after it) occurs in a
    cached request: then the tokens after its latest occurrence there (newest request first)."""
    n = len(tokens)
    own = 0
    for length in range(min(max_n, n - 1), min_n - 1, -1):
        if any(tokens[i:i + length] == tokens[n - length:] for i in range(n - length)):
            own = length
            break
    for length in range(min(max_n, n), max(own, min_n - 1), -1):
        suffix = tokens[n - length:]
        for earlier in reversed(cached):
            ends = [i + length for i in range(len(earlier) - length)
                    if earlier[i:i + length] == suffix]
            if ends:
                return earlier[ends[-1]:ends[-1] + k]
    return brute_force_lookup(tokens, min_n, max_n, k)


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_suffix_proposer_matches_brute_force(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(200):
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        proposer = SuffixProposer(min_n, max_n, max_cached_requests=3)
        cached = [rng.integers(0, vocab, int(rng.integers(1, 20))).tolist()
                  for _ in range(int(rng.integers(0, 6)))]
        for earlier in cached:
            proposer.finished("r", earlier)
        tokens = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        k = int(rng.integers(1, 6))
        expected = brute_force_suffix(tokens, cached[-3:], min_n, max_n, k)
        assert proposer.propose("r", tokens, k) == expected, (tokens, cached, min_n, max_n, k)


def test_suffix_proposer_continues_what_an_earlier_request_wrote():
    proposer = SuffixProposer(2, 5, max_cached_requests=2)
    answer = list(range(100, 130))
    proposer.finished("r", [1, 2, 3, *answer])
    assert NgramProposer(2, 5).propose("r", [9, 8, *answer[:6]], 4) == []
    assert proposer.propose("r", [9, 8, *answer[:6]], 4) == answer[6:10]
    assert proposer.propose("r", [9, 8, *answer[-3:]], 4) == []  # nothing followed it
    proposer.finished("r", [5, 6])
    proposer.finished("r", [7, 8])  # the first request drops out of the cache
    assert proposer.propose("r", [9, 8, *answer[:6]], 4) == []


TOY_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("draft", [0, 2, 5, 7])  # likely, less so, cut by top-p, the least
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """With temperature 0.8 and top-p 0.9, the first token a request gets after proposing
    `draft` is distributed as the plain sampler's p, whatever the proposal (chi-square)."""
    torch.manual_seed(draft)
    num = 20000
    options = SamplingOptions(temperature=0.8, top_p=0.9)
    target = Sampler.probabilities(TOY_LOGITS[None], [options])[0].double()
    logits = TOY_LOGITS.repeat(2 * num, 1)  # each request: a row for its draft, one after
    emitted = verify_drafts(logits, [[draft]] * num, [options] * (2 * num))
    first = np.array([tokens[0] for tokens in emitted])
    counts = np.bincount(first, minlength=len(TOY_LOGITS))
    support = target > 0
    assert counts[~support.numpy()].sum() == 0, "a token outside top-p was sampled"
    expected = target[support].numpy() * num
    p_value = chisquare_p(counts[support.numpy()], expected)
    assert p_value > 1e-3, (counts, expected)
    # Accepted: two tokens; rejected: one, never the proposal itself.
    assert all(len(t) == 2 if t[0] == draft else len(t) == 1 for t in emitted)


def test_rejection_sampling_of_two_drafts_keeps_the_joint_distribution():
    """Two proposed tokens over rows with different logits: the pair of first two tokens is
    distributed as p0(a) * p1(b) (the second row conditioned on the accepted first)."""
    torch.manual_seed(7)
    num = 30000
    options = SamplingOptions(temperature=0.8, top_p=0.9)
    rows = torch.stack([TOY_LOGITS, TOY_LOGITS.flip(0), TOY_LOGITS.roll(3)])
    p0, p1 = Sampler.probabilities(rows[:2], [options] * 2).double()
    emitted = verify_drafts(rows.repeat(num, 1), [[0, 7]] * num, [options] * (3 * num))
    # Where the first token is the accepted proposal 0, the second is drawn from row 1's p.
    seconds = np.array([t[1] for t in emitted if t[0] == 0])
    counts = np.bincount(seconds, minlength=8)
    support = (p1 > 0).numpy()
    p_value = chisquare_p(counts[support], p1[support].numpy() * len(seconds))
    assert p_value > 1e-3
    firsts = np.bincount([t[0] for t in emitted], minlength=8)
    support = (p0 > 0).numpy()
    p_value = chisquare_p(firsts[support], p0[support].numpy() * num)
    assert p_value > 1e-3


def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.full((4, 8), -1.0)
    logits[0, 3] = logits[1, 5] = logits[2, 6] = logits[3, 1] = 1.0
    greedy = [SamplingOptions()] * 4
    assert verify_drafts(logits, [[3, 5, 6]], greedy) == [[3, 5, 6, 1]]  # all, and a bonus
    assert verify_drafts(logits, [[3, 4, 6]], greedy) == [[3, 5]]  # stops at the first miss
    biased = [SamplingOptions(logit_bias={2: 5.0})] * 4  # processing applies at every row
    assert verify_drafts(logits, [[3, 5, 6]], biased) == [[2]]


# --- the engine ---


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-spec")
    build_tiny_model("llama", folder)
    return folder


def make_engine(folder, speculative: dict | None, num_blocks=256, block_size=4,
                quantization="auto", quant_gemv_max_rows=None, **scheduler) -> EngineCore:
    return EngineCore(EngineConfig(ModelConfig(model=None if folder is None else str(folder),
                                               dtype="float32", quantization=quantization,
                                               quant_gemv_max_rows=quant_gemv_max_rows),
                                   CacheConfig(block_size=block_size, num_blocks=num_blocks),
                                   SchedulerConfig(**scheduler), speculative_config=speculative))


def run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams
        ) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def repetitive_prompts(count: int, seed: int = 3) -> list[list[int]]:
    """Prompts that repeat a passage, so the lookup finds matches."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        passage = torch.randint(3, 256, (8 + 3 * i,), generator=gen).tolist()
        prompts.append(passage * 3 + passage[:4])
    return prompts


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 16}
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 10])
def test_tiny_greedy_with_speculation_equals_without(tiny_model, batch):
    """Chunked prefill (a 16-token budget) and preemption (too few blocks for the batch) in the
    mix; accepted tokens counted, so the test cannot pass without speculating."""
    prompts = repetitive_prompts(batch)
    limits = dict(max_num_batched_tokens=16, long_prefill_token_threshold=8,
                  num_blocks=40 if batch > 1 else 256)
    plain = make_engine(tiny_model, None, **limits)
    expected = run(plain, prompts, GREEDY)
    engine = make_engine(tiny_model, SPEC, **limits)
    assert run(engine, prompts, GREEDY) == expected
    drafts, draft_tokens, accepted = engine.spec_decode_counts
    assert drafts > 0 and 0 < accepted <= draft_tokens
    if batch > 1:
        assert engine.scheduler.num_preemptions > 0
    assert_engine_empty(engine)


def test_suffix_speculation_reuses_an_earlier_requests_output(tiny_model):
    """The tiny model answers a prompt it has seen before as it did then: with suffix
    speculation the second run's tokens come from the first's, outputs token for token as
    without speculation; prompt lookup alone finds little in a random model's output."""
    prompts = [torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(2)]
    expected = run(make_engine(tiny_model, None), prompts, GREEDY)
    counts = {}
    for method in ("ngram", "suffix"):
        engine = make_engine(tiny_model, {**SPEC, "method": method})
        assert run(engine, prompts, GREEDY) == expected  # learns the answers
        before = engine.spec_decode_counts[2]
        assert run(engine, prompts, GREEDY) == expected  # asked again
        counts[method] = engine.spec_decode_counts[2] - before
        assert_engine_empty(engine)
    assert counts["suffix"] > 2 * max(counts["ngram"], 10), counts


@pytest.fixture(scope="module")
def other_tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-draft")
    build_tiny_model("llama", folder, seed=1)
    return folder


@pytest.mark.parametrize("batch", [1, 6])
def test_draft_model_speculation_equals_without(tiny_model, other_tiny_model, batch):
    """A draft model proposes; the target decides: with itself as the draft nearly every guess
    is right, with another random model of the same vocabulary few are, and the outputs are
    token for token those without speculation either way (chunked prefill and preemption in
    the mix). Every request's draft blocks come back when it ends."""
    prompts = repetitive_prompts(batch, seed=5)
    limits = dict(max_num_batched_tokens=16, long_prefill_token_threshold=8,
                  num_blocks=40 if batch > 1 else 256)
    expected = run(make_engine(tiny_model, None, **limits), prompts, GREEDY)
    rates = {}
    for name, draft in (("itself", tiny_model), ("another", other_tiny_model)):
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4,
                  "disable_by_batch_size": 16}
        engine = make_engine(tiny_model, config, **limits)
        assert run(engine, prompts, GREEDY) == expected, name
        drafts, draft_tokens, accepted = engine.spec_decode_counts
        assert drafts > 0, name
        rates[name] = accepted / draft_tokens
        proposer = engine.speculator.proposer
        assert not proposer.states and sorted(proposer.free_blocks) == list(
            range(proposer.runner.num_blocks))
        if batch > 1:
            assert engine.scheduler.num_preemptions > 0
        assert_engine_empty(engine)
    assert rates["itself"] > 0.9 and rates["another"] < 0.5, rates


def test_a_draft_model_holds_its_blocks_for_the_requests_it_proposes_for(tiny_model):
    """Blocks for disable_by_batch_size requests at the longest context: a request that needs
    blocks takes them from the least recently proposed others; its rejected guesses' positions
    are run again, so a guess follows the tokens as they are."""
    config = SpeculativeConfig(method="draft_model", model=str(tiny_model),
                               num_speculative_tokens=3, disable_by_batch_size=1)
    target = TargetModel(ModelConfig(model=str(tiny_model), dtype="float32"), 64, 256, 4)
    proposer = DraftProposer.from_config(config, target)
    assert proposer.runner.num_blocks == 17  # (64 + 3) / 4, rounded up
    greedy = make_engine(tiny_model, None)
    prompt = list(range(3, 13))
    output = run(greedy, [prompt], SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))[0]
    assert proposer.propose("a", prompt, 3) == output[:3]
    # Its first guess taken, a wrong token after it: the guesses follow the tokens as they are.
    wrong = (output[1] + 1) % 256
    again = proposer.propose("a", [*prompt, output[0], wrong], 3)
    fresh = DraftProposer.from_config(config, target)
    assert again == fresh.propose("x", [*prompt, output[0], wrong], 3)
    assert proposer.propose("b", list(range(3, 63)), 3)  # 16 blocks: a's are taken
    assert list(proposer.states) == ["b"]
    assert proposer.propose("a", list(range(3, 70)), 3) == []  # more than the cache holds
    assert list(proposer.states) == ["b", "a"]  # nothing was taken from b for it
    proposer.finished("a", [])
    proposer.finished("b", [])
    assert not proposer.states and len(proposer.free_blocks) == 17


def test_a_draft_model_reads_a_long_prompt_a_chunk_a_step(tiny_model, monkeypatch):
    """A prompt longer than a chunk runs a chunk a proposal, with no guesses until the draft
    has seen it all; then its guesses are the target's greedy tokens (the draft is itself)."""
    monkeypatch.setattr(draft_module, "CATCH_UP_CHUNK", 4)
    config = SpeculativeConfig(method="draft_model", model=str(tiny_model),
                               num_speculative_tokens=3)
    proposer = DraftProposer.from_config(config, TargetModel(
        ModelConfig(model=str(tiny_model), dtype="float32"), 64, 256, 4))
    prompt = list(range(3, 13))
    output = run(make_engine(tiny_model, None), [prompt],
                 SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert proposer.propose("a", prompt, 3) == []
    assert proposer.states["a"].tokens == prompt[:4]
    assert proposer.propose("a", prompt, 3) == []
    assert proposer.propose("a", prompt, 3) == output


class Failing:
    def propose(self, request_id: str, token_ids, max_tokens: int) -> list[int]:
        raise RuntimeError("the draft broke")

    def finished(self, request_id: str, token_ids) -> None:
        """Nothing held."""


def test_a_failing_proposer_costs_its_guesses_not_the_engine(tiny_model):
    prompts = repetitive_prompts(2)
    expected = run(make_engine(tiny_model, None), prompts, GREEDY)
    engine = make_engine(tiny_model, SPEC)
    engine.speculator.proposer = Failing()
    assert run(engine, prompts, GREEDY) == expected
    assert engine.spec_decode_counts == (0, 0, 0)
    assert_engine_empty(engine)


def test_draft_models_that_cannot_serve_the_target_are_refused(tiny_model, tmp_path):
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 300})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(tiny_model, {"method": "draft_model", "model": str(tmp_path)})
    with pytest.raises(ValueError, match="the draft model: .*does not exist"):
        make_engine(tiny_model, {"method": "draft_model", "model": str(tmp_path / "none")})
    draft = SpeculativeConfig(method="draft_model", model=str(tiny_model))
    with pytest.raises(ValueError, match=r"context \(256 tokens\) is shorter"):
        DraftProposer.from_config(draft, TargetModel(
            ModelConfig(model=str(tiny_model), dtype="float32"), 512, 256, 4))


class OracleProposer:
    """Proposes the tokens a plain run produced, the last of every other proposal wrong: the
    tiny random model never copies its prompt, so the n-gram lookup alone would seldom be
    right, and these tests are about what the engine does with accepted and rejected tokens."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.runs = list(zip(prompts, outputs, strict=True))
        self.calls = 0

    def propose(self, request_id: str, token_ids, max_tokens: int) -> list[int]:
        self.calls += 1
        for prompt, output in self.runs:
            if token_ids[:len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                guess = output[done:done + max_tokens]
                if guess and self.calls % 2:
                    guess[-1] = (guess[-1] + 1) % 256
                return guess
        return []

    def finished(self, request_id: str, token_ids) -> None:
        """It knows every answer already."""


def with_oracle(engine: EngineCore, prompts, outputs) -> EngineCore:
    engine.speculator.proposer = OracleProposer(prompts, outputs)
    return engine


def test_stops_inside_accepted_tokens_and_max_tokens_hold(tiny_model):
    """A stop token, max_tokens or min_tokens inside a step's accepted tokens end the output
    there, as without speculation."""
    prompts = repetitive_prompts(3, seed=5)
    plain = run(make_engine(tiny_model, None), prompts, GREEDY)
    stop_token = plain[0][10]
    for params in (SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_token]),
                   SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                  min_tokens=20, stop_token_ids=[stop_token])):
        engine = with_oracle(make_engine(tiny_model, SPEC), prompts, plain)
        expected = run(make_engine(tiny_model, None), prompts, params)
        assert run(engine, prompts, params) == expected, params
        drafts, draft_tokens, accepted = engine.spec_decode_counts
        assert 0 < accepted < draft_tokens
        assert_engine_empty(engine)


def test_logprobs_come_per_accepted_token(tiny_model):
    prompts = repetitive_prompts(1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)

    def tokens_and_logprobs(engine):
        engine.add_request("0", prompts[0], params)
        tokens, logprobs = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
        return tokens, logprobs

    plain_tokens, plain_logprobs = tokens_and_logprobs(make_engine(tiny_model, None))
    engine = with_oracle(make_engine(tiny_model, SPEC), prompts, [plain_tokens])
    tokens, logprobs = tokens_and_logprobs(engine)
    assert engine.spec_decode_counts[2] > 0
    assert tokens == plain_tokens and len(logprobs) == len(tokens)
    for got, want in zip(logprobs, plain_logprobs, strict=True):
        assert got.token_id == want.token_id and got.top_token_ids == want.top_token_ids
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_sampled_outputs_run_and_leave_no_blocks(tiny_model):
    """Sampled with top-p over a batch: outputs of the right length, drafts both accepted and
    rejected, the cache empty after. At a low temperature: the tiny random model's logits are
    flat, and at 0.8 about one guess in a hundred was accepted, so whether any was depended on
    how the steps fell (the chi-square test checks the distribution at 0.8)."""
    torch.manual_seed(0)
    prompts = repetitive_prompts(6)
    plain = run(make_engine(tiny_model, None), prompts, GREEDY)  # likely guesses
    engine = with_oracle(make_engine(tiny_model, SPEC, num_blocks=48,
                                     max_num_batched_tokens=32), prompts, plain)
    params = SamplingParams(max_tokens=20, temperature=0.05, top_p=0.9, ignore_eos=True)
    outputs = run(engine, prompts, params)
    assert all(len(tokens) == 20 for tokens in outputs)
    drafts, draft_tokens, accepted = engine.spec_decode_counts
    assert 0 < accepted < draft_tokens
    assert_engine_empty(engine)


def test_speculation_is_off_for_large_batches_and_excluded_requests(tiny_model):
    prompts = repetitive_prompts(6)
    engine = make_engine(tiny_model, {**SPEC, "disable_by_batch_size": 2})
    run(engine, prompts, GREEDY)  # six running: no step proposes until few are left
    few = engine.spec_decode_counts[0]
    engine = make_engine(tiny_model, SPEC)
    penalized = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.2)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True)
    opted_out = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculate=False)
    run(engine, prompts, penalized)
    run(engine, prompts, seeded)
    run(engine, prompts, opted_out)
    assert engine.spec_decode_counts == (0, 0, 0)
    everyone = make_engine(tiny_model, SPEC)
    run(everyone, prompts, GREEDY)
    assert few < everyone.spec_decode_counts[0]


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "eagle"}', "method must be one of"),
    ('{"num_speculative_tokens": 3}', "method` is required"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "lookahead": 2}', "unknown key 'lookahead'"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
    ('{"method": "draft_model"}', "`model`"),
    ('{"method": "ngram", "model": "m"}', "`model`"),
    ('{"method": "draft_model", "model": 3}', "model must be a path"),
    ('{"method": "draft_model", "model": "m", "quantization": "fp4"}', "quantization must be"),
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        build_config(EngineConfig, {"speculative_config": value})
    with pytest.raises(ValueError, match=message):
        build_config(EngineConfig, {"speculative_config": json.loads(value)}
                     if value.startswith("{\"") else {"speculative_config": value})


def test_the_cli_refuses_a_bad_speculative_config():
    result = subprocess.run([sys.executable, "-m", "treadle.cli", "serve", "--speculative-config",
                             '{"method": "ngram", "prompt_lookup_max": 0}'],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "prompt_lookup_max must be an integer >= 1" in result.stderr


def test_a_good_speculative_config_parses_with_defaults():
    config = build_config(EngineConfig, {"speculative_config": '{"method": "ngram"}'})
    assert config.speculative_config == SpeculativeConfig()


# --- the default model, where prompt lookup is right often ---

COPY_ASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this passage, changing nothing:\n\n{}",
]


LOOKUP = {**SPEC, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


@pytest.fixture(scope="module")
def copy_prompts() -> list[list[int]]:
    """Chat prompts asking the model to repeat passages of the copy-edit workload's sentences."""
    import random

    from treadle.bench.copy_workload import sentence
    from treadle.model.source import resolve_model
    from treadle.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(resolve_model(None).folder)
    rng = random.Random(0)
    prompts = []
    for i in range(8):
        passage = " ".join(sentence(rng) for _ in range(3 + i % 4))
        ask = COPY_ASKS[i % 2].format(passage)
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                                     tokenize=True, add_generation_prompt=True))
    return prompts


# Float32 weights (quantization none), a cache too small for 8 prompts at once (preemption),
# a 64-token budget (chunked prefill).
SMALL_CACHE = dict(block_size=16, num_blocks=30, max_num_batched_tokens=64,
                   long_prefill_token_threshold=32, quantization="none")
COPY_PARAMS = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def copy_outputs(copy_prompts) -> list[list[int]]:
    """The default model's greedy outputs without speculation, all 8 prompts at once."""
    plain = make_engine(None, None, **SMALL_CACHE)
    outputs = run(plain, copy_prompts, COPY_PARAMS)
    assert plain.scheduler.num_preemptions > 0
    return outputs


@pytest.mark.default_model
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_default_model_greedy_with_speculation_equals_without(copy_prompts, copy_outputs,
                                                              method):
    """Prompt lookup, or the model's own Q4_1 file as a draft: one request at a time, then all
    8 at once with preemption and chunked prefill, token for token as without speculation,
    most proposals right."""
    from treadle.model.source import resolve_model

    config = LOOKUP if method == "ngram" else {
        "method": "draft_model", "model": str(resolve_model(None).gguf),
        "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    engine = make_engine(None, config, **SMALL_CACHE)
    assert [run(engine, [p], COPY_PARAMS)[0] for p in copy_prompts[:2]] == copy_outputs[:2]
    assert run(engine, copy_prompts, COPY_PARAMS) == copy_outputs
    assert engine.scheduler.num_preemptions > 0
    drafts, draft_tokens, accepted = engine.spec_decode_counts
    assert accepted > draft_tokens / 3, engine.spec_decode_counts
    assert_engine_empty(engine)


@pytest.mark.slow
@pytest.mark.default_model
@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_the_exactness_bar_over_32_prompts_at_batch_1_and_16(quantization):
    """Issue 36's bar as it reads (1.5 minutes, out of the default run): 32 copy prompts on the
    float32 and the quantized paths, one at a time and 16 at once with chunked prefill and
    preemption, every proposer's greedy outputs token for token those without speculation."""
    import random

    from treadle.bench.copy_workload import sentence
    from treadle.model.source import resolve_model
    from treadle.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(resolve_model(None).folder)
    rng = random.Random(1)
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": COPY_ASKS[i % 2].format(
            " ".join(sentence(rng) for _ in range(2 + i % 4)))}],
        tokenize=True, add_generation_prompt=True) for i in range(32)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    limits = dict(block_size=16, num_blocks=48, max_num_batched_tokens=128,
                  long_prefill_token_threshold=64, quantization=quantization, max_num_seqs=16)
    plain = make_engine(None, None, **limits)
    alone = [run(plain, [p], params)[0] for p in prompts]
    together = run(plain, prompts, params)
    assert plain.scheduler.num_preemptions > 0
    for method, extra in [("ngram", {}), ("suffix", {}),
                          ("draft_model", {"model": str(resolve_model(None).gguf)})]:
        engine = make_engine(None, {"method": method, "num_speculative_tokens": 4,
                                    "disable_by_batch_size": 16, **extra}, **limits)
        assert [run(engine, [p], params)[0] for p in prompts] == alone, method
        assert run(engine, prompts, params) == together, method
        assert engine.scheduler.num_preemptions > 0, method
        assert_engine_empty(engine)


@pytest.mark.default_model
@pytest.mark.parametrize("method, row_kernel_rows", [("ngram", 8), ("suffix", 1)])
def test_default_model_greedy_with_speculation_equals_without_on_the_quantized_path(
        copy_prompts, method, row_kernel_rows):
    """The GGUF's blocks as stored, one request at a time: the integer kernels give a row the
    same bits in a step of several rows (its proposed tokens) as alone, whether a verifying
    step stays on the row kernels (8) or takes the integer GEMM from 2 rows (1)."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain = make_engine(None, None, block_size=16, quant_gemv_max_rows=row_kernel_rows)
    expected = [run(plain, [p], params)[0] for p in copy_prompts[:4]]
    engine = make_engine(None, {**LOOKUP, "method": method}, block_size=16,
                         quant_gemv_max_rows=row_kernel_rows)
    assert [run(engine, [p], params)[0] for p in copy_prompts[:4]] == expected
    drafts, draft_tokens, accepted = engine.spec_decode_counts
    assert accepted > draft_tokens / 3, engine.spec_decode_counts
    assert_engine_empty(engine)


@pytest.mark.default_model
def test_a_verifying_step_leaves_the_row_kernels_only_for_a_gemm_of_the_same_bits():
    """Whatever the crossover (here pinned at 1 row), a layer whose integer GEMM rounds
    otherwise than its row kernels keeps a verifying step's rows (its last token and
    num_speculative_tokens more) on the row kernels; the others take the GEMM from 2 rows."""
    engine = make_engine(None, LOOKUP, block_size=16, quant_gemv_max_rows=1)
    layers = engine.executor.runner.model.quantized_layers()
    verify_rows = 1 + LOOKUP["num_speculative_tokens"]
    assert all(layer.max_gemv_rows == (1 if layer.gemm_same_bits else verify_rows)
               for layer in layers)
    assert any(layer.gemm_same_bits for layer in layers) == bool(
        layers[0].kernels and layers[0].kernels.quant_gemm_same_bits_types())


def test_llm_stop_strings_and_n_samples_with_speculation(tiny_folder):
    """Through LLM (the frontend's output processing): a stop string completed inside a step's
    accepted tokens ends the text and the token ids where it would without speculation; n=2
    sampled samples each get all their tokens."""
    from treadle.llm import LLM

    prompts = repetitive_prompts(2, seed=9)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_folder), dtype="float32")
    reference = plain.generate(prompts, greedy, use_tqdm=False)
    text = reference[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 4]
    engine = LLM(str(tiny_folder), dtype="float32", speculative_config=SPEC)
    outputs = [o.outputs[0].token_ids for o in reference]
    engine.engine.speculator.proposer = OracleProposer(prompts, [list(t) for t in outputs])
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    want = plain.generate(prompts, params, use_tqdm=False)
    got = engine.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in got] == \
        [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in want]
    drafts, _, accepted = engine.engine.spec_decode_counts
    assert accepted > 0
    # The random model's sampled distribution is near uniform: its guesses are checked (and
    # rejected), the samples still get every token.
    sampled = SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True, n=2)
    for output in engine.generate(prompts, sampled, use_tqdm=False):
        assert [len(o.token_ids) for o in output.outputs] == [30, 30]
    assert engine.engine.spec_decode_counts[0] > drafts
    assert_engine_empty(engine.engine)


def test_constrained_requests_speculate_with_outputs_unchanged(tiny_folder):
    """Requests with a grammar speculate: greedy outputs token for token as without
    speculation (each proposed token taken only where the grammar allows it, each row masked by
    the grammar's state after the tokens before it, the grammar's end inside a step's proposals
    ending the request there), proposed tokens accepted, and sampled outputs match their
    grammar and end with it, leaving no KV blocks held."""
    import re

    from treadle.core.sampling_params import StructuredOutputsParams
    from treadle.llm import LLM

    patterns = [r"(ab ){6}", r"(ab, ){3}[a-z ]{1,20}\.", r"(yes|no) (yes|no) (yes|no) (yes|no)"]
    prompts = ["Say it again and again:", "The list is"] * len(patterns)

    def params(temperature: float) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=40, temperature=temperature, top_p=0.9,
                               ignore_eos=True, structured_outputs=StructuredOutputsParams(
                                   regex=pattern))
                for pattern in patterns for _ in range(2)]

    plain = LLM(str(tiny_folder), dtype="float32", quantization="none")
    want = plain.generate(prompts, params(0.0), use_tqdm=False)
    llm = LLM(str(tiny_folder), dtype="float32", quantization="none", speculative_config=SPEC)
    got = llm.generate(prompts, params(0.0), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == \
        [list(o.outputs[0].token_ids) for o in want]
    drafts, _, accepted = llm.engine.spec_decode_counts
    assert drafts > 0 and accepted > 0
    sampled = llm.generate(prompts, params(1.0), use_tqdm=False)
    for output, pattern in zip(sampled, [p for p in patterns for _ in range(2)], strict=True):
        [sample] = output.outputs
        assert re.fullmatch(pattern, sample.text) and sample.finish_reason == "stop", \
            (pattern, sample.text)
    assert llm.engine.spec_decode_counts[0] > drafts
    assert_engine_empty(llm.engine)


def test_metrics_count_speculative_tokens_with_vllms_names():
    from treadle.observability.metrics import ServerMetrics

    metrics = ServerMetrics("m", 4)
    metrics.observe_spec_decode((2, 8, 5), (2, 2, 1, 0))
    metrics.observe_spec_decode((3, 12, 6), (3, 2, 1, 0))
    text = metrics.render().decode()
    for name, value in (("drafts", 3), ("draft_tokens", 12), ("accepted_tokens", 6)):
        assert f'treadle:spec_decode_num_{name}_total{{model_name="m"}} {value}.0' in text
    for position, value in enumerate((3, 2, 1)):
        assert ('treadle:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
                f'position="{position}"}} {value}.0') in text


def test_accepted_per_position_counts_each_proposals_accepted_prefix(tiny_model):
    """Position i counts the proposals whose first i + 1 tokens were accepted: so the counts
    fall with the position, the first is at most the proposals and they sum to the accepted
    tokens; the requests' own counts add up to the engine's."""
    prompts = repetitive_prompts(2)
    engine = make_engine(tiny_model, None)
    expected = run(engine, prompts, GREEDY)
    engine = with_oracle(make_engine(tiny_model, SPEC), prompts, expected)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    finished = []  # each request's own counts, as explain reports them
    while engine.has_unfinished_requests():
        finished += [out.stats for out in engine.step() if out.finished]
    drafts, draft_tokens, accepted = engine.spec_decode_counts
    assert sum(s.draft_tokens for s in finished) == draft_tokens
    assert sum(s.accepted_tokens for s in finished) == accepted
    per_position = engine.spec_decode_accepted_per_position
    assert len(per_position) == SPEC["num_speculative_tokens"]
    assert sum(per_position) == accepted > 0
    assert drafts >= per_position[0] and list(per_position) == sorted(per_position, reverse=True)
    assert per_position[-1] > 0  # the oracle's every other proposal is right to its end

