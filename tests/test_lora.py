"""LoRA adapters against peft: two adapters trained a few steps in the test on a tiny random
Llama, saved in PEFT's format; our logits (base never merged) against peft's merged model's,
rows of a mixed batch against the same rows alone, a quantized base, and the refusals.

The same adapters as GGUF LoRA files, written in the test as llama.cpp's convert_lora_to_gguf.py
writes them (lora_a [r, in] and lora_b [out, r] as stored, lora_b's q/k rows permuted for the
llama arch, F32/F16/BF16/Q8_0): against peft's merged model of the same stored weights and the
PEFT folder; the refusals; the server."""

from __future__ import annotations

import copy
import http.client
import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import peft
import pytest
import torch
from gguf.quants import QuantError, dequantize, quantize
from model_utils import build_tiny_model, make_runner, permute_like_llama_cpp
from safetensors.torch import load_file, save_file
from test_kv_cache import admit

from treadle.core.engine_process import adapter_names
from treadle.core.kv_cache import KVCacheManager
from treadle.core.lora_request import LoRARequest
from treadle.core.request import Request
from treadle.core.sampling_params import SamplingParams
from treadle.errors import InvalidField
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.family import ModelSpec
from treadle.model.kernels import load_kernels
from treadle.model.loader import load_model
from treadle.model.lora import LoraError, check_adapter, load_adapter, load_peft_adapter
from treadle.model.models.llama import GGUF_TENSOR_NAMES, LlamaModel
from treadle.model.quantization import QuantizedWeight, dequantize_torch
from treadle.model.registry import spec_from_config
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


def test_a_slot_outlives_its_adapter_dropped_from_memory(tiny_lora):
    """Two slots, two adapters kept in memory, four ids: b stays in its slot while the others
    come and go, and a newcomer never takes the slot of an adapter in the same step."""
    folder, _, adapters = tiny_lora
    runner = lora_runner(folder, max_loras=2, max_cpu_loras=2)
    ids = list(range(5, 25))
    a, b = adapters["a"], adapters["b"]
    for other in (1, 3, 4):  # 3 and 4: a's files under new ids, each dropping the oldest
        got = runner.execute(ModelInput([sequence(ids, 0, list(range(8)), (2, b[0])),
                                         sequence(ids, 0, list(range(8, 16)), (other, a[0]))]))
        rows = len(ids)
        assert (got[:rows] - reference_logits(b[1], ids)).abs().max().item() < 1e-3, other
        assert (got[rows:] - reference_logits(a[1], ids)).abs().max().item() < 1e-3, other


