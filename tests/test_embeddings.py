"""Embeddings: pooled final hidden states equal transformers' (AutoModel's last_hidden_state,
pooled the same way and normalised in numpy), whether a prompt runs whole, in chunks, after a
prefix-cache hit or again after a preemption, in batches shared with generation (whose tokens do
not change); /v1/embeddings with the official client, its bad inputs refused with a 400, a mixed
load of chat and embeddings leaving no block behind; LLM.embed offline."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import assert_engine_empty
from frontends import start_frontends, stop_frontends, wait_started
from model_utils import TINY, build_tiny_model, greedy_decode, make_runner
from openai.types import embedding_create_params
from transformers import AutoModel

from treadle.config import (
    AsyncEngineConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    build_config,
)
from treadle.core.engine_core import EngineCore
from treadle.core.sampling_params import SamplingParams
from treadle.frontend.async_engine import AsyncEngine
from treadle.llm import LLM
from treadle.model.pooling import PooledHidden
from treadle.model.source import default_model_path
from treadle.server.openai.protocol import EmbeddingRequest

TOLERANCE = 1e-4
MAX_MODEL_LEN = TINY["max_position_embeddings"]
IDLE = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}


def expected_embedding(base_model: torch.nn.Module, prompt: list[int], pooling: str
                       ) -> np.ndarray:
    """transformers' last_hidden_state (after the final norm), pooled and normalised here."""
    with torch.no_grad():
        hidden = base_model(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    vector = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
    return vector / np.linalg.norm(vector)


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def test_pooled_hidden_counts_each_position_once():
    rows = np.random.default_rng(0).standard_normal((12, 8)).astype(np.float32)
    pooled = PooledHidden("mean", 12)
    assert (pooled.rows_wanted(0, 5), pooled.rows_wanted(5, 4)) == (5, 4)
    pooled.add(5, torch.from_numpy(rows[:5]))
    pooled.add(9, torch.from_numpy(rows[5:9]))
    # Preempted, recomputed from the start in other chunks, then the rest.
    pooled.add(6, torch.from_numpy(rows[:6]))
    pooled.add(12, torch.from_numpy(rows[6:12]))
    mean = rows.astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(pooled.embedding(), mean / np.linalg.norm(mean), atol=1e-6)
    last = PooledHidden("last", 12)
    assert (last.rows_wanted(0, 8), last.rows_wanted(8, 4)) == (0, 1)
    last.add(12, torch.from_numpy(rows[11:]))
    np.testing.assert_allclose(last.embedding(), rows[11] / np.linalg.norm(rows[11]),
                               atol=1e-6)


@pytest.mark.parametrize("arch, pooling", [("llama", "mean"), ("gemma3", "last")])
def test_engine_embeddings_equal_transformers_in_batches_with_generation(tmp_path, arch,
                                                                         pooling):
    hf = build_tiny_model(arch, tmp_path)
    # Chunks of at most 8 tokens in steps of 16: long prompts take several steps, and share
    # them with the generating requests.
    core = EngineCore(EngineConfig(ModelConfig(model=str(tmp_path), dtype="float32",
                                               pooling=pooling),
                                   CacheConfig(block_size=4, num_blocks=128,
                                               kv_cache_dtype="float32"),
                                   SchedulerConfig(max_num_batched_tokens=16,
                                                   long_prefill_token_threshold=8)))
    prompts = random_prompts((5, 23, 9, 30, 1), seed=1)
    generated = random_prompts((12, 30), seed=2)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(generated):
        core.add_request(f"g{i}", prompt, greedy)
    for i, prompt in enumerate(prompts):
        core.add_request(f"e{i}", prompt, SamplingParams(), pooling=True)
    embeddings, tokens, shared = {}, {f"g{i}": [] for i in range(len(generated))}, False
    while core.has_unfinished_requests():
        for out in core.step():
            if out.embedding is not None:
                assert out.finished and out.new_token_ids == []
                embeddings[out.request_id] = out.embedding
            else:
                tokens[out.request_id] += out.new_token_ids
        running = core.scheduler.running
        shared |= any(r.pooling for r in running) and any(not r.pooling for r in running)
    assert shared, "no step ran embeddings and generation together"
    assert list(tokens.values()) == greedy_decode(make_runner(tmp_path), generated, 6)
    # Again, once the first are cached: last pooling takes the prefix hit, mean refuses it.
    repeat = prompts[3][:26] + [7, 8, 9]
    core.add_request("again", repeat, SamplingParams(), pooling=True)
    while core.has_unfinished_requests():
        for out in core.step():
            embeddings[out.request_id] = out.embedding
            assert (out.num_cached_tokens > 0) == (pooling == "last")
    assert_engine_empty(core)
    for request_id, prompt in [*((f"e{i}", p) for i, p in enumerate(prompts)),
                               ("again", repeat)]:
        got = np.array(embeddings[request_id])
        expected = expected_embedding(hf.model, prompt, pooling)
        assert np.abs(got - expected).max() < TOLERANCE, request_id


def test_embeddings_survive_preemption(tmp_path):
    """A cache too small for everyone: an embedding is preempted mid-prefill and recomputed;
    its mean still counts every position once."""
    pooling = "mean"
    hf = build_tiny_model("llama", tmp_path)
    core = EngineCore(EngineConfig(ModelConfig(model=str(tmp_path), dtype="float32",
                                               pooling=pooling),
                                   CacheConfig(block_size=4, num_blocks=12,
                                               enable_prefix_caching=False,
                                               kv_cache_dtype="float32"),
                                   SchedulerConfig(max_num_batched_tokens=12,
                                                   long_prefill_token_threshold=6)))
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    generated = random_prompts((4,), seed=4)
    # e0 is admitted beside g0 (its whole prompt fits), and g0's decode grows into its blocks
    # before e0's last chunk: e0, the newest, is preempted.
    prompts = random_prompts((40, 26), seed=5)
    requests = []
    for i, prompt in enumerate(generated):
        core.add_request(f"g{i}", prompt, greedy)
    for i, prompt in enumerate(prompts):
        core.add_request(f"e{i}", prompt, SamplingParams(), pooling=True)
        requests.append(core.scheduler.requests[f"e{i}"])
    embeddings = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.embedding is not None:
                embeddings[out.request_id] = out.embedding
    assert any(r.num_preemptions for r in requests), "no embedding was preempted"
    assert_engine_empty(core)
    for i, prompt in enumerate(prompts):
        got = np.array(embeddings[f"e{i}"])
        assert np.abs(got - expected_embedding(hf.model, prompt, pooling)).max() < TOLERANCE


def test_llm_embed_offline(tiny_folder):
    llm = LLM(str(tiny_folder), dtype="float32", kv_cache_dtype="float32", pooling="mean",
              num_blocks=64)
    base = AutoModel.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.tokenizer(text)["input_ids"]
    outputs = llm.embed([text, ids[:5]], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [ids, ids[:5]]
    for output, prompt in zip(outputs, [ids, ids[:5]], strict=True):
        got = np.array(output.outputs.embedding)
        assert np.abs(got - expected_embedding(base, prompt, "mean")).max() < TOLERANCE
    with pytest.raises(ValueError, match="at least one token"):
        llm.embed([[]], use_tqdm=False)
    assert_engine_empty(llm.engine)


def test_request_declares_every_openai_field():
    assert set(embedding_create_params.EmbeddingCreateParams.__annotations__) <= \
        set(EmbeddingRequest.model_fields)


@pytest.fixture(scope="module")
def server(tiny_folder):
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", kv_cache_dtype="float32",
        kv_cache_memory_bytes=16 << 20, max_model_len=MAX_MODEL_LEN)))
    frontends, thread = start_frontends(engine, ServerConfig(port=0, grpc_port=None))
    wait_started(frontends, thread)
    yield f"http://127.0.0.1:{frontends.port}/v1", engine
    stop_frontends(frontends, thread)


