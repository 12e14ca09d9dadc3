"""Incremental detokenization over the default model's tokenizer: the streamed text equals the
full decode for any text and any ids, however the tokens are grouped; characters split over byte
tokens come out whole; stop strings are caught across tokens and never leak a fragment."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle.frontend.detokenizer import REPLACEMENT_CHAR, DetokenizerDelta, IncrementalDetokenizer
from treadle.model.source import converted_gguf_folder, default_model_path
from treadle.tokenizer import Tokenizer

pytestmark = pytest.mark.default_model

PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(converted_gguf_folder(default_model_path()))


@pytest.fixture(scope="module")
def partial_byte_ids(tok) -> list[int]:
    """Tokens that decode alone to U+FFFD: pieces of multi-byte characters."""
    return [i for i in range(len(tok)) if REPLACEMENT_CHAR in tok.decode([i])]


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """ids cut into consecutive chunks of the given sizes (cycled), each at least one id."""
    chunks, i = [], 0
    while i < len(ids):
        n = sizes[len(chunks) % len(sizes)] if sizes else 1
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[DetokenizerDelta]:
    """Every delta, the flush last; the emitted text always equals the deltas so far."""
    deltas = []
    for chunk in chunks:
        deltas.append(detok.add_tokens(chunk))
        assert detok.output_text == "".join(d.text for d in deltas)
    deltas.append(detok.flush())
    assert detok.output_text == "".join(d.text for d in deltas)
    return deltas


chunk_sizes = st.lists(st.integers(1, 4), max_size=5)


@PROPERTY
@given(text=st.text(), prompt=st.text(max_size=20), sizes=chunk_sizes)
def test_streamed_text_equals_full_decode(tok, text, prompt, sizes):
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, encode(tok, prompt))
    seen = 0
    for chunk in chunked(ids, sizes):
        detok.add_tokens(chunk)
        seen += len(chunk)
        so_far = tok.decode(ids[:seen])
        # Never ahead of the tokens, and behind only while they end inside a character.
        assert so_far.startswith(detok.output_text)
        if not so_far.endswith(REPLACEMENT_CHAR):
            assert detok.output_text == so_far
    detok.flush()
    # Not always `text`: bytes missing from the vocabulary (of rare 4-byte characters) are lost.
    assert detok.output_text == tok.decode(ids)


@PROPERTY
@given(data=st.data(), skip=st.booleans(), sizes=chunk_sizes)
def test_any_ids_stream_to_their_decode(tok, partial_byte_ids, data, skip, sizes):
    """Ids no text encodes to too: stray and truncated byte sequences, special tokens, and a
    prompt that ends inside a character."""
    token = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(partial_byte_ids),
                      st.integers(0, 16))  # 0-16: the special tokens
    prompt = data.draw(st.lists(token, max_size=8))
    ids = data.draw(st.lists(token, max_size=30))
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    stream(detok, chunked(ids, sizes))
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)


@PROPERTY
@given(data=st.data(), include=st.booleans(), sizes=chunk_sizes)
def test_stop_strings_cut_where_they_first_complete(tok, data, include, sizes):
    """Against a reference on the whole text: the stop that ends first (the longer on a tie) cuts
    the output, whatever the grouping of tokens; the stream holds nothing past the cut."""
    text = data.draw(st.text(alphabet="ab🎉 c", min_size=1, max_size=30))
    substrings = st.builds(lambda i, n: text[i:i + n], st.integers(0, len(text) - 1),
                           st.integers(1, 4))
    stops = data.draw(st.lists(st.one_of(substrings, st.text(alphabet="ab🎉 c", min_size=1,
                                                             max_size=3)), max_size=3))
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    deltas = stream(detok, chunked(ids, sizes))

    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        assert detok.output_text == text and not detok.stopped
        return
    end, start, stop = min(found)
    assert detok.output_text == text[:end if include else start]
    assert detok.stopped and detok.stop_reason == stop
    assert deltas[-1] == DetokenizerDelta("", True, stop)


def test_emoji_and_cjk_split_over_byte_tokens_come_out_whole(tok):
    for text in ["a🎉b", "你好，世界", "e\u0301👩‍👩‍👧"]:
        ids = encode(tok, text)
        assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids), f"{text!r} not split"
        detok = IncrementalDetokenizer(tok, [])
        deltas = stream(detok, [[i] for i in ids])
        assert not any(REPLACEMENT_CHAR in d.text for d in deltas)
        assert "".join(d.text for d in deltas) == text
    halves = encode(tok, "🎉")
    assert len(halves) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens(halves[:-1]).text == ""
    assert detok.add_tokens(halves[-1:]).text == "🎉"


def test_truncated_character_is_flushed_as_it_decodes(tok):
    ids = encode(tok, "ok 🎉")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        assert REPLACEMENT_CHAR not in detok.add_tokens([i]).text
    assert detok.output_text.startswith("ok")
    assert detok.flush().text.endswith(REPLACEMENT_CHAR)
    assert detok.output_text == tok.decode(ids)


def three_token_stop(tok) -> tuple[list[int], str, int]:
    """Output ids, a stop string that starts inside one token and ends inside the second one
    after it, and where the stop starts in the text."""
    text = "The weather tomorrow will be wonderful."
    ids = encode(tok, text)
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
    starts = [0] + ends[:-1]
    assert ends[-1] == len(text)
    k = 2  # tokens k, k + 1 and k + 2
    start, end = starts[k] + 1, ends[k + 2] - 1
    assert starts[k] < start < ends[k] and starts[k + 2] < end < ends[k + 2]
    return ids, text[start:end], start


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_over_three_tokens_is_caught_and_never_leaks(tok, include):
    ids, stop, start = three_token_stop(tok)
    text = tok.decode(ids)
    kept = text[:start + len(stop)] if include else text[:start]
    detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
    deltas = [detok.add_tokens([token]) for token in ids]
    stopped_at = next(i for i, d in enumerate(deltas) if d.stopped)
    assert stopped_at == 4  # the third token of the stop completes it
    # Until the stop is complete, not even its first character is out.
    assert text[:start] == "".join(d.text for d in deltas[:stopped_at])
    assert all(d == DetokenizerDelta("", True, stop) for d in deltas[stopped_at + 1:])
    assert deltas[stopped_at].stop_reason == stop and detok.flush() == deltas[-1]
    assert detok.output_text == kept


def test_first_completed_stop_wins_and_is_named(tok):
    ids = encode(tok, "one two three four")
    detok = IncrementalDetokenizer(tok, [], stop=["four", "two", "three"])
    stream(detok, [ids])
    assert (detok.output_text, detok.stop_reason) == ("one ", "two")
    # "wo" is complete before "two three" is, though it starts later.
    detok = IncrementalDetokenizer(tok, [], stop=["two three", "wo"])
    stream(detok, [ids])
    assert (detok.output_text, detok.stop_reason) == ("one t", "wo")


def test_stop_strings_in_the_prompt_do_not_match(tok):
    detok = IncrementalDetokenizer(tok, encode(tok, "Say STOP and ST"), stop=["STOP"])
    stream(detok, [encode(tok, "OP now")])
    assert detok.output_text == "OP now" and not detok.stopped


def test_flush_releases_a_held_stop_prefix_that_never_completed(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["nearby"])
    assert detok.add_tokens(encode(tok, "the end is nea")).text == "the end is "
    assert detok.flush() == DetokenizerDelta("nea")
    assert detok.output_text == "the end is nea"


def test_special_tokens_follow_skip_special_tokens(tok):
    ids = encode(tok, "hi") + [tok.eos_token_id]
    for skip, text in [(True, "hi"), (False, "hi" + tok.special_tokens["eos_token"])]:
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        stream(detok, [[i] for i in ids])
        assert detok.output_text == text


def test_empty_stop_string_is_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=["ok", ""])