def test_a_cold_adapter_loads_off_the_step(tiny_lora, tiny_lora_llm_folder):
    """A request for an adapter not yet in memory waits while its adapter loads in the
    background; the base request beside it runs meanwhile; both end with peft's tokens."""
    from treadle.llm import LLM

    _, base, adapters = tiny_lora
    llm = LLM(str(tiny_lora_llm_folder), dtype="float32", kv_cache_dtype="float32",
              enable_lora=True, kv_cache_memory_bytes=16 << 20)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    engine.add_request("base", prompt, params)
    engine.add_request("a", prompt, params,
                       lora_request=LoRARequest("a", 1, str(adapters["a"][0])))
    tokens: dict[str, list[int]] = {"base": [], "a": []}
    for output in engine.step():
        tokens[output.request_id] += output.new_token_ids
    assert [r.request_id for r in engine.scheduler.running] == ["base"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["a"]
    slots = engine.executor.runner.lora
    loading_id, load = slots.loading
    assert loading_id == 1 and 1 not in slots.adapters
    load.result()  # once loaded, the next step takes the request
    for output in engine.step():
        tokens[output.request_id] += output.new_token_ids
    assert "a" in {r.request_id for r in engine.scheduler.running}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens["a"] == peft_greedy(adapters["a"][1], prompt, 6)
    assert tokens["base"] == peft_greedy(base, prompt, 6)


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


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_native_lora_rows_equal_torchs_product(rows_dtype, adapter_dtype):
    """The native lora_add adds (x·A)·B by each row's slot and leaves slot -1 rows alone: equal
    to torch's product, on one thread (so tasks take up to 4 rows), with slots of 6 rows (a task
    of 4 and one of 2), 3 and 1, a slot's adapter of a lower rank than the slots' (zero ranks),
    and widths of whole column blocks and a tail."""
    kernels = load_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(3)
    num_slots, rank, in_features, part_sizes = 3, 8, 37, [40, 13, 13]
    offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes) + 1)]
    a = torch.randn(num_slots, in_features, len(part_sizes) * rank, generator=gen)
    b = torch.zeros(num_slots, len(part_sizes) * rank, offsets[-1])
    for p in range(len(part_sizes)):
        ranks = slice(p * rank, (p + 1) * rank)
        b[:, ranks, offsets[p]:offsets[p + 1]] = torch.randn(
            num_slots, rank, part_sizes[p], generator=gen)
        a[1, :, p * rank + 3:(p + 1) * rank] = 0  # slot 1: a rank-3 adapter
    a, b = a.to(adapter_dtype), b.to(adapter_dtype)
    slots = torch.tensor([-1, 0, 1, 0, 1, 0, 0, 0, 2, 1, -1, 0])
    x = torch.randn(len(slots), in_features, generator=gen).to(rows_dtype)
    y = torch.randn(len(slots), offsets[-1], generator=gen).to(rows_dtype)
    want = y.float().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[row] += (x[row].float() @ a[slot].float()) @ b[slot].float()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kernels.lora_add(y, x, a, b, slots, offsets, rank)
    finally:
        torch.set_num_threads(threads)
    tolerance = 1e-4 if rows_dtype == torch.float32 else 2e-2
    assert (y.float() - want).abs().max().item() <= tolerance * want.abs().max().item()


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


def test_a_decode_step_of_many_rows_of_one_adapter_runs_layer_by_layer(tiny_lora, monkeypatch):
    """Past 16 rows an adapter's rows take matmuls over a segment in the layers' path, not
    lora_add, which the fused decoder runs: such a step leaves the fused decoder (its logits
    would round otherwise), a step of a few adapted rows stays in it."""
    if load_kernels() is None or not load_kernels().quant_gemm_types():
        pytest.skip("no integer GEMM in this build: the fused decoder takes one row")
    folder, _, adapters = tiny_lora
    runner = lora_runner(folder, quantization="int4", quant_gemv_max_rows=1)
    taken = []
    fused_decode = LlamaModel.fused_decode

    def record(model, meta, hidden):
        taken.append(fused_decode(model, meta, hidden))
        return taken[-1]

    monkeypatch.setattr(LlamaModel, "fused_decode", record)
    lora = (1, adapters["a"][0])
    for i in range(18):
        runner.execute(ModelInput([sequence([3 + i, 4, 5], 0, [i], lora)]))
    for rows in (3, 18):
        runner.execute(ModelInput([sequence([6], 3, [i], lora) for i in range(rows)]))
        assert taken[-1] == (rows <= 16), rows


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_bfloat16_adapters_beside_a_float32_model(tiny_lora, quantization):
    """--lora-dtype bfloat16 on a float32 model: adapters stored in bfloat16, every path (a
    segment's matmuls, the native rows, the fused decoder) within bfloat16's rounding of the
    float32 adapters' logits, and far from the base's."""
    folder, _, adapters = tiny_lora
    path = adapters["a"][0]
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    steps = [ids[:20], ids[20:26]] + [[t] for t in ids[26:]]  # segment, native rows, decodes

    def logits(lora_dtype: str, lora: tuple[int, Path] | None) -> torch.Tensor:
        runner = lora_runner(folder, quantization=quantization, quant_gemv_max_rows=4,
                             lora_dtype=lora_dtype)
        assert runner.lora.layers[0]["qkv"].a.dtype == getattr(torch, lora_dtype)
        start, rows = 0, []
        for chunk in steps:
            rows.append(runner.execute(ModelInput([sequence(chunk, start, list(range(8)),
                                                            lora)])))
            start += len(chunk)
        return torch.cat(rows)

    full, half = logits("float32", (1, path)), logits("bfloat16", (1, path))
    moved = (full - logits("float32", None)).abs().max().item()
    assert (half - full).abs().max().item() < moved / 20


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
        load_peft_adapter(path, 16, tiny_spec(tiny_lora[0]))
    with pytest.raises(LoraError, match="adapter_config.json"):
        load_peft_adapter(tmp_path / "missing", 16, tiny_spec(tiny_lora[0]))