@pytest.fixture(scope="module")
def base_model(tiny_folder):
    return AutoModel.from_pretrained(tiny_folder, dtype=torch.float32).eval()


def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict:
    """The engine's load once it has reported no requests and no blocks in use."""
    deadline = time.monotonic() + timeout
    while engine.load() != IDLE and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.load()


TEXTS = ["Embeddings are pooled hidden states.", "A second, longer input to embed here: "
         "it has a few more tokens than the first one.", "hi"]


def test_openai_client_embeddings_equal_transformers(server, base_model):
    base_url, engine = server
    client = openai.OpenAI(base_url=base_url, api_key="none")
    ids = engine.tokenizer(TEXTS)["input_ids"]
    # The client asks for base64 unless told otherwise, and decodes it itself.
    by_default = client.embeddings.create(model=engine.model_name, input=TEXTS)
    assert [d.index for d in by_default.data] == [0, 1, 2]
    assert by_default.usage.prompt_tokens == by_default.usage.total_tokens == \
        sum(len(i) for i in ids)
    raw = httpx.post(f"{base_url}/embeddings", json={"input": TEXTS, "encoding_format": "float",
                                                     "user": "someone"}, timeout=60).json()
    assert set(raw) == {"object", "data", "model", "usage"} and raw["object"] == "list"
    assert raw["model"] == engine.model_name
    assert raw["usage"] == {"prompt_tokens": sum(len(i) for i in ids),
                            "total_tokens": sum(len(i) for i in ids)}
    as_ids = client.embeddings.create(model=engine.model_name, input=ids,
                                      encoding_format="float")
    one = client.embeddings.create(model=engine.model_name, input=ids[1],
                                   encoding_format="float")
    b64 = httpx.post(f"{base_url}/embeddings", json={"input": TEXTS[0],
                                                     "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    for i, prompt in enumerate(ids):
        expected = expected_embedding(base_model, prompt, "last")
        entry = raw["data"][i]
        assert set(entry) == {"object", "index", "embedding"} and entry["object"] == "embedding"
        assert entry["index"] == i
        for vector in (entry["embedding"], by_default.data[i].embedding,
                       as_ids.data[i].embedding):
            assert np.abs(np.array(vector) - expected).max() < TOLERANCE
    np.testing.assert_array_equal(np.array(one.data[0].embedding, dtype=np.float32),
                                  np.array(as_ids.data[1].embedding, dtype=np.float32))
    np.testing.assert_array_equal(decoded, np.array(raw["data"][0]["embedding"],
                                                    dtype=np.float32))


def test_mixed_chat_and_embeddings_leave_no_block(server):
    base_url, engine = server
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none")

    async def chat(i: int) -> str:
        response = await client.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": f"Count to {i}"}],
            max_tokens=12, temperature=0.0)
        return response.choices[0].finish_reason

    async def embed(i: int) -> int:
        response = await client.embeddings.create(model=engine.model_name,
                                                  input=[f"text {i}", TEXTS[1] * (i + 1)])
        return len(response.data)

    async def load() -> list:
        return await asyncio.gather(*(chat(i) for i in range(6)),
                                    *(embed(i) for i in range(8)))

    results = asyncio.run(load())
    assert results[:6] == ["length"] * 6 and results[6:] == [2] * 8
    assert wait_idle(engine) == IDLE


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": "hello", "dimensions": 8}, "dimensions"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": list(range(3, 3 + MAX_MODEL_LEN + 1))}, "input"),
    ({"input": "word " * (MAX_MODEL_LEN + 10)}, "input"),
    ({"input": [-1, 5]}, "input"),
    ({"input": [[5], [10 ** 9]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hello", "user": "x" * 10_000}, "user"),
])
def test_bad_inputs_are_400s_naming_the_field(server, body, param):
    base_url, engine = server
    response = httpx.post(f"{base_url}/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert wait_idle(engine) == IDLE


def test_another_model_is_404(server):
    base_url, _ = server
    response = httpx.post(f"{base_url}/embeddings", json={"input": "a", "model": "other"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


@pytest.mark.default_model
@pytest.mark.slow  # 105 s on a loaded 2-core machine, mostly transformers' GGUF dequantizing
def test_default_model_embeddings_equal_transformers_gguf():
    """The default model dequantized (--quantization none, float32) against transformers
    loading the same GGUF file."""
    path = default_model_path()
    base = AutoModel.from_pretrained(str(path.parent), gguf_file=path.name,
                                     dtype=torch.float32).eval()
    llm = LLM(None, dtype="float32", kv_cache_dtype="float32", quantization="none",
              num_blocks=64)
    outputs = llm.embed(["What is the capital of France?", TEXTS[1]], use_tqdm=False)
    for output in outputs:
        expected = expected_embedding(base, output.prompt_token_ids, "last")
        assert np.abs(np.array(output.outputs.embedding) - expected).max() < TOLERANCE
    assert_engine_empty(llm.engine)
