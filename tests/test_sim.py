"""`treadle sim`: the production scheduler in virtual time. The sim forms the same batches as
EngineCore on a tiny model; its clock only moves forward; every request ends once; replicas
split load; the step-time fit recovers known coefficients; traces and bench-serve reports
convert; the CLI compares policies side by side. Speed at 10,000 requests is printed."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, assert_engine_empty
from model_utils import build_tiny_model

from treadle.bench.metrics import RequestRecord
from treadle.bench.workloads import sharegpt_lengths
from treadle.cli import main
from treadle.config import CacheConfig, EngineConfig, ModelConfig
from treadle.core.engine_core import EngineCore
from treadle.core.sampling_params import SamplingParams
from treadle.model.loader import read_spec
from treadle.model.source import resolve_model
from treadle.sim.profile import (
    DEFAULT_PROFILE,
    FEATURES,
    StepProfile,
    fit_profile,
    shared_decode_context,
    step_features,
)
from treadle.sim.report import jain_index, summarize
from treadle.sim.settings import SimSettings
from treadle.sim.simulator import simulate
from treadle.sim.workload import (
    SimRequest,
    from_bench_serve,
    read_trace,
    unique_prompt,
    write_trace,
)

PROFILE = StepProfile({"const": 0.01, "prefill_tokens": 1e-4, "decode_seqs": 5e-4,
                       "decode_context": 1e-6, "prefill_attention": 1e-6})


def record_batches(engine) -> list[list[tuple[str, int, int]]]:
    """Each batch an EngineCore's scheduler forms from now on, as (request id, computed
    tokens, new tokens) rows; an empty list for a step that ran nothing."""
    batches = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        output = schedule()
        batches.append([(s.request.request_id, s.num_computed_tokens, s.num_new_tokens)
                        for s in output.scheduled])
        return output

    engine.scheduler.schedule = recording_schedule
    return batches

def workload(n: int, rate: float, seed: int = 0, tenants: int = 1) -> list[SimRequest]:
    rng = random.Random(seed)
    hist = sharegpt_lengths()
    t, requests = 0.0, []
    for i in range(n):
        prompt_len, output_len = hist.sample(rng)
        requests.append(SimRequest(t, unique_prompt(i, prompt_len), output_len,
                                   tenant=f"t{i % tenants}", priority=i % 3, ttft=2.0))
        t += rng.expovariate(rate)
    return requests


# Sim against the engine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", folder)
    return folder


def engine_requests() -> list[SimRequest]:
    """Shared prefixes (prefix hits), long prompts (chunked prefill), tenants and priorities.
    Arrivals before the first step, increasing (so keys never tie), as the engine's
    time.monotonic() arrival times of requests added before it steps."""
    rng = random.Random(1)
    system = [rng.randrange(3, 256) for _ in range(12)]
    requests = []
    for i in range(12):
        own = [rng.randrange(3, 256) for _ in range(rng.randint(2, 40))]
        prompt = system + own if i % 3 == 0 else own
        requests.append(SimRequest(-1.0 + i * 1e-6, prompt, rng.randint(1, 24),
                                   tenant=f"t{i % 2}", priority=rng.randint(0, 2)))
    return requests


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_sim_forms_the_engines_batches(tiny_model, policy):
    """The same requests through EngineCore (the tiny model) and through the sim: the same
    batches step for step (who, from which position, how many tokens), the same preemptions.
    A small cache forces preemption; a small budget forces chunked prefill."""
    requests = engine_requests()
    settings = SimSettings(policy=policy, max_num_batched_tokens=24, max_num_seqs=6,
                           long_prefill_token_threshold=16, max_num_partial_prefills=2,
                           block_size=4, num_blocks=40, max_model_len=256,
                           attention_break_even=read_spec(tiny_model).attention_break_even())
    engine = EngineCore(EngineConfig(ModelConfig(model=str(tiny_model), dtype="float32"),
                                     CacheConfig(block_size=4, num_blocks=40),
                                     settings.engine.scheduler, policy=policy))
    engine_batches = record_batches(engine)
    for i, r in enumerate(requests):
        engine.add_request(str(i), r.prompt_token_ids,
                           SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                           priority=r.priority, tenant=r.tenant)
    outputs: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = outputs.get(o.request_id, 0) + len(o.new_token_ids)
    assert_engine_empty(engine)

    result = simulate(requests, settings, StepProfile.constant(0.01), record_batches=True,
                      check_invariants=True)
    sim_batches = result.batches[0]
    engine_batches = [b for b in engine_batches if b]
    assert len(sim_batches) == len(engine_batches)
    assert sim_batches == engine_batches
    assert result.num_preemptions == engine.scheduler.num_preemptions
    assert policy != "fcfs" or result.num_preemptions > 0  # the cache was tight
    assert any(n > 1 and start > 0 for b in sim_batches for _, start, n in b)  # chunks, hits
    assert [t.num_output_tokens for t in result.timelines] == \
        [outputs[str(i)] for i in range(len(requests))] == [r.output_len for r in requests]
    print(f"\n{policy}: {len(sim_batches)} identical steps, "
          f"{sum(n for b in sim_batches for *_, n in b)} tokens, "
          f"{result.num_preemptions} preemptions")


# The virtual clock and the requests' lives


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair", "deadline"])
def test_clock_moves_forward_and_every_request_ends_once(policy):
    requests = workload(300, rate=40.0, tenants=3)
    settings = SimSettings(policy=policy, num_blocks=600, max_queue_wait=30.0)
    result = simulate(requests, settings, PROFILE, check_invariants=True)
    steps = result.steps[0]
    for a, b in zip(steps, steps[1:], strict=False):
        assert a.duration > 0 and a.start + a.duration <= b.start + 1e-12
    assert sorted(t.index for t in result.timelines) == list(range(len(requests)))
    for r, t in zip(requests, result.timelines, strict=True):
        assert t.finished is not None and t.finished >= r.arrival
        if t.finish_reason == "length":
            assert r.arrival <= t.scheduled < t.first_token <= t.finished
            assert t.num_output_tokens == r.output_len and len(t.itl) == r.output_len - 1
        else:  # deadline admission refuses what it predicts late, as the engine does
            refused = ("deadline",) if policy == "deadline" else ()
            assert t.finish_reason in ("queue_timeout", *refused) and t.scheduled is None
    report = summarize(result, {"ttft": 2000})
    assert report["successful"] + report["failed"] == len(requests)
    assert report["preemptions"] == result.num_preemptions > 0
    assert set(report["tenants"]) == {"t0", "t1", "t2"} and 0 < report["jain_index"] <= 1
    assert 0 < report["kv_usage"]["peak"] <= 1 and len(report["kv_usage"]["over_time"]) == 50


def test_requests_the_engine_would_refuse_fail_alone():
    requests = [SimRequest(0.0, unique_prompt(0, 100), 10),
                SimRequest(0.0, unique_prompt(1, 5000), 10)]  # more than the cache holds
    result = simulate(requests, SimSettings(num_blocks=64), PROFILE)
    assert [t.finish_reason for t in result.timelines] == ["length", "rejected"]
    assert "KV cache blocks" in result.rejected[1]


def test_deadline_admission_refuses_an_unreachable_tpot_as_the_engine_does():
    """Sixty requests decoding: a step costs 10 ms + 60 * 0.5 ms (and context) in the profile,
    so a newcomer's 20 ms TPOT is out of reach and refused at arrival, by the scheduler's own
    refusal; a 1 s TPOT is admitted, and under fcfs nothing is refused."""
    requests = [SimRequest(0.0, unique_prompt(i, 8), 200) for i in range(60)]
    requests += [SimRequest(1.0, unique_prompt(60, 8), 10, tpot=0.020),
                 SimRequest(1.0, unique_prompt(61, 8), 10, tpot=1.0)]
    result = simulate(requests, SimSettings(policy="deadline"), PROFILE)
    reasons = [t.finish_reason for t in result.timelines]
    assert reasons == ["length"] * 60 + ["deadline", "length"]
    assert list(result.rejected) == [60]
    assert result.rejected[60].startswith("the TPOT objective of 20 ms cannot be met")
    assert "with 61 requests decoding" in result.rejected[60]
    fcfs = simulate(requests, SimSettings(policy="fcfs"), PROFILE)
    assert [t.finish_reason for t in fcfs.timelines] == ["length"] * 62


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_the_default_kv_cache_holds_the_blocks_the_engines_memory_model_counts(kv_cache_dtype,
                                                                             block_size):
    """The sim sizes a replica's cache in bytes for the default model as the engine does
    (model/memory.py, bfloat16 or int8 with its scales): an int8 cache holds 1.88x the
    blocks."""
    from treadle.model.loader import read_spec
    from treadle.model.memory import kv_bytes_per_token
    from treadle.model.source import resolve_model

    per_token = kv_bytes_per_token(read_spec(resolve_model(None).folder),
                                   "bfloat16" if kv_cache_dtype == "auto" else kv_cache_dtype)
    settings = SimSettings(kv_cache_memory=2.0, kv_cache_dtype=kv_cache_dtype,
                           block_size=block_size)
    assert settings.engine.cache.num_blocks == (2 << 30) // (block_size * per_token)
    assert settings.engine.cache.kv_cache_dtype == kv_cache_dtype


def test_speculation_runs_the_engines_rule_at_the_acceptance_rate_given():
    """Two requests decode alone (the engine's speculator proposes for them, up to 4 tokens,
    its draft length adapting): every proposal accepted, a decode step yields up to 5 tokens;
    none accepted, one token a step as without speculation, each step paying for one proposed
    token (after a rejection the draft is the accepted count plus one); in between, as many
    accepted per proposal as the chance gives. Outputs are whole either way."""
    requests = [SimRequest(0.0, unique_prompt(i, 40), 300) for i in range(2)]
    spec = {"method": "ngram", "num_speculative_tokens": 4}

    def run(**settings) -> tuple[int, list[int]]:
        result = simulate(requests, SimSettings(**settings), PROFILE)
        assert [t.num_output_tokens for t in result.timelines] == [300, 300]
        return len(result.steps[0]), result

    plain_steps, _ = run()
    full_steps, _ = run(speculative_config=spec, spec_acceptance=1.0)
    none_steps, none = run(speculative_config=spec, spec_acceptance=0.0)
    assert none_steps == plain_steps and full_steps < plain_steps / 4
    assert sum(s.duration for s in none.steps[0]) > 1.01 * sum(
        s.duration for s in simulate(requests, SimSettings(), PROFILE).steps[0])
    half_steps, _ = run(speculative_config=spec, spec_acceptance=0.5)
    # Drafts of 1-4 tokens: accepted per proposal between 0.5 (one token) and 0.94 (four).
    assert plain_steps / 1.94 < half_steps < plain_steps / 1.5


def test_replicas_split_the_load():
    requests = workload(400, rate=200.0)
    one = summarize(simulate(requests, SimSettings(num_blocks=800), PROFILE))
    rr = summarize(simulate(requests, SimSettings(num_blocks=800, replicas=4), PROFILE))
    least = summarize(simulate(requests, SimSettings(num_blocks=800, replicas=4,
                                                     router="least-load"), PROFILE))
    assert rr["per_replica_requests"] == [100] * 4
    assert sum(least["per_replica_requests"]) == 400 and min(least["per_replica_requests"]) > 60
    assert rr["duration_s"] < one["duration_s"] / 2  # overloaded alone: four drain it faster
    assert rr["ttft_ms"]["median"] < one["ttft_ms"]["median"]
    # Prefix affinity (the server's router): requests sharing their first blocks meet on one
    # replica while it is not a step's token budget more loaded than the others.
    shared = [SimRequest(i * 0.01, [5] * 32 + unique_prompt(i, 8), 4) for i in range(10)]
    result = simulate(shared, SimSettings(replicas=3, router="prefix"), PROFILE)
    assert len({t.replica for t in result.timelines}) == 1
    assert summarize(result)["cached_prompt_tokens"] > 0


# The step-time profile


@pytest.mark.parametrize("gemv_rows", [None, 4])
def test_profile_fit_recovers_known_coefficients(tmp_path, gemv_rows):
    """Float weights (one regime) and quantized ones (up to 4 rows on the integer kernel, each
    row dearer; above, the dense copy's fixed cost)."""
    rng = np.random.default_rng(0)
    truth = dict(zip(FEATURES, [0.02, 3e-4, 1e-3, 2e-6, 5e-5, 0.0, 0.0, 0.0, 0.0, 0.0],
                     strict=True))  # the LoRA terms: fitted apart (bench steps)
    if gemv_rows:
        truth |= {"const": 0.01, "integer_rows": 4e-3, "dense_weights": 0.03,
                  "shared_context": 5e-7}

    def sample():
        p, d, c = rng.integers(0, 512), rng.integers(0, 64), rng.integers(16, 1024)
        if rng.random() < 0.3:  # a few decodes alone: the integer kernel's steps
            p, d = 0, rng.integers(1, 7)
        chunks = ([(c, int(p))] if p > 1 else []) + [(int(c), 1)] * int(d) or [(0, 2)]
        # Some steps' decodes share a prefix: all but the first read it from cache.
        shared = int(c // 16 * 16 * (d - 1)) if gemv_rows and d > 1 and rng.random() < 0.3 \
            else 0
        features = step_features(chunks, gemv_rows, shared)
        seconds = sum(truth[f] * x for f, x in zip(FEATURES, features, strict=True))
        return features, seconds * (1 + rng.normal(0, 0.01))

    profile = fit_profile([sample() for _ in range(200)], [sample() for _ in range(50)],
                          model="synthetic", gemv_rows=gemv_rows)
    for name, value in truth.items():
        assert profile.coefficients[name] == pytest.approx(value, rel=0.1, abs=1e-9), name
    assert profile.fit["held_out_error"]["mean_rel"] < 0.02
    profile.save(tmp_path / "p.json")
    loaded = StepProfile.load(tmp_path / "p.json")
    assert loaded.coefficients == profile.coefficients and loaded.model == "synthetic"
    assert loaded.gemv_rows == gemv_rows
    one, five = [(300, 1)], [(300, 1)] * 5
    assert loaded.predict_chunks(one) == pytest.approx(
        sum(truth[f] * x for f, x in zip(FEATURES, step_features(one, gemv_rows), strict=True)),
        rel=0.05)
    if gemv_rows:  # five decodes cross to the dense path: its fixed cost, not five int rows
        assert step_features(five, gemv_rows)[5:7] == [0.0, 1.0]


def test_bench_steps_shares_a_prefix_the_way_the_simulator_counts_it():
    """`bench steps`' shared-prefix steps: the decodes' full context blocks are the first
    decode's, each writes its own last block; `shared_decode_context` counts the context read
    again, as the simulator counts it from the scheduler's block tables."""
    from treadle.sim.steps import BLOCK_SIZE, shared_of, step_input

    alone, shared = step_input(32, 4, 100), step_input(32, 4, 100, shared=True)
    assert shared_of(alone) == 0
    full = (100 - 1) // BLOCK_SIZE  # full blocks before each decode's new token
    assert shared_of(shared) == 3 * full * BLOCK_SIZE
    decodes = [s for s in shared.sequences if len(s.token_ids) == 1]
    assert all(s.block_table[:full] == decodes[0].block_table[:full] for s in decodes)
    assert len({s.block_table[full] for s in decodes}) == 4  # where each writes: its own
    prefill_blocks = set(shared.sequences[0].block_table)
    assert not prefill_blocks & {b for s in decodes for b in s.block_table}
    assert shared_decode_context([(40, [1, 2, 3]), (40, [1, 2, 9]), (10, [1, 5])], 16) == 32


def test_the_shipped_default_profile_loads():
    profile = StepProfile.load()
    assert profile.machine["cpu"] and profile.fit["held_out_error"]["mean_rel"] < 1
    decode_32 = profile.predict_chunks([(256, 1)] * 32)
    assert 0 < profile.predict_chunks([(256, 1)]) < decode_32 < \
        profile.predict_chunks([(0, 512)] + [(256, 1)] * 32)


def test_a_profile_fitted_before_shared_context_counts_it_as_decode_context(tmp_path):
    """A profile saved before shared_context was split out has no coefficient for it: context
    that decodes share costs what any decode context costs there, not nothing."""
    saved = json.loads(DEFAULT_PROFILE.read_text())
    del saved["coefficients"]["shared_context"]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    profile = StepProfile.load(tmp_path / "old.json")
    assert profile.coefficients["shared_context"] == profile.coefficients["decode_context"]
    chunks = [(256, 1)] * 8
    assert profile.predict_chunks(chunks, shared_context=7 * 256) == \
        pytest.approx(profile.predict_chunks(chunks))


# Workload inputs


def test_trace_jsonl_round_trip(tmp_path):
    requests = workload(20, rate=5.0, tenants=2)
    requests[3].tpot, requests[4].priority = 0.05, 7
    write_trace(requests, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == requests
    write_trace(requests, tmp_path / "lengths.jsonl", with_ids=False)
    back = read_trace(tmp_path / "lengths.jsonl")
    assert [(r.arrival, r.prompt_len, r.output_len, r.tenant) for r in back] == \
        [(r.arrival, r.prompt_len, r.output_len, r.tenant) for r in requests]
    (tmp_path / "bad.jsonl").write_text('{"arrival": 0, "output_len": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_trace(tmp_path / "bad.jsonl")


def bench_report() -> dict:
    records = [RequestRecord(start=0.5, prompt_tokens=40, success=True, output_tokens=8,
                             ttft=0.1, e2e=0.5),
               RequestRecord(start=0.0, prompt_tokens=30, success=True, output_tokens=16,
                             ttft=0.1, e2e=0.9),
               RequestRecord(start=0.7, prompt_tokens=20, error="HTTP 400: no")]
    return {"model": "m", "runs": [{"request_rate": 4.0,
                                    "requests": [r.as_dict() for r in records]}]}


def test_bench_serve_report_converts_to_a_replay(tmp_path, capsys):
    requests = from_bench_serve(bench_report())
    assert [(r.arrival, r.prompt_len, r.output_len) for r in requests] == \
        [(0.0, 30, 16), (0.5, 40, 8)]  # by send time; the failed one left out
    assert requests[0].prompt_token_ids[0] != requests[1].prompt_token_ids[0]
    with pytest.raises(ValueError, match="run 3"):
        from_bench_serve(bench_report(), run=3)
    (tmp_path / "report.json").write_text(json.dumps(bench_report()))
    out = tmp_path / "sim.json"
    assert main(["sim", "--workload", "bench-json", "--trace", str(tmp_path / "report.json"),
                 "--policy", "fcfs,fair", "--json", str(out), "--per-request",
                 "--save-trace", str(tmp_path / "replay.jsonl")]) == 0
    printed = capsys.readouterr().out
    assert "fcfs" in printed and "fair" in printed and "TTFT p99 (ms)" in printed
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["fcfs", "fair"]
    assert runs[0]["successful"] == 2 and len(runs[0]["requests"]) == 2
    assert len(read_trace(tmp_path / "replay.jsonl")) == 2


def test_cli_sweeps_a_setting(tmp_path, capsys):
    write_trace(workload(60, rate=20.0), tmp_path / "t.jsonl")
    assert main(["sim", "--workload", "trace", "--trace", str(tmp_path / "t.jsonl"),
                 "--sweep", "max_num_batched_tokens=128,1024", "--replicas", "2",
                 "--router", "least-load", "--json", str(tmp_path / "o.json"),
                 "--plot", str(tmp_path / "plots")]) == 0
    runs = json.loads((tmp_path / "o.json").read_text())["runs"]
    assert [r["settings"]["max_num_batched_tokens"] for r in runs] == [128, 1024]
    assert "max_num_batched_tokens=128" in capsys.readouterr().out
    for name in ("trade_off.png", "kv_usage.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(b"\x89PNG")
    assert main(["sim", "--workload", "trace", "--trace", str(tmp_path / "t.jsonl"),
                 "--sweep", "nope=1"]) == 2


def test_the_sim_and_the_parser_never_import_torch():
    """`treadle sim` (the parser of every command built, and a run) and serve's config stay
    torch-free: `bench steps`, which times the model, keeps torch to itself."""
    code = ("import sys; from treadle.cli import build_parser, main, serve_config; "
            "assert main(['sim', '--num-prompts', '5']) == 0; "
            "serve_config(build_parser().parse_args(['serve'])); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_jain_index():
    assert jain_index([5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([]) is None


# Speed (printed, not asserted)


@pytest.mark.slow  # 46 s on the 2.0 GHz Xeon: a measurement, kept out of CI's 20 minutes
def test_speed_of_ten_thousand_requests():
    requests = workload(10_000, rate=8.0, tenants=4)
    result = simulate(requests, SimSettings(policy="fair"), StepProfile.load())
    report = summarize(result)
    assert report["successful"] == 10_000
    print(f"\n10,000 requests (synthetic-chat lengths, 8 req/s, fair, default profile): "
          f"{result.wall_s:.1f} s to simulate {report['duration_s']:.0f} virtual s "
          f"({report['speedup_vs_real_time']:.0f}x real time), {report['steps']} steps")


def test_bench_steps_adds_the_engines_own_work_to_the_model_pass(tiny_folder):
    """The grid times the model pass; the engine core's own work per step (scheduling,
    sampling, updating requests), timed on its steps, is added to the profile: a served step
    costs both."""
    from treadle.sim.steps import OVERHEAD_DECODES, bench_steps, format_steps

    report = bench_steps(str(tiny_folder), "float32", "none", [0, 8], [0, 1, 2], [8],
                         repeats=1, held_out=2, progress=False)
    profile, overhead = report["profile"], report["profile"].fit["engine_overhead_s"]
    # Each fitted term alone may come out 0 on a busy machine; the line over the measured
    # steps, whose engine work is never free, cannot (both terms are clamped at 0).
    assert overhead["per_step"] >= 0 and overhead["per_decode"] >= 0
    assert overhead["per_step"] + overhead["per_decode"] * max(OVERHEAD_DECODES) > 0
    for row in report["rows"]:  # "predicted": the model pass alone, as the rows measured it
        assert profile.predict(row["features"]) == pytest.approx(
            row["predicted"] + overhead["per_step"] + overhead["per_decode"]
            * row["decode_seqs"])
    assert "the engine's work beside the model pass" in format_steps(report)


def test_the_sim_s_attention_break_even_is_the_default_model_s():
    assert SimSettings().options.attention_break_even == \
        read_spec(resolve_model(None).folder).attention_break_even()