def write_tensors(folder: Path, tensors: dict[str, torch.Tensor], r: int = 4) -> Path:
    """A PEFT folder of the given lora_A/lora_B tensors (random ones, of any names and shapes)."""
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    return folder


def pair(module: str, fan_in: int, fan_out: int, r: int = 4) -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.model.layers.{module}"
    return {f"{prefix}.lora_A.weight": torch.randn(r, fan_in),
            f"{prefix}.lora_B.weight": torch.randn(fan_out, r)}


def test_peft_adapters_are_checked_against_the_model_before_they_load(tiny_lora, tmp_path):
    """An adapter of another model's shape, past the last layer, on a module LoRA does not
    serve, or with a lone A is refused when a request names it (the safetensors header read,
    no weights), not in a step."""
    spec = tiny_spec(tiny_lora[0])
    hidden, q = spec.hidden_size, spec.num_heads * spec.head_dim
    bad = {"another model's shape": (pair("0.self_attn.q_proj", hidden + 8, q), "another base"),
           "past the last layer": (pair(f"{spec.num_layers}.self_attn.q_proj", hidden, q),
                                   "not a module"),
           "a norm": (pair("0.input_layernorm", hidden, hidden), "not a module"),
           "a lone A": ({k: v for k, v in pair("0.self_attn.q_proj", hidden, q).items()
                         if "lora_A" in k}, "lacks its lora_B"),
           "rank unlike r": (pair("0.self_attn.q_proj", hidden, q, r=2), r"r=4")}
    for i, (tensors, refusal) in enumerate(bad.values()):
        folder = write_tensors(tmp_path / f"bad-{i}", tensors)
        with pytest.raises(LoraError, match=refusal):
            check_adapter(folder, 16, spec)
        with pytest.raises(LoraError, match=refusal):
            load_adapter(folder, 16, spec)
    good = write_tensors(tmp_path / "good", pair("0.self_attn.q_proj", hidden, q))
    check_adapter(good, 16, spec)
    assert set(load_adapter(good, 16, spec).weights) == {(0, "q_proj")}


