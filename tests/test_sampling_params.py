"""SamplingParams validates itself: every bad value is a ValueError that names its field and the
allowed range; good values are kept (and normalized where documented)."""

from __future__ import annotations

import math

import pytest

from treadle.core.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (None, 16, 0, [], [])
    assert (p.include_stop_str_in_output, p.ignore_eos, p.skip_special_tokens) == (False, False,
                                                                                  True)
    assert (p.logprobs, p.prompt_logprobs, p.logit_bias) == (None, None, {})


@pytest.mark.parametrize("good", [
    {"n": 4}, {"temperature": 0}, {"temperature": 2}, {"temperature": 7.5}, {"top_p": 1e-6},
    {"top_p": 1}, {"top_k": 1}, {"top_k": 100_000}, {"min_p": 0}, {"min_p": 1},
    {"presence_penalty": -2}, {"presence_penalty": 2}, {"frequency_penalty": -2},
    {"frequency_penalty": 2}, {"repetition_penalty": 1e-3}, {"repetition_penalty": 10},
    {"seed": 0}, {"seed": 2**64 - 1}, {"max_tokens": 1}, {"min_tokens": 16},
    {"stop": ["a", "bc"]}, {"stop": []}, {"stop": None}, {"stop_token_ids": [0, 7]},
    {"include_stop_str_in_output": True}, {"ignore_eos": True}, {"logprobs": 0},
    {"logprobs": 20}, {"prompt_logprobs": 0}, {"prompt_logprobs": 20},
    {"logit_bias": {0: -100, 5: 100, 9: 0.5}}, {"logit_bias": None},
    {"skip_special_tokens": False},
])
def test_accepts_values_in_range(good):
    params = SamplingParams(**good)
    for name, value in good.items():
        if value is not None:
            assert getattr(params, name) == value


def test_normalizes_documented_forms():
    p = SamplingParams(stop="END", logit_bias={"42": 1, 7: -2.5}, temperature=1,
                       stop_token_ids=(3, 4))
    assert p.stop == ["END"] and p.stop_token_ids == [3, 4]
    assert p.logit_bias == {42: 1.0, 7: -2.5}
    assert isinstance(p.temperature, float)
    # As in vLLM: a temperature in (0, 0.01) is raised to 0.01 instead of overflowing.
    assert SamplingParams(temperature=1e-9).temperature == 0.01


BAD = [
    ("n", 0), ("n", -1), ("n", 129), ("n", 1.5), ("n", "2"), ("n", True), ("n", None),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", math.nan),
    ("temperature", math.inf), ("temperature", None), ("temperature", True),
    ("top_p", 0), ("top_p", -0.1), ("top_p", 1.01), ("top_p", math.nan), ("top_p", "1"),
    ("top_k", 0), ("top_k", -2), ("top_k", 1.5), ("top_k", -1.0), ("top_k", True), ("top_k", "5"),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", math.nan), ("min_p", "0"),
    ("presence_penalty", -2.01), ("presence_penalty", 2.01), ("presence_penalty", math.nan),
    ("presence_penalty", "x"),
    ("frequency_penalty", -2.01), ("frequency_penalty", 2.01), ("frequency_penalty", math.inf),
    ("frequency_penalty", [1]),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan), ("repetition_penalty", "1"),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("seed", "42"), ("seed", True),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", None),
    ("max_tokens", "16"), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.5), ("min_tokens", True),
    ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", ["a", None]), ("stop", 5),
    ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", "1"),
    ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("include_stop_str_in_output", 1), ("include_stop_str_in_output", "yes"),
    ("include_stop_str_in_output", None),
    ("ignore_eos", 1), ("ignore_eos", "true"),
    ("logprobs", -1), ("logprobs", 1.5), ("logprobs", True),
    ("logprobs", "5"),
    ("prompt_logprobs", -1), ("prompt_logprobs", 2.0),
    ("prompt_logprobs", False),
    ("logit_bias", {5: 100.5}), ("logit_bias", {5: -101}), ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: "1"}), ("logit_bias", {5: None}), ("logit_bias", {-1: 1}),
    ("logit_bias", {"x": 1}), ("logit_bias", {"-3": 1}), ("logit_bias", {1.5: 1}),
    ("logit_bias", {True: 1}), ("logit_bias", [1]),
    ("skip_special_tokens", 0), ("skip_special_tokens", None), ("skip_special_tokens", "no"),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_rejects_bad_values_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^{name}\b.* must be .+, got "):
        SamplingParams(**{name: value})


def test_greedy_allows_one_sequence_only():
    # vLLM rejects n > 1 with greedy sampling: the n outputs would be equal.
    with pytest.raises(ValueError, match="^n must be 1 when temperature is 0"):
        SamplingParams(n=2, temperature=0)
