"""LoRA adapters against peft: two adapters trained a few steps in the test on a tiny random
Llama, saved in PEFT's format; our logits (base never merged) against peft's merged model's,
rows of a mixed batch against the same rows alone, a quantized base, and the refusals."""

from __future__ import annotations

import copy
import http.client
import json
import logging
import shutil
from pathlib import Path

import peft
import pytest
import torch
from model_utils import build_tiny_model, make_runner
from test_kv_cache import admit

from treadle.core.engine_process import adapter_names
from treadle.core.kv_cache import KVCacheManager
from treadle.core.lora_request import LoRARequest
from treadle.core.request import Request
from treadle.core.sampling_params import SamplingParams
from treadle.errors import InvalidField
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.loader import load_model
from treadle.model.lora import LoraError, load_peft_adapter
from treadle.model.quantization import QuantizedWeight, dequantize_torch
from treadle.model.source import resolve_model

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Two adapters unlike each other: every module at rank 8; rsLoRA on q/v and down at rank 4.
ADAPTERS = {"a": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
            "b": dict(r=4, lora_alpha=8, use_rslora=True,
                      target_modules=["q_proj", "v_proj", "down_proj"])}


def train_adapter(base: torch.nn.Module, folder: Path, seed: int, **config) -> torch.nn.Module:
    """A few Adam steps of next-token loss on random tokens (so B moves off its zero init);
    saved to `folder`; returns peft's merged model."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    ids = torch.randint(3, 256, (4, 24))
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """(base folder, base model, {name: (adapter folder, merged model)})."""
    folder = tmp_path_factory.mktemp("lora-base")
    base = build_tiny_model("llama", folder)
    adapters = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        adapter_folder = folder / f"adapter-{name}"
        adapters[name] = (adapter_folder, train_adapter(base, adapter_folder, i, **config))
    return folder, base, adapters


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def sequence(ids: list[int], start: int, table: list[int], lora: tuple[int, Path] | None
             ) -> ScheduledSequence:
    fields = {} if lora is None else {"lora_id": lora[0], "lora_path": str(lora[1])}
    return ScheduledSequence(ids, start, table, all_logits=True, **fields)


def lora_runner(folder: Path, max_loras: int = 2, **kwargs):
    runner = make_runner(folder, block_size=4, num_blocks=128, enable_lora=True,
                         max_loras=max_loras, **kwargs)
    assert runner.lora is not None
    return runner


def test_adapter_logits_match_peft_merged_model(tiny_lora):
    folder, base, adapters = tiny_lora
    runner = lora_runner(folder)
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    for lora_id, (name, (path, merged)) in enumerate(adapters.items(), start=1):
        want = reference_logits(merged, ids)
        # The adapter moved the model: a test that ignored it would fail.
        assert (want - reference_logits(base, ids)).abs().max() > 1e-2, name
        table = list(range(10 * lora_id, 10 * lora_id + 8))
        whole = runner.execute(ModelInput([sequence(ids, 0, table, (lora_id, path))]))
        assert (whole - want).abs().max().item() < 1e-3, name
        # In prefill chunks, then decode steps of one token (the decode paths).
        steps = [ids[s:s + 9] for s in range(0, 18, 9)] + [[t] for t in ids[18:]]
        start, rows = 0, []
        for chunk in steps:
            rows.append(runner.execute(ModelInput([sequence(chunk, start, table,
                                                            (lora_id, path))])))
            start += len(chunk)
        assert (torch.cat(rows) - want).abs().max().item() < 1e-3, name


def test_mixed_batch_rows_equal_each_row_alone(tiny_lora):
    """Base, adapter a and adapter b rows in one step, prefills and decodes mixed: each row's
    logits are those it gets alone (and the base rows those of the base model)."""
    folder, base, adapters = tiny_lora
    runner = lora_runner(folder)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (7, 11, 5, 9)]
    loras = [None, (1, adapters["a"][0]), (2, adapters["b"][0]), (1, adapters["a"][0])]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    alone = [runner.execute(ModelInput([sequence(p[:-1], 0, t, lora)]))
             for p, t, lora in zip(prompts, tables, loras, strict=True)]
    alone_last = [runner.execute(ModelInput([sequence(p[-1:], len(p) - 1, t, lora)]))
                  for p, t, lora in zip(prompts, tables, loras, strict=True)]
    # Again, together: two prefills and two decodes in one step.
    mixed = [sequence(p, 0, t, lora) if i % 2 == 0 else sequence(p[-1:], len(p) - 1, t, lora)
             for i, (p, t, lora) in enumerate(zip(prompts, tables, loras, strict=True))]
    for i in (1, 3):  # the decode rows' prompts are cached already: rewrite them alike
        runner.execute(ModelInput([sequence(prompts[i][:-1], 0, tables[i], loras[i])]))
    together = runner.execute(ModelInput(mixed))
    want = []
    for i in range(len(prompts)):
        want.append(torch.cat([alone[i], alone_last[i]]) if i % 2 == 0 else alone_last[i])
    assert (together - torch.cat(want)).abs().max().item() < 1e-4
    assert (alone[0] - reference_logits(base, prompts[0][:-1])).abs().max().item() < 1e-3


def test_more_adapters_than_slots_swap_in_and_stay_exact(tiny_lora):
    """One slot: adapters alternate in it, each step still its own adapter's logits."""
    folder, _, adapters = tiny_lora
    runner = lora_runner(folder, max_loras=1)
    ids = list(range(5, 25))
    for lora_id, name in [(1, "a"), (2, "b"), (1, "a")]:
        path, merged = adapters[name]
        got = runner.execute(ModelInput([sequence(ids, 0, list(range(8)), (lora_id, path))]))
        assert (got - reference_logits(merged, ids)).abs().max().item() < 1e-3
    with pytest.raises(LoraError, match="max_loras"):
        runner.execute(ModelInput([sequence(ids, 0, list(range(8)), (1, adapters["a"][0])),
                                   sequence(ids, 0, list(range(8, 16)),
                                            (2, adapters["b"][0]))]))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_base_stays_quantized_and_takes_the_adapter(tiny_lora, mode):
    """A base quantized at load (served as blocks, the integer kernel for the decode rows)
    plus the adapter, against peft's merge of the adapter into the same quantized weights
    dequantized: within the kernel's own tolerance (tests/test_quantized.py's)."""
    folder, base, adapters = tiny_lora
    quantized = lora_runner(folder, quantization=mode, quant_gemv_max_rows=4)
    assert quantized.quantized_types
    loaded = load_model(str(folder), torch.float32, mode)
    dequantized = copy.deepcopy(base)
    dequantized.load_state_dict({k: dequantize_torch(v) if isinstance(v, QuantizedWeight) else v
                                 for k, v in loaded.weights.items()}, strict=False)
    path = adapters["a"][0]
    merged = peft.PeftModel.from_pretrained(dequantized, path).merge_and_unload().eval()
    ids = list(range(3, 23))
    table = list(range(8))
    got = torch.cat(
        [quantized.execute(ModelInput([sequence(ids[:16], 0, table, (1, path))]))]
        + [quantized.execute(ModelInput([sequence([t], 16 + i, table, (1, path))]))
           for i, t in enumerate(ids[16:])])
    want = reference_logits(merged, ids)
    tolerance = 0.05 if mode == "int8" else 0.1
    assert (got - want).abs().max() <= tolerance * want.abs().max()
    without = quantized.execute(ModelInput([sequence(ids, 0, table, None)]))
    assert (without - want).abs().max() > 2 * tolerance * want.abs().max()