def test_moe_model_adapters_serve_attention_and_refuse_experts(tmp_path):
    """On a mixture of experts: an attention adapter trained by peft gives peft's merged
    logits; one on the experts, or on a sparse layer's feed-forward, is refused by name."""
    base = build_tiny_model("qwen3-moe", tmp_path)
    adapter = tmp_path / "attention"
    merged = train_adapter(base, adapter, 7, r=8, lora_alpha=16,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    ids = list(range(5, 25))
    want = reference_logits(merged, ids)
    assert (want - reference_logits(base, ids)).abs().max() > 1e-2
    runner = lora_runner(tmp_path)
    got = runner.execute(ModelInput([sequence(ids, 0, list(range(8)), (1, adapter))]))
    assert (got - want).abs().max().item() < 1e-3
    spec = tiny_spec(tmp_path)
    hidden, inter = spec.hidden_size, spec.intermediate_size
    for i, module in enumerate(["0.mlp.experts.0.gate_proj", "0.mlp.gate_proj"]):
        folder = write_tensors(tmp_path / f"ffn-{i}", pair(module, hidden, inter))
        with pytest.raises(LoraError, match="no experts"):
            check_adapter(folder, 16, spec)


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
    llm = LLM(str(tiny_lora_llm_folder), dtype="float32", kv_cache_dtype="float32",
              enable_lora=True, max_loras=max_loras, kv_cache_memory_bytes=16 << 20)
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
    engine.step()  # a's load starts; then a runs
    engine.executor.runner.lora.loading[1].result()
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


def offline_texts(settings: dict, adapters: dict, prompt: list[int], max_tokens: int
                  ) -> dict[str, str]:
    """The greedy text of `prompt` by the offline LLM: the base's, adapter a's and b's."""
    from treadle.llm import LLM

    llm = LLM(**settings)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return {name: llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
            .outputs[0].text
            for name, lora in [("base", None), ("a", LoRARequest("a", 1, str(adapters["a"][0]))),
                               ("b", LoRARequest("b", 2, str(adapters["b"][0])))]}


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
    from treadle.server.auth import parse_api_keys

    adapters = tiny_lora[2]
    settings = dict(model=str(tiny_lora_llm_folder), dtype="float32", enable_lora=True,
                    max_loras=2, kv_cache_memory_bytes=16 << 20)
    engine = AsyncEngine(build_config(AsyncEngineConfig, settings))
    config = ServerConfig(port=0, api_keys=tuple(parse_api_keys(["sekrit"])),
                          lora_modules=(f"a={adapters['a'][0]}",))
    frontends, thread = start_frontends(engine, config)
    prompt = [5, 17, 99, 23, 42, 7]
    want = offline_texts(settings, adapters, prompt, 8)
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


def test_adapters_load_and_unload_under_traffic_with_nothing_dropped(tiny_lora,
                                                                    tiny_lora_llm_folder):
    """Streams of the base and of adapter a run on six client threads while b is loaded,
    used and unloaded three times: every stream ends whole with its own greedy text, and b's
    answers are b's."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from frontends import start_frontends, stop_frontends, wait_started

    from treadle.config import AsyncEngineConfig, ServerConfig, build_config
    from treadle.frontend.async_engine import AsyncEngine
    from treadle.server.auth import parse_api_keys

    adapters = tiny_lora[2]
    settings = dict(model=str(tiny_lora_llm_folder), dtype="float32", enable_lora=True,
                    max_loras=2, kv_cache_memory_bytes=16 << 20)
    prompt = [5, 17, 99, 23, 42, 7]
    want = offline_texts(settings, adapters, prompt, 32)
    engine = AsyncEngine(build_config(AsyncEngineConfig, settings))
    config = ServerConfig(port=0, api_keys=tuple(parse_api_keys(["sekrit"])),
                          lora_modules=(f"a={adapters['a'][0]}",))
    frontends, thread = start_frontends(engine, config)
    try:
        wait_started(frontends, thread)
        port = frontends.port
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekrit",
                               max_retries=0, timeout=120)
        models = {"base": engine.model_name, "a": "a", "b": "b"}

        def stream(name: str) -> tuple[str, str, str | None]:
            text, reason = "", None
            for chunk in client.completions.create(
                    model=models[name], prompt=prompt, max_tokens=32, temperature=0.0,
                    stream=True, extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return name, text, reason

        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(stream, "a" if i % 2 else "base") for i in range(24)]
            for _ in range(3):
                assert post_json(port, "/v1/load_lora_adapter",
                                 {"lora_name": "b", "lora_path": str(adapters["b"][0])})[0] == 200
                assert stream("b") == ("b", want["b"], "length")
                assert post_json(port, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
            for done in streams:
                name, text, reason = done.result()
                assert (text, reason) == (want[name], "length"), name
    finally:
        stop_frontends(frontends, thread)


def grpc_text(stub, model: str, prompt: list[int], key: str) -> str:
    """A greedy Generate's text (gRPC's `model` picks the adapter as REST's does)."""
    from treadle.server.grpc import treadle_pb2 as pb

    request = pb.GenerateRequest(model=model, token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParameters(temperature=0.0),
                                 stop=pb.StopCriteria(max_tokens=8, ignore_eos=True))
    responses = stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),),
                              timeout=60)
    return "".join(r.chunk.text for r in responses if r.HasField("chunk"))


