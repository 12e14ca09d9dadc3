"""Treadle's torch-free Tokenizer against transformers' AutoTokenizer on the same folders: the
default model's converted folder, the tiny chat model's, and tokenizers trained here (a
SentencePiece-style BPE with byte fallback, as a TokenizersBackend and as a LlamaTokenizer; a
WordPiece with clean-up of spaces): encoding with and without special tokens, decoding with and
without them, the vocabulary and special ids, chat templates. Loading leaves torch unimported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from treadle.model.source import resolve_model
from treadle.tokenizer import ChatTemplateError, Tokenizer

PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello there, how are you doing today? I'm fine, thanks!",
    "Tokenizers split text into pieces; models read the pieces as ids.",
    "She said: don't stop, we're almost there, they've seen it.",
] * 20

# A template that exercises what transformers' sandbox provides: trim_blocks and lstrip_blocks
# (the indented block tags leave no whitespace), special tokens as variables, loop controls,
# namespace, tojson (non-ASCII and HTML characters kept), raise_exception, tools, the
# {% generation %} tag of training templates.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=false) %}
{% if tools %}
Tools: {{ tools | tojson }}
{% endif %}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {% set ns.system = true %}
    {% endif %}
    {% if m['role'] == 'skip' %}
        {% continue %}
    {% endif %}
    {% if m['role'] == 'user' and m['content'] == '' %}
        {{ raise_exception('user messages must not be empty') }}
    {% endif %}
<|{{ m['role'] }}|>
    {%- if m['content'] is defined %}{{ m['content'] | tojson }}{% else %}(none){% endif %}
    {% generation %}
{{ eos_token }}
    {% endgeneration %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
{% if ns.system %}(system){% endif %}{{ extra | default('') }}"""

CONVERSATION = [
    {"role": "system", "content": "You answer in one line. <b>ok</b>"},
    {"role": "user", "content": "Héllo 👋, what's 2+2?"},
    {"role": "assistant", "content": "4 ✓"},
    {"role": "user", "content": "  and with   spaces\nand lines?"},
]

TEXTS = [
    "Hello world",
    " leading space",
    "  two leading spaces and trailing  ",
    "ünïcödé: 中文, русский, العربية, ελληνικά",
    "emoji 🤖👍🏽👨‍👩‍👧 and flags 🇫🇷",
    "tabs\tand\nnew\r\nlines",
    "",
    "don't , stop . here ? now !",
]


def byte_fallback_backend() -> BackendTokenizer:
    """A Llama-style BPE: Metaspace, <0xXX> byte tokens for characters outside its vocabulary
    (emoji, CJK here), <s> added by the post-processor."""
    trained = BackendTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                      byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def wordpiece_backend() -> BackendTokenizer:
    """A BERT-style WordPiece: lower-cased, [CLS] ... [SEP], decoded with spaces before
    punctuation (which clean_up_tokenization_spaces removes), padding and truncation on."""
    tok = BackendTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # the clean-up is left to the config
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    # Saved in tokenizer.json; transformers pads or truncates only when a call asks.
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    tok.enable_truncation(max_length=6)
    return tok


