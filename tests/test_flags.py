"""The flags and conventions users reach for, against a live HTTPS server on a tiny model: served
model names, generation-config defaults, --max-logprobs, --root-path, SSL, SSE keep-alives while
a request is queued, `treadle chat` piped; the engine-wide seed; `from treadle import ...`
without torch; the README's AsyncLLM example."""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import ROOT
from frontends import start_frontends, stop_frontends, wait_started

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.core.generation_defaults import sampling_defaults
from treadle.core.sampling_params import SamplingParams, check_max_logprobs
from treadle.frontend.async_engine import AsyncEngine

NAMES = ("alpha", "beta")


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by the openssl CLI."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def greedy_defaults(tmp_path_factory) -> Path:
    """A --generation-config folder whose defaults make requests greedy."""
    folder = tmp_path_factory.mktemp("generation")
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3, "bos_token_id": 1}))
    return folder


@pytest.fixture(scope="module")
def server(tiny_folder, tls, greedy_defaults) -> Iterator[tuple[str, Path]]:
    """HTTPS on a free port; one sequence per step, so a second request waits in the queue."""
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", kv_cache_memory_bytes=16 << 20,
        max_num_seqs=1, max_logprobs=5, generation_config=str(greedy_defaults),
        engine_threads=1)))
    key, cert = tls
    frontends, thread = start_frontends(engine, ServerConfig(
        port=0, served_model_name=NAMES, sse_keepalive_interval=0.05, root_path="/api",
        ssl_keyfile=str(key), ssl_certfile=str(cert), disable_uvicorn_access_log=True))
    try:
        wait_started(frontends, thread)
        yield f"https://127.0.0.1:{frontends.port}", cert
    finally:
        stop_frontends(frontends, thread)


def trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert)


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    url, cert = server
    with httpx.Client(verify=trusting(cert)) as http:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", http_client=http,
                            max_retries=0)


def test_served_model_names(client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert client.models.retrieve("beta").id == "beta"
    reply = client.completions.create(model="beta", prompt="hi", max_tokens=2)
    assert reply.model == "alpha"  # the first name, as vLLM answers
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="tiny-chat", prompt="hi", max_tokens=2)
    assert error.value.code == "model_not_found"


def test_generation_config_defaults_apply_where_a_request_sets_none(client):
    def text(**fields) -> str:
        return client.completions.create(model="alpha", prompt="Once upon", max_tokens=8,
                                         **fields).choices[0].text

    greedy = text(temperature=0)
    # Unseeded and with no temperature: the folder's temperature 0 makes it greedy;
    # temperature 1 (the API's default) samples the random model's flat distribution.
    assert text() == greedy
    sampled = {text(temperature=1.0, seed=s) for s in range(2)}
    assert sampled != {greedy}


def test_max_logprobs_bounds_requests(client):
    reply = client.completions.create(model="alpha", prompt="hi", max_tokens=2, logprobs=5)
    assert len(reply.choices[0].logprobs.top_logprobs[0]) >= 5
    for fields in ({"logprobs": 6}, {"extra_body": {"prompt_logprobs": 6}}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="alpha", prompt="hi", max_tokens=2, **fields)
        assert "max_logprobs=5" in error.value.message
    with pytest.raises(openai.BadRequestError, match="max_logprobs"):
        client.chat.completions.create(model="alpha", max_tokens=2, logprobs=True,
                                       top_logprobs=6, messages=[{"role": "user",
                                                                  "content": "hi"}])
    with pytest.raises(ValueError, match="logprobs must be at most max_logprobs=3"):
        check_max_logprobs(SamplingParams(logprobs=4), 3)


def test_root_path_and_https(server):
    url, cert = server
    with httpx.Client(verify=trusting(cert)) as http:
        # Behind a proxy that strips /api: the routes stay, the docs name the prefix.
        assert http.get(f"{url}/openapi.json").json()["servers"] == [{"url": "/api"}]
        assert http.get(f"{url}/v1/models").json()["data"][0]["id"] == "alpha"
    with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
        httpx.get(f"{url}/v1/models")