def test_keys_bound_to_adapters_over_rest_and_grpc(tiny_lora, tiny_lora_llm_folder):
    """A key bound to adapter a (`acme:acme-key::a`) over both frontends: a and the base serve
    it; b, loaded live by an unbound key, is to it a model that does not exist (REST 404
    model_not_found with an unknown model's message, gRPC NOT_FOUND), missing from its
    /v1/models; it may not load or unload adapters (403). gRPC's `model` gives the adapter's
    text, equal to REST's for the same greedy request, also for the adapter loaded over REST."""
    import grpc
    import openai
    from frontends import start_frontends, stop_frontends, wait_started

    from treadle.config import AsyncEngineConfig, ServerConfig, build_config
    from treadle.frontend.async_engine import AsyncEngine
    from treadle.server.auth import parse_api_keys
    from treadle.server.grpc import treadle_pb2_grpc as pb_grpc

    adapters = tiny_lora[2]
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_lora_llm_folder), dtype="float32", enable_lora=True, max_loras=2,
        kv_cache_memory_bytes=16 << 20)))
    config = ServerConfig(port=0, grpc_port=0,
                          api_keys=tuple(parse_api_keys(["sekrit"], ["acme:acme-key::a"])),
                          lora_modules=(f"a={adapters['a'][0]}",))
    frontends, thread = start_frontends(engine, config)
    prompt = [5, 17, 99, 23, 42, 7]
    try:
        wait_started(frontends, thread)
        port, base = frontends.port, engine.model_name
        admin, acme = (openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                                     max_retries=0, timeout=60)
                       for key in ("sekrit", "acme-key"))

        def complete(client: openai.OpenAI, model: str) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                             temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        load = {"lora_name": "b", "lora_path": str(adapters["b"][0])}
        status, body = post_json(port, "/v1/load_lora_adapter", load, key="acme-key")
        assert status == 403 and body["error"]["code"] == "permission_denied"
        assert post_json(port, "/v1/load_lora_adapter", load)[0] == 200
        assert post_json(port, "/v1/unload_lora_adapter", {"lora_name": "a"},
                         key="acme-key")[0] == 403

        assert {m.id for m in admin.models.list().data} == {base, "a", "b"}
        assert {m.id for m in acme.models.list().data} == {base, "a"}
        texts = {model: complete(admin, model) for model in (base, "a", "b")}
        assert len(set(texts.values())) == 3  # each adapter changes the text
        assert complete(acme, "a") == texts["a"] and complete(acme, base) == texts[base]

        refusals = {}
        for model in ("b", "no-such-adapter"):
            with pytest.raises(openai.NotFoundError) as missing:
                complete(acme, model)
            error = missing.value.body
            assert error["code"] == "model_not_found" and error["param"] == "model"
            refusals[model] = error["message"].replace(f"`{model}`", "`X`")
            status, body = http_get(port, f"/v1/models/{model}", "acme-key")
            assert status == 404 and body["error"]["message"] == error["message"]
        assert refusals["b"] == refusals["no-such-adapter"]  # b's existence not revealed
        assert "does not exist or you do not have access to it" in refusals["b"]
        assert http_get(port, "/v1/models/b", "sekrit")[0] == 200

        with grpc.insecure_channel(f"127.0.0.1:{frontends.grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            for model in ("", base, "a", "b"):  # b: loaded over REST, named over gRPC
                assert grpc_text(stub, model, prompt, "sekrit") == texts[model or base]
            assert grpc_text(stub, "a", prompt, "acme-key") == texts["a"]
            details = {}
            for key, model in (("sekrit", "no-such-adapter"), ("acme-key", "b"),
                               ("acme-key", "no-such-adapter")):
                with pytest.raises(grpc.RpcError) as refused:
                    grpc_text(stub, model, prompt, key)
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
                details[key, model] = refused.value.details().replace(repr(model), "X")
            assert details["acme-key", "b"] == details["acme-key", "no-such-adapter"]
            assert "does not exist or you do not have access" in details["acme-key", "b"]
    finally:
        stop_frontends(frontends, thread)


def http_get(port: int, path: str, key: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


Q = gguf.GGMLQuantizationType
# Hugging Face module name (layer as {}) → llama.cpp's tensor name.
TO_GGUF = {hf.removesuffix(".weight"): g for g, hf in GGUF_TENSOR_NAMES.items()}


def tiny_spec(folder: Path) -> ModelSpec:
    return spec_from_config(json.loads((folder / "config.json").read_text()))


def gguf_lora_tensors(adapter: Path, spec: ModelSpec, qtype: Q
                      ) -> tuple[dict[str, tuple[np.ndarray, Q]], dict[str, torch.Tensor]]:
    """The PEFT folder's matrices as llama.cpp stores them: name → (data, type); lora_b of
    q/k rows permuted; `qtype` where the rows fit its blocks, else F16 (the converter's
    fallback). Also peft's state dict of what the stored data dequantizes to."""
    stored, roundtrip = {}, {}
    for key, weight in load_file(str(adapter / "adapter_model.safetensors")).items():
        module = key.removeprefix("base_model.model.").split(".lora_")[0]
        layer = module.split(".")[2]
        name = TO_GGUF[module.replace(f".{layer}.", ".{}.", 1)].format(layer)
        half = "lora_a" if ".lora_A." in key else "lora_b"
        rows, row_of = weight.numpy(), np.arange(weight.shape[0])
        if half == "lora_b" and module.endswith(("q_proj", "k_proj")):
            heads = spec.num_heads if module.endswith("q_proj") else spec.num_kv_heads
            rows, row_of = (permute_like_llama_cpp(rows, heads),
                            permute_like_llama_cpp(row_of, heads))
        try:
            data, kind = quantize(rows, qtype), qtype
        except QuantError:
            data, kind = quantize(rows, Q.F16), Q.F16
        stored[f"{name}.{half}"] = (data, kind)
        back = np.empty_like(rows)
        back[row_of] = dequantize(data, kind).reshape(rows.shape)
        roundtrip[key] = torch.from_numpy(back)
    return stored, roundtrip


def write_gguf_lora(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], alpha: float,
                    arch: str = "llama", general_type: str = "adapter",
                    arrays: dict[str, list[int]] | None = None) -> Path:
    """A GGUF file with llama.cpp's adapter metadata and `tensors`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, values in (arrays or {}).items():
        writer.add_array(key, values)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_alpha(adapter: Path) -> float:
    """adapter.lora.alpha for a PEFT folder. llama.cpp scales by alpha / r; its converter writes
    lora_alpha and ignores use_rslora, so an rsLoRA adapter gets alpha·√r (PEFT's alpha / √r)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    alpha = float(config["lora_alpha"])
    return alpha * config["r"] ** 0.5 if config.get("use_rslora") else alpha


def convert(adapter: Path, spec: ModelSpec, path: Path, qtype: Q = Q.F32
            ) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors, roundtrip = gguf_lora_tensors(adapter, spec, qtype)
    return write_gguf_lora(path, tensors, gguf_alpha(adapter)), roundtrip


@pytest.mark.parametrize("name, qtype_name", [("a", "F32"), ("b", "F32"), ("a", "F16"),
                                              ("a", "BF16"), ("a", "Q8_0")])
def test_gguf_adapter_logits_match_peft_and_the_peft_folder(tiny_lora, tmp_path, name,
                                                            qtype_name):
    """Adapter a targets every module (q and k, GQA: their lora_b rows come permuted), b is
    rsLoRA on q, v and down. The reference: peft's merged model of the weights as stored (so a
    quantized file is compared exactly); in F32 also Treadle's own logits with the folder."""
    folder, base, adapters = tiny_lora
    spec, qtype = tiny_spec(folder), Q[qtype_name]
    peft_folder = adapters[name][0]
    path, stored = convert(peft_folder, spec, tmp_path / f"{name}.gguf", qtype)
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), peft_folder)
    peft.set_peft_model_state_dict(model, stored)
    merged = model.merge_and_unload().eval()
    ids = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    want = reference_logits(merged, ids)
    assert (want - reference_logits(base, ids)).abs().max() > 1e-2  # the adapter shows

    runner = lora_runner(folder)
    table = list(range(8))
    got = runner.execute(ModelInput([sequence(ids, 0, table, (1, path))]))
    assert (got - want).abs().max().item() < 1e-3
    if qtype == Q.F32:
        with_folder = runner.execute(ModelInput([sequence(ids, 0, list(range(8, 16)),
                                                          (2, peft_folder))]))
        assert (got - with_folder).abs().max().item() < 1e-5


