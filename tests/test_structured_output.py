"""Structured output: the sampler's bitmask against llguidance's own numpy reference; regex,
choice and grammar constraints on a tiny random model (a random model follows any grammar only
because the mask makes it); constrained and free requests in one batch; the server's fields
(response_format, structured_outputs, guided_*) and their 400s; and 20 JSON schemas on the
default model, every output valid under `jsonschema`, greedy and sampled."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import openai
import pytest
import torch
from conftest import assert_engine_empty
from frontends import start_frontends, stop_frontends, wait_started

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.core.sampler import apply_token_bitmask
from treadle.core.sampling_params import SamplingParams, StructuredOutputsParams
from treadle.core.structured_output import StructuredOutputManager
from treadle.frontend.async_engine import AsyncEngine
from treadle.llm import LLM

SCHEMAS = json.loads((Path(__file__).parent / "data" / "structured_output_schemas.json")
                     .read_text())
ORDER = {"type": "object", "properties": {"status": {"enum": ["ok", "error", "pending"]},
                                          "code": {"type": "integer", "minimum": 100,
                                                   "maximum": 599}},
         "required": ["status", "code"], "additionalProperties": False}


def test_bitmask_matches_llguidances_reference() -> None:
    """Random masks, two rows unconstrained (all ones), a vocabulary not a multiple of 32."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 100, 5
    logits = torch.randn(rows, vocab, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, 4), dtype=torch.int32,
                            generator=generator)
    bitmask[1] = bitmask[3] = -1
    expected = logits.numpy().copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, bitmask.numpy())
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.equal(masked, torch.from_numpy(expected))
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])
    assert apply_token_bitmask(logits, torch.full((rows, 4), -1, dtype=torch.int32)) is logits


def test_params_are_checked() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a list of non-empty strings"):
        StructuredOutputsParams(choice=[""])
    with pytest.raises(ValueError, match="at most 65536 characters"):
        StructuredOutputsParams(regex="a" * 70000)


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder: Path) -> LLM:
    return LLM(str(tiny_folder), dtype="float32", quantization="none",
               kv_cache_memory_bytes=16 << 20)


GRAMMAR = 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]{1,3}/'
CONSTRAINTS = [  # (constraint, a Python regex every output must match)
    (StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{2}"), r"[a-z]{2,5}-\d{2}"),
    (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), r"yes|no|maybe so"),
    (StructuredOutputsParams(grammar=GRAMMAR), r"\(\d{1,3}(\+\d{1,3})?\)"),
]


def test_regex_choice_and_grammar_on_a_random_model(tiny_llm: LLM) -> None:
    """ignore_eos: the grammar's end, not EOS, ends each request."""
    prompts, params, patterns = [], [], []
    for constraint, pattern in CONSTRAINTS:
        for temperature in (0.0, 1.0):
            prompts.append("The answer is")
            params.append(SamplingParams(temperature=temperature, seed=1, max_tokens=24,
                                         ignore_eos=True, structured_outputs=constraint))
            patterns.append(pattern)
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    for output, pattern in zip(outputs, patterns, strict=True):
        [sample] = output.outputs
        assert re.fullmatch(pattern, sample.text), (pattern, sample.text)
        assert sample.finish_reason == "stop"
    assert_engine_empty(tiny_llm.engine)


def test_free_requests_are_unchanged_by_constrained_neighbours(tiny_llm: LLM) -> None:
    free = ["Once upon a time", "The sea is", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = tiny_llm.generate(free, greedy, use_tqdm=False)
    constrained = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                  structured_outputs=c) for c, _ in CONSTRAINTS]
    mixed = tiny_llm.generate([p for pair in zip(free, free, strict=True) for p in pair],
                              [p for pair in zip([greedy] * 3, constrained, strict=True)
                               for p in pair], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == [o.outputs[0].token_ids
                                                            for o in alone]
    for output, (_, pattern) in zip(mixed[1::2], CONSTRAINTS, strict=True):
        assert re.fullmatch(pattern, output.outputs[0].text)


def test_a_grammar_the_engine_cannot_compile_ends_its_request_only(tiny_llm: LLM) -> None:
    """The frontend refuses it first (a 400); offline, the request ends with an error and
    the others go on."""
    outputs = tiny_llm.generate(["a", "b"], [
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-")),
        SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "length"]
    assert_engine_empty(tiny_llm.engine)
    assert not tiny_llm.engine.compiling


def test_abort_while_compiling_leaves_nothing(tiny_llm: LLM) -> None:
    core = tiny_llm.engine
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"never": {"type": "string"}}}))
    core.add_request("compiling", [1, 2, 3], params)
    assert core.has_unfinished_requests()
    assert core.abort_request("compiling")
    assert not core.has_unfinished_requests() and not core.compiling
    assert_engine_empty(core)


# The server on a tiny model: fields, shapes and refusals.

