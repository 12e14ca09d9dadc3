"""Chat templates at the frontends: a model without one (a base model) answers chat with a 400 in
OpenAI's error JSON (INVALID_ARGUMENT over gRPC) that says so and names --chat-template, while
completions work; ServerConfig.chat_template (a file or the template's text) gives it one, and
the prompt it renders is transformers' own rendering of that template."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import httpx
import pytest
import transformers
from frontends import start_frontends, stop_frontends, wait_started
from model_utils import TINY

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.frontend.async_engine import AsyncEngine
from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc
from treadle.server.launcher import serve
from treadle.server.openai.app import build_app

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def base_folder(tiny_folder: Path, tmp_path_factory) -> Path:
    """The tiny chat model with its chat template taken out: a base model."""
    folder = tmp_path_factory.mktemp("tiny-base")
    for path in tiny_folder.iterdir():
        if path.name != "chat_template.jinja":
            shutil.copy(path, folder / path.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def template_file(tiny_folder: Path) -> Path:
    return tiny_folder / "chat_template.jinja"


@pytest.fixture(scope="module")
def reference_ids(tiny_folder: Path) -> list[int]:
    """transformers' rendering of the chat model's own template, tokenized."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_folder))
    return list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def base_server(base_folder: Path):
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(base_folder), dtype="float32", kv_cache_memory_bytes=16 << 20,
        max_model_len=TINY["max_position_embeddings"])))
    frontends, thread = start_frontends(engine, ServerConfig(port=0, grpc_port=0))
    wait_started(frontends, thread)
    yield frontends
    stop_frontends(frontends, thread)


def test_a_base_model_refuses_chat_and_completes(base_server):
    url = f"http://127.0.0.1:{base_server.port}"
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"messages": MESSAGES, "max_tokens": 2})
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages")
    assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=30)
    assert tokenized.status_code == 400 and tokenized.json()["error"] == error

    completion = httpx.post(f"{url}/v1/completions", timeout=30,
                            json={"prompt": "Hi there", "max_tokens": 3, "ignore_eos": True})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 3

    async def over_grpc() -> tuple[grpc.StatusCode, str, int]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{base_server.grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                             for m in MESSAGES])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(pb.GenerateRequest(chat=chat)):
                    pass
            text = pb.GenerateRequest(text="Hi there", stop=pb.StopCriteria(max_tokens=3,
                                                                             ignore_eos=True))
            tokens = [t async for r in stub.Generate(text) if r.HasField("chunk")
                      for t in r.chunk.token_ids]
            return refused.value.code(), refused.value.details(), len(tokens)

    code, details, generated = asyncio.run(over_grpc())
    assert (code, details, generated) == (grpc.StatusCode.INVALID_ARGUMENT, error["message"], 3)


@pytest.mark.parametrize("as_file", [True, False], ids=["file", "text"])
def test_chat_template_setting_gives_the_model_one(base_server, template_file, reference_ids,
                                                   as_file):
    """The setting as the launcher takes it, over the base model's engine (tokenizing alone:
    the app on an in-process transport, its own event loop)."""
    setting = str(template_file) if as_file else template_file.read_text()
    app = build_app(base_server.engine, ServerConfig(chat_template=setting))

    async def tokenize() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/tokenize", json={"messages": MESSAGES})

    response = asyncio.run(tokenize())
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == reference_ids


def test_a_chat_template_setting_that_is_neither_file_nor_template_stops_serve(base_folder,
                                                                               capsys):
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(model=str(base_folder))))
    missing = str(base_folder / "no-such-template.jinja")
    assert serve(engine, ServerConfig(chat_template=missing)) == 2
    assert "chat_template" in capsys.readouterr().err
    assert serve(engine, ServerConfig(chat_template="{% for m in messages %}")) == 2
    assert "does not parse" in capsys.readouterr().err


def test_a_message_name_reaches_the_template(base_server):
    """OpenAI's `name` on a message is passed to the template as transformers passes it."""
    template = ("{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}: "
                "{{ m.content }}\n{% endfor %}")
    app = build_app(base_server.engine, ServerConfig(chat_template=template))
    named = [{"role": "user", "content": "Hi", "name": "ada"}, {"role": "user", "content": "Yo"}]

    async def tokenize() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/tokenize", json={"messages": named,
                                                        "add_generation_prompt": False})

    response = asyncio.run(tokenize())
    assert response.status_code == 200, response.text
    rendered = "user(ada): Hi\nuser: Yo\n"
    assert response.json()["tokens"] == base_server.engine.tokenizer(rendered,
                                                                     add_special_tokens=False
                                                                     )["input_ids"]