def test_gguf_and_peft_adapters_load_the_same_matrices(tiny_lora, tmp_path):
    """Module by module, A and B (scale folded) from the file equal the folder's: the q/k rows
    come back in Hugging Face's order."""
    folder, _, adapters = tiny_lora
    spec = tiny_spec(folder)
    for name, (peft_folder, _) in adapters.items():
        path, _ = convert(peft_folder, spec, tmp_path / f"{name}.gguf")
        from_file = load_adapter(path, 16, spec)
        from_folder = load_adapter(peft_folder, 16, spec)
        assert from_file.weights.keys() == from_folder.weights.keys()
        assert from_file.rank == from_folder.rank
        for key, (a, b) in from_folder.weights.items():
            torch.testing.assert_close(from_file.weights[key][0], a, rtol=0, atol=0)
            torch.testing.assert_close(from_file.weights[key][1], b, rtol=1e-6, atol=1e-7)


def refused_file(kind: str, adapter: Path, spec: ModelSpec, folder: Path) -> Path:
    """A file of `kind` that Treadle must refuse."""
    path = folder / f"{kind}.gguf"
    tensors, _ = gguf_lora_tensors(adapter, spec, Q.F32)
    a_b = tensors["blk.0.attn_q.weight.lora_a"], tensors["blk.0.attn_q.weight.lora_b"]
    if kind == "text":
        path.write_text("not a GGUF file at all\n")
        return path
    if kind == "model":
        return write_gguf_lora(path, tensors, 16.0, general_type="model")
    if kind == "arch":
        return write_gguf_lora(path, tensors, 16.0, arch="qwen2")
    if kind == "norm":
        tensors["blk.0.attn_norm.weight"] = (np.ones(spec.hidden_size, np.float32), Q.F32)
    elif kind == "half":
        del tensors["blk.0.attn_q.weight.lora_b"]
    elif kind == "embedding":
        tensors["token_embd.weight.lora_a"], tensors["token_embd.weight.lora_b"] = a_b
    elif kind == "layer":
        tensors["blk.9.attn_q.weight.lora_a"], tensors["blk.9.attn_q.weight.lora_b"] = a_b
    elif kind == "shape":
        tensors["blk.0.attn_k.weight.lora_a"], tensors["blk.0.attn_k.weight.lora_b"] = a_b
    elif kind == "alora":
        return write_gguf_lora(path, tensors, 16.0, arrays={
            gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS: [5, 6]})
    return write_gguf_lora(path, tensors, 16.0)