def test_fused_decoder_adds_each_rows_adapter(tiny_lora):
    """A decode step of base, a and b rows over a quantized base runs in the native fused
    decoder (its lora_add kernel): each row's logits equal the layers' path's for the same step
    and the row's own alone; the adapted rows differ from the base's."""
    folder, _, adapters = tiny_lora
    loras = [None, (1, adapters["a"][0]), (2, adapters["b"][0])]
    prompts = [list(range(3 + i, 15 + i)) for i in range(len(loras))]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(loras))]

    def decode_step(fused: bool, rows: list[int]) -> torch.Tensor:
        runner = lora_runner(folder, quantization="int8", quant_gemv_max_rows=4)
        if not fused:
            runner.model.__dict__["native_decoder"] = None  # the cached property, unset
        for i in rows:
            runner.execute(ModelInput([sequence(prompts[i][:-1], 0, tables[i], loras[i])]))
        logits = runner.execute(ModelInput([sequence(prompts[i][-1:], len(prompts[i]) - 1,
                                                     tables[i], loras[i]) for i in rows]))
        assert (runner.model.__dict__["native_decoder"] is not None) == fused
        return logits

    fused = decode_step(True, [0, 1, 2])
    assert (fused - decode_step(False, [0, 1, 2])).abs().max().item() < 1e-4
    alone = torch.cat([decode_step(True, [i]) for i in range(len(loras))])
    assert (fused - alone).abs().max().item() < 1e-5
    loras[1:] = [None, None]
    base_rows = decode_step(True, [1, 2])
    assert (fused[1:] - base_rows).abs().max().item() > 1e-2


