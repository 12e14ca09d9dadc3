"""`treadle sim` with LoRA adapters: simulated requests carry their adapter, so the scheduler's
`max_loras` cap acts in virtual time as in the engine (the same batches as EngineCore serving
random adapters on a tiny model); a profile's LoRA terms lengthen exactly the steps with adapter
rows; profiles saved before the terms load with them at 0; `bench steps` fits them."""

from __future__ import annotations

import json
import math

import pytest
from conftest import assert_engine_empty
from model_utils import build_tiny_model, make_runner, preload_adapters
from test_sim import PROFILE, record_batches

from treadle.bench.workloads import draw_adapters
from treadle.cli import main
from treadle.config import CacheConfig, EngineConfig, ModelConfig
from treadle.core.engine_core import EngineCore
from treadle.core.lora_request import LoRARequest
from treadle.core.sampling_params import SamplingParams
from treadle.sim.profile import DEFAULT_PROFILE, LORA_FEATURES, StepProfile
from treadle.sim.report import summarize
from treadle.sim.settings import SimSettings
from treadle.sim.simulator import SimResult, simulate
from treadle.sim.workload import (
    SimRequest,
    from_bench_serve,
    read_trace,
    write_trace,
)


def adapter_requests(names: list[str | None], output_len: int = 6) -> list[SimRequest]:
    """One request per name (None: the base model), all arrived at 0, before the first step
    (so the batches do not depend on the steps' times), queued in the order given."""
    # Token ids a tiny model's vocabulary holds; each prompt's first one its own (no sharing).
    return [SimRequest(0.0, [3 + i] + [7] * (9 + 3 * i), output_len, lora=name)
            for i, name in enumerate(names)]


def adapters_per_step(result: SimResult) -> list[set[str]]:
    """The distinct adapters each recorded step ran rows of."""
    lora = {str(i): r.lora for i, r in enumerate(result.requests)}
    return [{lora[rid] for rid, _, _ in batch if lora[rid] is not None}
            for batch in result.batches[0]]


# The max_loras cap in virtual time


def test_max_loras_holds_the_second_adapters_requests_until_the_first_ends():
    requests = adapter_requests(["a", "a", "a", "b", "b", None])
    results = {cap: simulate(requests, SimSettings(enable_lora=True, max_loras=cap), PROFILE,
                             record_batches=True, check_invariants=True) for cap in (1, 2)}
    one, two = results[1], results[2]
    steps_one = adapters_per_step(one)
    assert max(map(len, steps_one)) == 1 and {"a", "b"} <= set().union(*steps_one)
    assert max(map(len, adapters_per_step(two))) == 2
    assert max(s.num_loras for s in one.steps[0]) == 1
    assert max(s.num_loras for s in two.steps[0]) == 2
    a_ends = max(t.finished for r, t in zip(requests, one.timelines, strict=True)
                 if r.lora == "a")
    for r, t1, t2 in zip(requests, one.timelines, two.timelines, strict=True):
        if r.lora == "b":  # with one adapter at a time, b waits for every a to end
            assert t1.scheduled >= a_ends and t2.scheduled == 0.0
        else:  # the base request and a's are never held back
            assert t1.scheduled == t2.scheduled == 0.0
    report_one, report_two = summarize(one), summarize(two)
    assert report_one["most_loras_in_a_step"] == 1 and report_two["most_loras_in_a_step"] == 2
    assert report_one["adapters"]["b"]["queue_ms"]["median"] >= a_ends * 1e3 > 0
    assert report_two["adapters"]["b"]["queue_ms"]["median"] == 0
    assert report_one["adapters"]["a"]["requests"] == 3 and "None" not in report_one["adapters"]


def test_adapters_need_enable_lora_as_the_engine_does():
    result = simulate(adapter_requests(["a", None]), SimSettings(), PROFILE)
    assert list(result.rejected) == [0] and "--enable-lora" in result.rejected[0]
    assert result.timelines[1].finish_reason == "length"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-lora")
    build_tiny_model("llama", folder)
    return folder