@pytest.mark.parametrize("kind, refusal", [
    ("text", "not a valid GGUF"), ("model", "not a LoRA adapter"), ("arch", "'qwen2' model"),
    ("norm", "not a lora_a or lora_b"), ("half", "lacks its lora_b"),
    ("embedding", "not a module LoRA serves"), ("layer", "not a module LoRA serves"),
    ("shape", "another base model"), ("alora", "activated LoRA")])
def test_gguf_files_treadle_cannot_serve_are_refused(tiny_lora, tmp_path, kind, refusal):
    folder, _, adapters = tiny_lora
    spec = tiny_spec(folder)
    path = refused_file(kind, adapters["a"][0], spec, tmp_path)
    with pytest.raises(LoraError, match=refusal):
        check_adapter(path, 16, spec)
    with pytest.raises(LoraError, match=refusal):
        load_adapter(path, 16, spec)


def test_gguf_rank_above_max_lora_rank_is_refused(tiny_lora, tmp_path):
    folder, _, adapters = tiny_lora
    spec = tiny_spec(folder)
    path, _ = convert(adapters["a"][0], spec, tmp_path / "a.gguf")
    check_adapter(path, 8, spec)
    with pytest.raises(LoraError, match="rank 8 is above max_lora_rank 4"):
        check_adapter(path, 4, spec)