def edit_config(folder: Path, **changes) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def trained_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    folders = {name: root / name for name in ("byte-fallback", "llama-class", "wordpiece")}
    for name in ("byte-fallback", "llama-class"):
        # A pad token the vocabulary lacks and an extra special token: both become new ids.
        PreTrainedTokenizerFast(
            tokenizer_object=byte_fallback_backend(), bos_token="<s>", eos_token="</s>",
            unk_token="<unk>", pad_token="<pad>", extra_special_tokens=["<tool>"],
            chat_template=RICH_TEMPLATE, clean_up_tokenization_spaces=True,
        ).save_pretrained(folders[name])
    # A named special token that tokenizer.json lacks: transformers adds it, with a new id. A
    # template in the config too: chat_template.jinja wins.
    edit_config(folders["byte-fallback"], sep_token="<sep>", chat_template="{{ 'not this' }}")
    # transformers 5 rebuilds a LlamaTokenizer from its class's settings, not tokenizer.json's;
    # on a Llama-shaped tokenizer.json the two agree. The template in the config (the v4 place).
    (folders["llama-class"] / "chat_template.jinja").unlink()
    edit_config(folders["llama-class"], tokenizer_class="LlamaTokenizer",
                chat_template=RICH_TEMPLATE, legacy=False)
    PreTrainedTokenizerFast(
        tokenizer_object=wordpiece_backend(), unk_token="[UNK]", sep_token="[SEP]",
        pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
        clean_up_tokenization_spaces=True).save_pretrained(folders["wordpiece"])
    return folders


@pytest.fixture(scope="module", params=["default", "tiny-chat", "byte-fallback", "llama-class",
                                        "wordpiece"])
def pair(request, trained_folders) -> tuple[Tokenizer, object]:
    """(ours, transformers') loaded from the same folder."""
    if request.param == "default":
        folder = resolve_model(None).folder
    elif request.param == "tiny-chat":
        folder = request.getfixturevalue("tiny_folder")
    else:
        folder = trained_folders[request.param]
    return Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))


def test_vocabulary_and_special_tokens_match(pair):
    ours, ref = pair
    assert len(ours) == len(ref)
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.added_tokens_decoder == ref.added_tokens_decoder
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.special_tokens == ref.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert ours.chat_template == ref.chat_template
    assert ours.model_max_length == ref.model_max_length
    ids = list(range(len(ref)))
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match(pair, text):
    ours, ref = pair
    for add in (True, False):
        ids = ours(text, add_special_tokens=add)["input_ids"]
        assert ids == ref(text, add_special_tokens=add)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                ref.decode(ids, skip_special_tokens=skip)


def test_special_tokens_in_text_are_tokens(pair):
    ours, ref = pair
    specials = [ref.convert_ids_to_tokens(i) for i in ref.all_special_ids]
    text = " x ".join(["a", *specials, "b"])
    ids = ours(text, add_special_tokens=False)["input_ids"]
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    assert set(ref.all_special_ids) <= set(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_batches_match(pair):
    ours, ref = pair
    batch = ours(TEXTS, add_special_tokens=True)["input_ids"]
    assert batch == ref(TEXTS, add_special_tokens=True)["input_ids"]
    assert ours.batch_decode(batch, skip_special_tokens=True) == \
        ref.batch_decode(batch, skip_special_tokens=True)


@PROPERTY
@given(text=st.text(max_size=120))
def test_any_text_encodes_and_decodes_as_transformers_does(pair, text):
    ours, ref = pair
    ids = ours(text, add_special_tokens=False)["input_ids"]
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == ref.decode(ids)


@PROPERTY
@given(data=st.data())
def test_any_ids_decode_as_transformers_does(pair, data):
    ours, ref = pair
    ids = data.draw(st.lists(st.integers(0, len(ref) - 1), max_size=40))
    skip = data.draw(st.booleans())
    assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_byte_fallback_round_trips_characters_outside_the_vocabulary(trained_folders):
    tok = Tokenizer.from_folder(trained_folders["byte-fallback"])
    text = "fox 🦊 狐狸"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    byte_ids = {tok.get_vocab()[f"<0x{b:02X}>"] for b in "🦊狐狸".encode()}
    assert byte_ids <= set(ids)
    assert tok.decode(ids) == text


def test_clean_up_of_spaces_follows_the_config_but_never_for_bpe(trained_folders):
    """Both folders ask for it; the pair tests check that transformers agrees."""
    wordpiece = Tokenizer.from_folder(trained_folders["wordpiece"])
    ids = wordpiece("hello , world . don't", add_special_tokens=False)["input_ids"]
    assert wordpiece.backend_tokenizer.decode(ids) == "hello , world . don ' t"
    assert wordpiece.decode(ids) == wordpiece.batch_decode([ids])[0] == "hello, world. don't"
    bpe = Tokenizer.from_folder(trained_folders["byte-fallback"])
    ids = bpe("hello , world .", add_special_tokens=False)["input_ids"]
    assert bpe.decode(ids) == "hello , world ."


CHAT_FOLDERS = ["default", "byte-fallback", "llama-class"]


@pytest.mark.parametrize("pair", CHAT_FOLDERS, indirect=True)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", [CONVERSATION, CONVERSATION[1:2], CONVERSATION[1:3]])
def test_chat_template_renders_as_transformers_does(pair, conversation, add_generation_prompt):
    ours, ref = pair
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                    tokenize=False)
    assert text == ref.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    ids = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert ids == ref.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                          return_dict=False)