def write_adapter(folder: Path, source: Path, **config_changes) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


@pytest.mark.parametrize("changes, refusal", [
    ({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"), ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"r": 64}, "max_lora_rank"), ({"peft_type": "IA3"}, "peft_type")])
def test_unsupported_adapters_are_refused_by_name(tiny_lora, tmp_path, changes, refusal):
    path = write_adapter(tmp_path / "adapter", tiny_lora[2]["a"][0], **changes)
    with pytest.raises(LoraError, match=refusal):
        load_peft_adapter(path, max_rank=16)
    with pytest.raises(LoraError, match="adapter_config.json"):
        load_peft_adapter(tmp_path / "missing", max_rank=16)


def test_adapters_never_share_cached_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = LoRARequest("a", 1, "/adapters/a")
    admit(kv, Request("r1", list(range(9)), lora_request=a))
    assert kv.get_computed_blocks(Request("r2", list(range(9)), lora_request=a))[1] == 8
    other = LoRARequest("b", 2, "/adapters/b")
    assert kv.get_computed_blocks(Request("r3", list(range(9)), lora_request=other))[1] == 0
    assert kv.get_computed_blocks(Request("r4", list(range(9))))[1] == 0  # nor with the base


@pytest.fixture(scope="module")
def tiny_lora_llm_folder(tiny_lora):
    """The tiny base with the default model's tokenizer files, so `LLM` can serve it."""
    folder = tiny_lora[0]
    tokenizer_folder = resolve_model(None).folder
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return folder


def peft_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("max_loras", [1, 2])
def test_llm_generate_mixed_adapters_matches_peft(tiny_lora, tiny_lora_llm_folder, max_loras):
    """LLM.generate with a LoRARequest per prompt (base, a, b, a): greedy tokens equal peft's
    merged models' `generate`; with max_loras=1 the adapters take turns, still exact."""
    from treadle.llm import LLM

    _, base, adapters = tiny_lora
    llm = LLM(str(tiny_lora_llm_folder), dtype="float32", enable_lora=True,
              max_loras=max_loras, kv_cache_memory_bytes=16 << 20)
    a = LoRARequest("a", 1, str(adapters["a"][0]))
    b = LoRARequest("b", 2, str(adapters["b"][0]))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (6, 13, 9, 6)]
    loras = [None, a, b, a]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    models = {None: base, 1: adapters["a"][1], 2: adapters["b"][1]}
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        want = peft_greedy(models[None if lora is None else lora.lora_int_id], prompt, 10)
        assert list(output.outputs[0].token_ids) == want


def test_scheduler_keeps_at_most_max_loras_adapters_running(tiny_lora, tiny_lora_llm_folder):
    from treadle.llm import LLM

    adapters = tiny_lora[2]
    llm = LLM(str(tiny_lora_llm_folder), dtype="float32", enable_lora=True, max_loras=1,
              kv_cache_memory_bytes=16 << 20)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(["a", "b", "a", "b"]):
        engine.add_request(str(i), [5, 6, 7], params,
                           lora_request=LoRARequest(name, 1 + (name == "b"),
                                                    str(adapters[name][0])))
    seen = set()
    engine.step()
    # What the lora_requests_info gauge reports: a running, b waiting for its turn.
    assert adapter_names(engine.scheduler.running) == ("a",)
    assert adapter_names(engine.scheduler.waiting) == ("b",)
    while engine.has_unfinished_requests():
        running = {r.lora_request.lora_int_id for r in engine.scheduler.running}
        assert len(running) <= 1
        seen |= running
        engine.step()
    assert seen == {1, 2}


def test_engine_refuses_adapters_it_cannot_serve(tiny_lora, tiny_lora_llm_folder, tmp_path):
    from treadle.llm import LLM

    params = SamplingParams(max_tokens=2)
    plain = LLM(str(tiny_lora_llm_folder), dtype="float32", kv_cache_memory_bytes=16 << 20)
    adapter = LoRARequest("a", 1, str(tiny_lora[2]["a"][0]))
    with pytest.raises(InvalidField, match="enable-lora"):
        plain.engine.add_request("x", [5, 6], params, lora_request=adapter)
    llm = LLM(str(tiny_lora_llm_folder), dtype="float32", enable_lora=True, max_lora_rank=4,
              kv_cache_memory_bytes=16 << 20)
    with pytest.raises(InvalidField, match="max_lora_rank") as refused:
        llm.engine.add_request("y", [5, 6], params, lora_request=adapter)
    assert refused.value.param == "model"
    with pytest.raises(InvalidField, match="adapter_config.json"):
        llm.engine.add_request("z", [5, 6], params,
                               lora_request=LoRARequest("gone", 3, str(tmp_path / "gone")))
    assert not llm.engine.has_unfinished_requests()


def post_json(port: int, path: str, body: dict, key: str | None = "sekrit"
              ) -> tuple[int, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    response = conn.getresponse()
    data = response.read().decode()
    try:
        return response.status, json.loads(data)
    except json.JSONDecodeError:
        return response.status, data


def test_server_model_picks_the_adapter_and_adapters_load_and_unload(tiny_lora,
                                                                      tiny_lora_llm_folder,
                                                                      caplog):
    """Through `treadle serve`'s frontends and the official client: `model` names the adapter
    (greedy text equal to the offline LLM's with that adapter), /v1/models lists adapters with
    their base as parent, an unknown model is a 404 in OpenAI's shape, and adapters load and
    unload live behind the API key."""
    import openai
    from frontends import start_frontends, stop_frontends, wait_started

    from treadle.config import AsyncEngineConfig, ServerConfig, build_config
    from treadle.frontend.async_engine import AsyncEngine
    from treadle.llm import LLM
    from treadle.server.auth import parse_api_keys

    adapters = tiny_lora[2]
    settings = dict(model=str(tiny_lora_llm_folder), dtype="float32", enable_lora=True,
                    max_loras=2, kv_cache_memory_bytes=16 << 20)
    engine = AsyncEngine(build_config(AsyncEngineConfig, settings))
    config = ServerConfig(port=0, api_keys=tuple(parse_api_keys(["sekrit"])),
                          lora_modules=(f"a={adapters['a'][0]}",))
    frontends, thread = start_frontends(engine, config)
    prompt = [5, 17, 99, 23, 42, 7]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(**settings)
    want = {name: llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
            .outputs[0].text
            for name, lora in [("base", None), ("a", LoRARequest("a", 1, str(adapters["a"][0]))),
                               ("b", LoRARequest("b", 2, str(adapters["b"][0])))]}
    assert len(set(want.values())) == 3  # the adapters change the text
    try:
        wait_started(frontends, thread)
        port = frontends.port
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekrit",
                               max_retries=0, timeout=60)
        base = engine.model_name

        def complete(model: str) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                             temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {base, "a"} and models["a"].model_extra["parent"] == base
        with caplog.at_level(logging.INFO, logger="treadle.frontend.observer"):
            assert complete(base) == want["base"] and complete("a") == want["a"]
        finished = [r.getMessage() for r in caplog.records if " finished: " in r.getMessage()]
        assert len(finished) == 2
        assert "lora" not in finished[0] and ", lora a," in finished[1]
        metrics = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        metrics.request("GET", "/metrics", headers={"Authorization": "Bearer sekrit"})
        assert 'max_lora="2"' in metrics.getresponse().read().decode()
        with pytest.raises(openai.NotFoundError) as missing:
            complete("b")
        assert missing.value.body["code"] == "model_not_found"

        assert post_json(port, "/v1/load_lora_adapter",
                         {"lora_name": "b", "lora_path": str(adapters["b"][0])}, key=None)[0] == 401
        status, _ = post_json(port, "/v1/load_lora_adapter",
                              {"lora_name": "b", "lora_path": str(adapters["b"][0])})
        assert status == 200
        assert complete("b") == want["b"]
        assert post_json(port, "/v1/load_lora_adapter",
                         {"lora_name": "b", "lora_path": str(adapters["b"][0])})[0] == 400
        assert post_json(port, "/v1/load_lora_adapter",
                         {"lora_name": "c", "lora_path": "/nowhere"})[0] == 400
        assert post_json(port, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
        with pytest.raises(openai.NotFoundError):
            complete("b")
        status, body = post_json(port, "/v1/unload_lora_adapter", {"lora_name": "b"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert complete("a") == want["a"]
    finally:
        stop_frontends(frontends, thread)