def test_keep_alive_comments_while_a_stream_is_queued(server, client):
    url, cert = server
    # A long stream holds the one sequence slot from its first token on (a thread started
    # 0.1 s earlier had not yet reached the engine in CI, and 60 tokens ended too soon).
    long = client.completions.create(model="alpha", prompt="x", max_tokens=240,
                                     temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(long))
    drain = threading.Thread(target=lambda: list(long))
    drain.start()
    lines: list[str] = []
    try:
        with httpx.Client(verify=trusting(cert), timeout=60) as http, http.stream(
                "POST", f"{url}/v1/completions", json={"model": "alpha", "prompt": "hi",
                                                       "max_tokens": 3, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
    finally:
        drain.join(60)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert ": keep-alive" in lines[:first_data], lines[:5]
    assert lines[-1] == "data: [DONE]"
    # The official client skips the comments.
    stream = client.chat.completions.create(model="alpha", max_tokens=3, stream=True,
                                            messages=[{"role": "user", "content": "hi"}])
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"


def test_treadle_chat_piped(server, client):
    url, cert = server

    def reply(messages: list[dict]) -> str:
        return client.chat.completions.create(model="alpha", messages=messages, max_tokens=6,
                                              temperature=0).choices[0].message.content

    result = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "chat", "--url", url, "--max-tokens", "6",
         "--temperature", "0"], input=b"hi\nand then?\n/reset\nand then?\n/exit\nignored\n",
        cwd=ROOT, env={**os.environ, "SSL_CERT_FILE": str(cert)}, capture_output=True,
        timeout=120)  # bytes: the replies' own line ends, untranslated
    assert result.returncode == 0, result.stderr.decode()
    first = reply([{"role": "user", "content": "hi"}])
    second = reply([{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                    {"role": "user", "content": "and then?"}])
    after_reset = reply([{"role": "user", "content": "and then?"}])
    assert result.stdout.decode() == f"{first}\n{second}\n{after_reset}\n"


def test_sampling_defaults_from_generation_config(tmp_path, greedy_defaults):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": 2}))
    assert sampling_defaults(tmp_path, "auto") == {"temperature": 0.6, "top_p": 0.9,
                                                   "top_k": 20}
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(tmp_path, str(greedy_defaults)) == {"temperature": 0.0}
    assert sampling_defaults(tmp_path / "none", "auto") == {}  # a model may have none
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(tmp_path, str(tmp_path / "none"))


def test_engine_seed_repeats_unseeded_sampling_across_restarts(tiny_folder):
    from treadle import LLM

    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sampled(seed: int) -> list[int]:
        llm = LLM(str(tiny_folder), dtype="float32", kv_cache_memory_bytes=16 << 20, seed=seed)
        return llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids

    first = sampled(7)
    assert sampled(7) == first
    assert sampled(8) != first


def test_import_treadle_does_not_import_torch():
    code = ("import sys; from treadle import LLM, SamplingParams, AsyncLLM; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
            "SamplingParams(max_tokens=3); print(LLM.__name__, AsyncLLM.__name__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["LLM", "AsyncLLM"]


def test_the_readme_async_example_runs(tiny_folder):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"<!-- async-example[^\n]*\n```python\n(.*?)```", readme, re.S)[1]
    assert "AsyncLLM(max_model_len=256)" in code
    # The tiny model, so that it runs in seconds; the rest as written.
    code = code.replace("AsyncLLM(max_model_len=256)",
                        f"AsyncLLM({str(tiny_folder)!r}, max_model_len=256, dtype='float32', "
                        f"kv_cache_memory_bytes=16 << 20)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    from treadle import LLM

    llm = LLM(str(tiny_folder), dtype="float32", kv_cache_memory_bytes=16 << 20,
              max_model_len=256)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = llm.generate(["The capital of France is", llm.chat_prompt("Name a colour.")],
                            params, use_tqdm=False)
    assert result.stdout.splitlines() == [repr(o.outputs[0].text) for o in expected]


def test_async_llm_aborts_when_left_early(tiny_folder):
    from treadle import AsyncLLM

    async def run() -> None:
        async with AsyncLLM(str(tiny_folder), dtype="float32",
                            kv_cache_memory_bytes=16 << 20) as llm:
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            outputs = llm.generate([5, 6, 7], params)
            async for output in outputs:
                assert not output.finished
                break
            await outputs.aclose()
            assert not llm.engine.streams and not llm.engine.processor.requests
            last = [o async for o in llm.generate("hi", SamplingParams(max_tokens=2))][-1]
            assert last.finished and len(last.outputs[0].token_ids) == 2

    asyncio.run(run())
