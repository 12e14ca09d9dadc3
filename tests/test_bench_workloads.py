"""Benchmark workloads: the ShareGPT length histogram and the request generators, on a tiny
byte-level BPE tokenizer trained here (no model files), plus one round trip through the default
model's tokenizer."""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import Counter

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from treadle.bench.workloads import (
    SHAREGPT_LENGTHS,
    file_workload,
    random_workload,
    shared_prefix,
    sharegpt_lengths,
    summarize,
    synthetic_chat,
    vocabulary_words,
)


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    rng = random.Random(vocab_size)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 7)))
             for _ in range(400)]
    corpus = [" ".join(rng.choices(words, k=30)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(1200)


def test_histogram_loads_with_its_source():
    raw = json.loads(SHAREGPT_LENGTHS.read_text())
    assert "reconstruction" in raw["source"] and raw["method"] and raw["references"]
    hist = sharegpt_lengths()
    assert hist.source == raw["source"] and hist.max_total_len == 2048
    for marginal, top in ((hist.prompt, 1024), (hist.output, 2044)):
        assert marginal.min_len == 4 and marginal.max_len == top
        for a, b in zip(marginal.bins, marginal.bins[1:], strict=False):
            assert b.lo == a.hi + 1 and a.count > 0
        # the within-bin exponent was fitted so the reconstruction keeps the published mean
        assert marginal.mean() == pytest.approx(marginal.published_mean, rel=0.005)


def test_word_pool_holds_single_word_tokens(tokenizer):
    pool = vocabulary_words(tokenizer)
    assert len(pool) >= 256 and tokenizer.eos_token_id not in pool
    for i in pool[:50]:
        word = tokenizer.decode([i])
        assert word.startswith(" ") and word[1:].isalpha()


def test_synthetic_chat_is_deterministic_for_a_seed(tokenizer):
    a = synthetic_chat(tokenizer, 30, seed=7)
    b = synthetic_chat(tokenizer, 30, seed=7)
    c = synthetic_chat(tokenizer, 30, seed=8)
    assert [(r.prompt_token_ids, r.output_len, r.prompt) for r in a] == \
        [(r.prompt_token_ids, r.output_len, r.prompt) for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    # lengths depend on the seed only, not on the tokenizer
    other = synthetic_chat(tiny_tokenizer(900), 30, seed=7)
    assert [(r.prompt_len, r.output_len) for r in other] == \
        [(r.prompt_len, r.output_len) for r in a]


def test_prompts_have_exactly_their_length_and_reencode(tokenizer):
    pool = set(vocabulary_words(tokenizer))
    for r in synthetic_chat(tokenizer, 40, seed=1):
        assert set(r.prompt_token_ids) <= pool
        assert tokenizer(r.prompt, add_special_tokens=False)["input_ids"] == r.prompt_token_ids


def test_synthetic_chat_respects_the_data_filter_and_the_caps(tokenizer):
    free = synthetic_chat(tokenizer, 500, seed=2, with_text=False)
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 for r in free)
    assert all(r.prompt_len + r.output_len <= 2048 for r in free)
    capped = synthetic_chat(tokenizer, 500, seed=2, max_model_len=80, max_input_len=64,
                            max_output_len=32, with_text=False)
    assert all(r.prompt_len <= 64 and r.output_len <= 32 for r in capped)
    assert all(r.prompt_len + r.output_len <= 80 for r in capped)
    assert max(r.prompt_len for r in capped) == 64 and max(r.output_len for r in capped) == 32
    with pytest.raises(ValueError, match="max_model_len"):
        synthetic_chat(tokenizer, 1, max_model_len=7)
    with pytest.raises(ValueError, match="max_output_len"):
        synthetic_chat(tokenizer, 1, max_output_len=0)


def test_sample_lengths_follow_the_histogram(tokenizer):
    hist = sharegpt_lengths()
    requests = synthetic_chat(tokenizer, 3000, seed=3, with_text=False)
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    # standard errors of the means are ~2% here (both lengths have std ~ their mean)
    assert statistics.mean(prompts) == pytest.approx(hist.prompt.mean(), rel=0.08)
    assert statistics.mean(outputs) == pytest.approx(hist.output.mean(), rel=0.08)
    # the share of short prompts (<= 20 tokens) in the source histogram: 511 / 2104
    assert sum(p <= 20 for p in prompts) / len(prompts) == pytest.approx(511 / 2104, abs=0.03)
    assert summarize(requests)["total_output_tokens"] == sum(outputs)


def test_random_workload_has_fixed_or_bounded_lengths(tokenizer):
    fixed = random_workload(tokenizer, 10, input_len=32, output_len=8, seed=0)
    assert all(r.prompt_len == 32 and r.output_len == 8 for r in fixed)
    spread = random_workload(tokenizer, 50, input_len=100, output_len=10, seed=0, range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in spread)
    assert len({r.prompt_len for r in spread}) > 1
    assert [r.prompt_token_ids for r in fixed] == \
        [r.prompt_token_ids for r in random_workload(tokenizer, 10, 32, 8, seed=0)]


def test_shared_prefix_groups_share_their_system_prompt(tokenizer):
    requests = shared_prefix(tokenizer, 20, prefix_len=16, question_len=4, output_len=3,
                             group_size=8, seed=0)
    assert all(r.prompt_len == 20 and r.output_len == 3 for r in requests)
    groups = Counter(tuple(r.prompt_token_ids[:16]) for r in requests)
    assert sorted(groups.values()) == [4, 8, 8]
    assert len({tuple(r.prompt_token_ids[16:]) for r in requests}) == 20
    for r in requests:
        assert tokenizer(r.prompt, add_special_tokens=False)["input_ids"] == r.prompt_token_ids
    again = shared_prefix(tokenizer, 20, 16, 4, 3, 8, seed=0, with_text=False)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]
    with pytest.raises(ValueError, match="group_size"):
        shared_prefix(tokenizer, 4, 16, 4, 3, group_size=0)


def test_file_workload_reads_text_and_token_prompts(tokenizer, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 5}\n\n'
                    '{"prompt": [5, 6, 7], "output_len": 2}\n')
    text, ids = file_workload(tokenizer, path)
    assert text.prompt == "hello there" and text.output_len == 5
    assert text.prompt_token_ids == tokenizer("hello there", add_special_tokens=False)["input_ids"]
    assert ids.prompt_token_ids == [5, 6, 7] and ids.prompt == tokenizer.decode([5, 6, 7])
    for row, message in (('{"prompt": "x"}', "output_len"), ("not json", "JSON object"),
                         ('{"prompt": "x", "output_len": 0}', "output_len"),
                         ('{"prompt": 3, "output_len": 1}', "prompt must be"),
                         ('{"prompt": [], "output_len": 1}', "empty prompt")):
        path.write_text(row + "\n")
        with pytest.raises(ValueError, match=message):
            file_workload(tokenizer, path)