def test_sim_forms_the_engines_batches_with_adapters(tiny_model, tmp_path):
    """EngineCore serving two random adapters under max_loras=1, and the sim on the same
    requests: the same batches step for step."""
    from treadle.sim.steps import write_random_adapter

    requests = adapter_requests(["a", None, "b", "a", "b", None], output_len=5)
    settings = SimSettings(enable_lora=True, max_loras=1, max_num_batched_tokens=24,
                           block_size=4, num_blocks=64, max_model_len=128)
    engine = EngineCore(EngineConfig(ModelConfig(model=str(tiny_model), dtype="float32",
                                                 enable_lora=True, max_lora_rank=4),
                                     CacheConfig(block_size=4, num_blocks=64),
                                     settings.engine.scheduler))
    spec = engine.executor.runner.spec
    loras = {name: LoRARequest(name, i, str(write_random_adapter(tmp_path / name, spec, 4, i)))
             for i, name in enumerate(["a", "b"], start=1)}
    preload_adapters(engine, loras.values())  # the sim models no loading
    engine_batches = record_batches(engine)
    for i, r in enumerate(requests):
        engine.add_request(str(i), r.prompt_token_ids,
                           SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                           lora_request=None if r.lora is None else loras[r.lora])
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_empty(engine)
    result = simulate(requests, settings, StepProfile.constant(0.01), record_batches=True)
    assert result.batches[0] == [b for b in engine_batches if b]
    steps = adapters_per_step(result)
    assert max(map(len, steps)) == 1 and set().union(*steps) == {"a", "b"}


# The profile's LoRA terms


def test_lora_rows_add_exactly_the_fitted_terms_to_their_steps():
    """The same requests with and without adapters (max_loras high enough that the batches are
    the same): each step is longer by per_adapter x its distinct adapters + per_row x its
    adapter rows, counted here from the recorded batches."""
    per_adapter, per_row = 0.003, 2e-4
    profile = StepProfile({**PROFILE.coefficients, "lora_adapters": per_adapter,
                           "lora_rows": per_row})
    names = ["a", None, "b", "a", "c", None, "b"]
    settings = SimSettings(enable_lora=True, max_loras=3, max_num_batched_tokens=32)
    adapted = simulate(adapter_requests(names), settings, profile, record_batches=True)
    base = simulate(adapter_requests([None] * len(names)), settings, profile,
                    record_batches=True)
    assert adapted.batches == base.batches
    lora = dict(enumerate(names))
    expected = []
    for batch in adapted.batches[0]:
        adapters = {lora[int(rid)] for rid, _, _ in batch} - {None}
        rows = sum(n for rid, _, n in batch if lora[int(rid)] is not None)
        expected.append(per_adapter * len(adapters) + per_row * rows)
    extra = [a.duration - b.duration
             for a, b in zip(adapted.steps[0], base.steps[0], strict=True)]
    assert extra == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert max(expected) > per_adapter * 3  # a step ran rows of all three adapters
    chunks = [(0, 12), (30, 1), (40, 1)]
    assert profile.predict_chunks(chunks, 0, 2, 14) - profile.predict_chunks(chunks) == \
        pytest.approx(2 * per_adapter + 14 * per_row)


def test_a_profile_saved_before_the_lora_terms_loads_with_them_at_0(tmp_path):
    saved = json.loads(DEFAULT_PROFILE.read_text())
    for name in LORA_FEATURES:
        saved["coefficients"].pop(name, None)
    (tmp_path / "old.json").write_text(json.dumps(saved))
    profile = StepProfile.load(tmp_path / "old.json")
    assert all(profile.coefficients[name] == 0.0 for name in LORA_FEATURES)
    chunks = [(256, 1)] * 8
    assert profile.predict_chunks(chunks, 0, 4, 8) == profile.predict_chunks(chunks)