@pytest.mark.parametrize("pair", ["byte-fallback"], indirect=True)
def test_chat_template_takes_tools_and_template_variables(pair):
    ours, ref = pair
    tools = [{"type": "function", "function": {"name": "météo", "description": "<weather>"}}]
    messages = [*CONVERSATION, {"role": "tool", "content": None},
                {"role": "skip", "content": "unseen"}]
    kwargs = dict(tools=tools, add_generation_prompt=True, tokenize=False, extra="!",
                  eos_token="<END>")
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == ref.apply_chat_template(messages, **kwargs)
    assert '"météo"' in text and "<weather>" in text and "<END>" in text
    assert "<|tool|>(none)" in text and "unseen" not in text


@pytest.mark.parametrize("pair", ["byte-fallback"], indirect=True)
def test_template_errors_are_value_errors_with_the_templates_message(pair):
    ours, ref = pair
    messages = [{"role": "user", "content": ""}]
    with pytest.raises(Exception) as expected:
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError) as raised:
        ours.apply_chat_template(messages, tokenize=False)
    assert isinstance(raised.value, ValueError)
    assert str(raised.value) == str(expected.value) == "user messages must not be empty"


def test_a_model_without_a_chat_template_has_none_and_refuses_chats(trained_folders):
    tok = Tokenizer.from_folder(trained_folders["wordpiece"])
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_a_template_that_does_not_parse_is_a_chat_template_error(trained_folders):
    tok = Tokenizer.from_folder(trained_folders["wordpiece"])
    tok.chat_template = "{% for m in messages %}"  # as --chat-template replaces it
    with pytest.raises(ChatTemplateError, match="does not parse"):
        tok.apply_chat_template(CONVERSATION)


def test_loading_and_using_it_never_imports_torch_or_transformers():
    folder = resolve_model(None).folder
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from treadle.tokenizer import Tokenizer\n"
        f"tok = Tokenizer.from_folder(Path({str(folder)!r}))\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}],"
        " add_generation_prompt=True)\n"
        "assert tok.decode(ids)\n"
        "leaked = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not leaked, leaked\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("gguf", ["default", "gemma3-270m"])
def test_a_gguf_converts_to_the_tokenizer_and_config_transformers_reads_from_it(gguf, tmp_path):
    """The cached conversion names the tokenizer class itself (to skip a second parse of the
    metadata): the files it writes are those AutoTokenizer and AutoConfig make from the GGUF."""
    from transformers import AutoConfig

    from treadle.model.source import (
        default_model_path,
        gemma3_270m_path,
        write_gguf_metadata_folder,
    )

    path = default_model_path() if gguf == "default" else gemma3_270m_path()
    write_gguf_metadata_folder(path, tmp_path / "ours")
    AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(
        tmp_path / "reference")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(
        tmp_path / "reference")
    reference = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(
        [*reference, "generation_config.json"])
    for name in reference:
        assert (tmp_path / "ours" / name).read_text() == \
            (tmp_path / "reference" / name).read_text(), name