def test_file_workload_tenants_are_sent_as_those_tenants(tokenizer, tmp_path):
    """A "tenant" column (the field name of `treadle sim` traces): bench serve sends each row
    as its tenant (`user`, or the tenant's key) and reports per tenant; rows without one are
    the default tenant; --tenants beside it is an error."""
    from treadle.bench.serve import OpenAIBackend, bench_serve, workload_tenants
    from treadle.sim.workload import from_bench, from_row

    path = tmp_path / "w.jsonl"
    rows = [{"prompt": [5, 6, 7], "output_len": 2, "tenant": "heavy"},
            {"prompt": "hello there", "output_len": 3, "tenant": "light"},
            {"prompt": [8, 9], "output_len": 1}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    requests = file_workload(tokenizer, path)
    assert [r.tenant for r in requests] == ["heavy", "light", None]
    names = workload_tenants(requests, None)
    assert names == ["heavy", "light", "default"]
    backend = OpenAIBackend("http://x", "m", requests, "ids", True, tenants=names,
                            tenant_keys={"light": "kl"})
    assert [p.get("user") for p in backend.payloads] == ["heavy", None, "default"]
    assert backend.request_headers == [None, {"Authorization": "Bearer kl"}, None]
    with pytest.raises(ValueError, match="drop --tenants"):
        bench_serve("http://127.0.0.1:9", "m", requests, [1.0], tenants={"a": 1.0},
                    progress=False)
    path.write_text('{"prompt": [5], "output_len": 1}\n')
    plain = file_workload(tokenizer, path)
    assert plain[0].tenant is None and workload_tenants(plain, None) is None
    assert workload_tenants(plain * 4, {"a": 1.0}) == ["a"] * 4
    # The simulator reads the same field: a trace row and a bench file row agree.
    replay = from_bench(requests, [0.0, 0.5, 1.0])
    assert [r.tenant for r in replay] == names
    assert from_row({"arrival": 0, "prompt_len": 3, "output_len": 2, "tenant": "heavy"},
                    0).tenant == "heavy"
    path.write_text('{"prompt": [5], "output_len": 1, "tenant": 3}\n')
    with pytest.raises(ValueError, match="tenant must be"):
        file_workload(tokenizer, path)


def test_file_workload_arrivals_replace_the_request_rate(tokenizer, tmp_path):
    """An "arrival" column (every row or none) is when each request is sent, by bench serve
    and by the simulator alike, whatever the rate; without it the rate's draw decides."""
    from treadle.bench.serve import arrival_times, send_times
    from treadle.sim.commands import add_sim_args, build_requests

    path = tmp_path / "w.jsonl"
    rows = [{"prompt": [5, 6], "output_len": 2, "arrival": 0},
            {"prompt": [7], "output_len": 1, "tenant": "b", "arrival": 2.5}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    requests = file_workload(tokenizer, path)
    assert send_times(requests, 100.0, seed=3) == [0.0, 2.5]
    parser = argparse.ArgumentParser()
    add_sim_args(parser)
    args = parser.parse_args(["--workload", "file", "--file", str(path), "--request-rate", "9"])
    assert [(r.arrival, r.tenant) for r in build_requests(args, 9.0)] == [(0.0, "default"),
                                                                          (2.5, "b")]
    del rows[1]["arrival"]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match="every row an arrival, or none"):
        file_workload(tokenizer, path)
    for bad in (-1, "soon", True):
        path.write_text(json.dumps({"prompt": [5], "output_len": 1, "arrival": bad}) + "\n")
        with pytest.raises(ValueError, match="arrival must be"):
            file_workload(tokenizer, path)
    path.write_text('{"prompt": [5], "output_len": 1}\n' * 3)
    assert send_times(file_workload(tokenizer, path), 2.0, seed=1) == \
        arrival_times(3, 2.0, seed=1)


@pytest.mark.default_model
def test_prompts_round_trip_through_the_default_tokenizer():
    from transformers import AutoTokenizer

    from treadle.model.source import converted_gguf_folder, default_model_path

    tok = AutoTokenizer.from_pretrained(str(converted_gguf_folder(default_model_path())))
    for r in synthetic_chat(tok, 20, seed=0):
        assert tok(r.prompt, add_special_tokens=False)["input_ids"] == r.prompt_token_ids


def test_copy_edit_prompts_hold_the_text_their_answers_copy():
    from treadle.bench.copy_workload import MAX_LEN, MIN_LEN, copy_edit
    from treadle.model.source import resolve_model
    from treadle.tokenizer import Tokenizer as ChatTokenizer

    tokenizer = ChatTokenizer.from_folder(resolve_model(None).folder)
    requests = copy_edit(tokenizer, 4, seed=1)
    assert [r.prompt_token_ids for r in requests] == \
        [r.prompt_token_ids for r in copy_edit(tokenizer, 4, seed=1)]
    assert all(MIN_LEN <= r.output_len <= MAX_LEN + 40 for r in requests)
    assert all(r.prompt_len > r.output_len for r in requests)
    assert "Rewrite the passage" in requests[0].prompt and "JSON" in requests[1].prompt
    assert all(r.output_len == 50 for r in copy_edit(tokenizer, 2, max_output_len=50))