@pytest.fixture(scope="module")
def server(tiny_folder: Path) -> Iterator[str]:
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", kv_cache_memory_bytes=16 << 20)))
    frontends, thread = start_frontends(engine, ServerConfig(port=0))
    try:
        wait_started(frontends, thread)
        yield f"http://127.0.0.1:{frontends.port}"
    finally:
        stop_frontends(frontends, thread)


def test_response_format_json_schema_through_the_client(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    response_format = {"type": "json_schema", "json_schema": {
        "name": "order", "schema": ORDER, "strict": True}}
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}],
        max_tokens=32, temperature=1.0, seed=5, response_format=response_format)
    jsonschema.validate(json.loads(chat.choices[0].message.content), ORDER)
    stream = client.completions.create(model=chat.model, prompt="Order:", max_tokens=32,
                                       stream=True, extra_body={"response_format":
                                                                response_format})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream)), ORDER)


@pytest.mark.parametrize(("field", "value", "pattern"), [
    # [0-9], not \d: llguidance's \d admits digits of scripts newer than Python's Unicode
    # tables (a sampled U+1CCF7 failed re's \d).
    ("structured_outputs", {"regex": r"[0-9]{3}"}, r"[0-9]{3}"),
    ("structured_outputs", {"choice": ["left", "right"]}, r"left|right"),
    ("guided_regex", r"[A-Z]{4}", r"[A-Z]{4}"),
    ("guided_choice", ["up", "down"], r"up|down"),
    ("guided_grammar", GRAMMAR, r"\(\d{1,3}(\+\d{1,3})?\)"),
    ("guided_json", json.dumps(ORDER), None),
])
def test_vllm_fields(server: str, field: str, value: object, pattern: str | None) -> None:
    response = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 32, "ignore_eos": True, field: value})
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    if pattern is None:
        jsonschema.validate(json.loads(text), ORDER)
    else:
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(unclosed"}}}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_what_cannot_compile_is_a_400_naming_the_field(server: str, body: dict,
                                                      param: str) -> None:
    for path, base in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "x"}]})):
        response = httpx.post(f"{server}{path}", timeout=60, json={**base, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error


# The default model: 20 schemas, greedy and sampled.

def schema_outputs(schemas: list[dict]) -> None:
    """One batch: each schema greedy and sampled, one shared prompt (its prefill cached)."""
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20)
    prompt = llm.chat_prompt("Give an example record as JSON.")
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=96,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i, schema in enumerate(schemas) for temperature in (0.0, 1.0)]
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for i, output in enumerate(outputs):
        [sample] = output.outputs
        assert sample.finish_reason == "stop", sample
        jsonschema.validate(json.loads(sample.text), schemas[i // 2])
    assert_engine_empty(llm.engine)


@pytest.mark.default_model
def test_json_schemas_on_the_default_model() -> None:
    """Nested objects, enums, arrays, bounded numbers, required fields: four of the 20 here
    (the rest under -m slow)."""
    schema_outputs([SCHEMAS[i] for i in (0, 6, 12, 16)])


@pytest.mark.default_model
@pytest.mark.slow
def test_all_json_schemas_on_the_default_model() -> None:
    schema_outputs(SCHEMAS)


@pytest.mark.default_model
@pytest.mark.slow
def test_mask_cost_at_batch_32(capsys: pytest.CaptureFixture) -> None:
    """The per-step cost of structured output at batch 32 on the default model's vocabulary:
    filling the bitmask (llguidance) and applying it (the sampler). Printed, not asserted."""
    from treadle.model.source import resolve_model

    folder = resolve_model(None).folder
    manager = StructuredOutputManager(folder / "tokenizer.json", 49152, [2])
    template = manager.compile(StructuredOutputsParams(json=SCHEMAS[12]))
    matchers = [manager.new_matcher(template) for _ in range(32)]
    tokenizer = llguidance.LLTokenizer(str(folder / "tokenizer.json"))
    for matcher in matchers:  # partway into the JSON, where masks vary
        assert matcher.consume_tokens(tokenizer.tokenize_str('{"items": [{"name": "'))
    logits = torch.randn(32, 49152)
    fill, apply = [], []
    for _ in range(20):
        start = time.perf_counter()
        bitmask = torch.from_numpy(manager.fill_bitmask(matchers))
        middle = time.perf_counter()
        apply_token_bitmask(logits, bitmask)
        fill.append(middle - start)
        apply.append(time.perf_counter() - middle)
    with capsys.disabled():
        # Min and median: on a shared machine the median swings with other processes' load.
        print(f"\nmask per step at batch 32 (min / median of 20): fill {min(fill) * 1e3:.2f} / "
              f"{np.median(fill) * 1e3:.2f} ms, apply {min(apply) * 1e3:.2f} / "
              f"{np.median(apply) * 1e3:.2f} ms")