def test_random_adapters_move_the_logits(tiny_model, tmp_path):
    """bench steps' adapters run the LoRA path: a step with one differs from the base step."""
    import torch

    from treadle.model.batch import ModelInput, ScheduledSequence
    from treadle.model.lora import check_adapter
    from treadle.sim.steps import with_adapters, write_random_adapter

    runner = make_runner(tiny_model, block_size=4, num_blocks=32, enable_lora=True)
    path = write_random_adapter(tmp_path / "a", runner.spec, 8, seed=0)
    check_adapter(path, 8, runner.spec)
    with pytest.raises(ValueError, match="rank 8"):
        check_adapter(path, 4, runner.spec)
    step = ModelInput([ScheduledSequence(list(range(3, 11)), 0, [0, 1])])
    base = runner.execute(step)
    adapted = runner.execute(with_adapters(step, [path]))
    assert not torch.equal(base, adapted)


def test_bench_steps_fits_the_lora_terms(tiny_folder, tmp_path):
    """On a tiny model, under whatever load: the terms exist and are finite (their size and
    sign are the machine's), and survive a save and load."""
    from treadle.sim.steps import LORA_ADAPTERS, bench_steps, format_steps

    report = bench_steps(str(tiny_folder), "float32", "none", [0, 8], [0, 1, 4], [8],
                         repeats=1, held_out=1, progress=False, lora_rank=4)
    profile = report["profile"]
    fit = profile.fit["lora"]
    assert fit["rank"] == 4
    assert {(s["decode_seqs"], s["adapters"]) for s in fit["steps"]} == \
        {(1, 1), (4, 1), (4, min(4, LORA_ADAPTERS)), (0, 1)}
    assert all(math.isfinite(s["extra_s"]) for s in fit["steps"])
    for name in LORA_FEATURES:
        assert math.isfinite(profile.coefficients[name])
    profile.save(tmp_path / "p.json")
    assert StepProfile.load(tmp_path / "p.json").coefficients == profile.coefficients
    assert "LoRA rows (rank 4" in format_steps(report)


# Workloads and the CLI


def test_trace_and_bench_serve_reports_carry_adapters(tmp_path):
    requests = adapter_requests(["a", None, "b"])
    write_trace(requests, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == requests
    assert '"lora"' not in (tmp_path / "t.jsonl").read_text().splitlines()[1]
    records = [{"start": 0.1 * i, "prompt_tokens": 20, "success": i != 1, "output_tokens": 4}
               for i in range(5)]
    report = {"lora_modules": ["x", "y"], "seed": 3, "runs": [{"requests": records}]}
    drawn = draw_adapters(["x", "y"], 5, 3)
    assert [r.lora for r in from_bench_serve(report)] == [drawn[i] for i in (0, 2, 3, 4)]
    assert all(r.lora is None for r in from_bench_serve({"runs": [{"requests": records}]}))


def test_cli_draws_adapters_and_reports_them(tmp_path, capsys):
    args = ["sim", "--num-prompts", "30", "--lora-modules", "a", "b", "c", "--seed", "2"]
    assert main(args) == 2  # adapters without --enable-lora, as treadle serve refuses them
    assert "--enable-lora" in capsys.readouterr().err
    out = tmp_path / "sim.json"
    assert main([*args, "--enable-lora", "--sweep", "max_loras=1,3", "--json", str(out),
                 "--per-request"]) == 0
    printed = capsys.readouterr().out
    assert "LoRA adapters (at most 1 in a step, --max-loras 1)" in printed
    assert "LoRA adapters (at most 3 in a step, --max-loras 3)" in printed
    runs = json.loads(out.read_text())["runs"]
    drawn = draw_adapters(["a", "b", "c"], 30, 2)
    assert [r["lora"] for r in runs[0]["requests"]] == drawn
    assert {name: a["requests"] for name, a in runs[0]["adapters"].items()} == \
        {name: drawn.count(name) for name in "abc"}
    assert runs[0]["settings"]["enable_lora"] is True
    assert main(["sim", "--workload", "trace", "--trace", str(out), "--lora-modules", "a"]) == 2