def test_server_serves_gguf_adapters_and_refuses_bad_files(tiny_lora, tiny_lora_llm_folder,
                                                           tmp_path):
    """`--lora-modules a=a.gguf` and /v1/load_lora_adapter with b.gguf: `model` picks each, the
    text equal to the offline LLM's with the PEFT folders; files that are no GGUF LoRA are a 400
    at load, one for another architecture a 400 on `model` at its first request."""
    import openai
    from frontends import start_frontends, stop_frontends, wait_started

    from treadle.config import AsyncEngineConfig, ServerConfig, build_config
    from treadle.frontend.async_engine import AsyncEngine
    from treadle.llm import LLM
    from treadle.server.auth import parse_api_keys

    folder, _, adapters = tiny_lora
    spec = tiny_spec(folder)
    files = {name: convert(adapters[name][0], spec, tmp_path / f"{name}.gguf")[0]
             for name in ("a", "b")}
    settings = dict(model=str(tiny_lora_llm_folder), dtype="float32", enable_lora=True,
                    max_loras=2, kv_cache_memory_bytes=16 << 20)
    prompt = [5, 17, 99, 23, 42, 7]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(**settings)
    want = {name: llm.generate([prompt], params, use_tqdm=False,
                               lora_request=LoRARequest(name, i, str(adapters[name][0])))[0]
            .outputs[0].text for i, name in enumerate(("a", "b"), start=1)}
    assert want["a"] != want["b"]
    with pytest.raises(InvalidField, match="'qwen2' model") as refused:
        llm.engine.add_request("x", prompt, params, lora_request=LoRARequest(
            "q", 3, str(refused_file("arch", adapters["a"][0], spec, tmp_path))))
    assert refused.value.param == "model"

    engine = AsyncEngine(build_config(AsyncEngineConfig, settings))
    config = ServerConfig(port=0, api_keys=tuple(parse_api_keys(["sekrit"])),
                          lora_modules=(f"a={files['a']}",))
    frontends, thread = start_frontends(engine, config)
    try:
        wait_started(frontends, thread)
        port = frontends.port
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekrit",
                               max_retries=0, timeout=60)

        def complete(model: str) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                             temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        assert complete("a") == want["a"]
        status, _ = post_json(port, "/v1/load_lora_adapter",
                              {"lora_name": "b", "lora_path": str(files["b"])})
        assert status == 200
        assert complete("b") == want["b"]
        for kind, message in [("text", "not a GGUF LoRA file"), ("model", "not a LoRA adapter")]:
            status, body = post_json(port, "/v1/load_lora_adapter", {
                "lora_name": kind,
                "lora_path": str(refused_file(kind, adapters["a"][0], spec, tmp_path))})
            assert status == 400 and message in body["error"]["message"], body
            assert body["error"]["param"] == "lora_path"
        arch = refused_file("arch", adapters["a"][0], spec, tmp_path)
        assert post_json(port, "/v1/load_lora_adapter",
                         {"lora_name": "q", "lora_path": str(arch)})[0] == 200
        with pytest.raises(openai.BadRequestError) as bad:
            complete("q")
        assert "'qwen2' model" in bad.value.body["message"]
        assert complete("a") == want["a"]
    finally:
        stop_frontends(frontends, thread)


@pytest.mark.slow  # transformers dequantizes the default model's GGUF; peft trains on it
def test_default_model_adapters_match_peft_merged_model(tmp_path):
    """Two adapters trained on the default model (its GGUF as transformers loads it): Treadle's
    logits with each, over a prompt and then decode steps, equal peft's merged model's."""
    from transformers import AutoModelForCausalLM

    from treadle.model.source import default_model_path

    path = default_model_path()
    base = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()
    runner = make_runner(None, block_size=16, num_blocks=128, enable_lora=True, max_loras=2)
    ids = torch.randint(3, 2000, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    for lora_id, (name, config) in enumerate(ADAPTERS.items(), start=1):
        folder = tmp_path / name
        merged = train_adapter(base, folder, lora_id, **config)
        want = reference_logits(merged, ids)
        assert (want - reference_logits(base, ids)).abs().max() > 1e-2, name
        table = list(range(10 * lora_id, 10 * lora_id + 4))
        rows = [runner.execute(ModelInput([sequence(ids[:32], 0, table, (lora_id, folder))]))]
        rows += [runner.execute(ModelInput([sequence([t], 32 + i, table, (lora_id, folder))]))
                 for i, t in enumerate(ids[32:])]
        assert (torch.cat(rows) - want).abs().max().item() < 1e-3, name
