"""Mixture-of-experts models beyond the per-position logits of test_model_parity.py: greedy
generation in mixed batches against transformers, experts quantized at load and served from a
GGUF's stacked expert tensors (llama.cpp's layout, written here with the gguf package), and what
the engine refuses."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from model_utils import ARCHITECTURES, TINY, build_tiny_model, greedy_decode, make_runner
from safetensors.torch import load_file
from test_quantized import random_blocks, reference_quant_linear

from treadle.bench.roofline import DecodeCost
from treadle.cli import main
from treadle.config import CacheConfig, EngineConfig, ModelConfig
from treadle.core.engine_core import EngineCore
from treadle.core.engine_process import ready_message
from treadle.core.sampling_params import SamplingParams
from treadle.llm import LLM
from treadle.model import experts as experts_module
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.experts import SparseMoE
from treadle.model.kernels import quant_linear_kernels
from treadle.model.layers import DecoderModel
from treadle.model.linear import QuantizedLinear
from treadle.model.loader import LoadedModel, read_gguf_weights, read_spec
from treadle.model.memory import format_plan, served_weight_bytes
from treadle.model.models.moe import GGUF_TENSOR_NAMES
from treadle.model.parallel import check_tensor_parallel
from treadle.model.quantization import QuantizedWeight
from treadle.model.quantization import dequantize as dequantize_blocks
from treadle.model.runner import ModelRunner
from treadle.model.source import missed_config_fields

CONFIGS = Path(__file__).parent.parent / "bench" / "configs"


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("together", [True, False], ids=["batched", "one-by-one"])
def test_greedy_decoding_with_chunked_prefill_matches_transformers_generate(arch, together,
                                                                            tmp_path):
    """Batched: experts grouped over the step's tokens; one by one: a lone decode token runs
    its own experts in turn."""
    model = build_tiny_model(arch, tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_blocks=256)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 30, 9)]
    ours = greedy_decode(runner, prompts, max_tokens=16, chunk_size=7, together=together)
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


def typical_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The median over positions of the largest logit error, relative to the largest logit.
    Quantized activations may flip a near-tied routing choice at a position or two (an error
    of several percent there); a wiring fault costs every position the whole scale."""
    errors = (got - expected).abs().max(dim=1).values / expected.abs().max()
    return errors.median().item()


def sparse_layers_of(model: DecoderModel) -> list[SparseMoE]:
    return [layer["moe"] for layer in model.layers if "moe" in layer]


def test_experts_quantized_at_load_run_the_integer_and_float_paths(tmp_path):
    build_tiny_model("qwen3-moe", tmp_path)
    dense = make_runner(tmp_path, block_size=4, num_blocks=64)
    quantized = make_runner(tmp_path, block_size=4, num_blocks=64, quantization="int8",
                            quant_gemv_max_rows=3)
    moes = sparse_layers_of(quantized.model)
    assert len(moes) == 2  # layer 1 is dense (mlp_only_layers)
    assert all(isinstance(p, QuantizedLinear) for moe in moes for p in moe.parts())
    assert all(not isinstance(moe.router, QuantizedWeight) for moe in moes)
    ids = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    table = list(range(8))
    expected = dense.execute(ModelInput([ScheduledSequence(ids, 0, table, all_logits=True)]))
    # The whole prompt gives each expert more rows than 3 (the batch path: the integer GEMM,
    # or dequantized slices); chunks of 2 give it at most 2 (the row kernels).
    whole = quantized.execute(ModelInput([ScheduledSequence(ids, 0, table, all_logits=True)]))
    chunks = torch.cat([quantized.execute(ModelInput([ScheduledSequence(
        ids[s:s + 2], s, table, all_logits=True)])) for s in range(0, len(ids), 2)])
    for got in (whole, chunks):
        assert typical_error(got, expected) <= 0.03


def reference_experts(x: torch.Tensor, moe: SparseMoE, chosen: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """The layer in float64 on the kernels' scheme (reference_quant_linear): each token's k
    experts, weighted, in turn."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            gate_up, down = moe.experts[chosen[t, j]]
            h = torch.cat([reference_quant_linear(x[t:t + 1], p) for p in gate_up.parts], dim=1)
            gate, up = h.chunk(2, dim=1)
            act = (F.silu(gate) * up).float()  # the kernel's float32 activations
            out[t] += weights[t, j].double() * reference_quant_linear(act, down.parts[0])[0]
    return out


class NativeSpy:
    """The native layer, its calls counted."""

    def __init__(self, native, calls: list) -> None:
        self.native, self.calls = native, calls

    def forward(self, *args):
        self.calls.append(args)
        return self.native.forward(*args)


@pytest.mark.parametrize("types", [(Q.Q4_1, Q.Q4_1, Q.Q8_0), (Q.Q4_K, Q.Q4_K, Q.Q6_K),
                                   (Q.Q4_0, Q.Q5_K, Q.Q5_0)], ids=["q4_1", "k-quants", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_experts_equal_the_kernels_scheme_and_a_token_alone(types, dtype, monkeypatch):
    """The native layer (every expert in GGUF blocks) against float64 on the kernels' scheme,
    with the row kernels and with the GEMM for experts of more than one row; a token's output
    alone equals its output in the step's batch wherever the GEMM gives the row kernels' bits."""
    kernels = quant_linear_kernels()
    if kernels is None:
        pytest.skip("native quantized kernels unavailable")
    hidden, inner, num_experts, k, tokens = 512, 256, 6, 3, 12
    gate_type, up_type, down_type = types
    experts = [(QuantizedLinear([random_blocks(gate_type, inner, hidden, seed=3 * e),
                                 random_blocks(up_type, inner, hidden, seed=3 * e + 1)]),
                QuantizedLinear(random_blocks(down_type, hidden, inner, seed=3 * e + 2)))
               for e in range(num_experts)]
    gen = torch.Generator().manual_seed(0)
    moe = SparseMoE(torch.randn(num_experts, hidden, generator=gen).to(dtype), experts, k, True)
    if not set(types) <= set(kernels.quant_gemm_types()):  # Q8_0 without VNNI: no GEMM
        assert moe.native is None
        return
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, chosen = moe.route(x)
    expected = reference_experts(x, moe, chosen, weights)
    same_bits = {gate_type, up_type, down_type} <= set(kernels.quant_gemm_same_bits_types())
    for row_kernel_rows in (tokens, 1):
        got, run = moe.native.forward(x, chosen, weights, row_kernel_rows, row_kernel_rows)
        assert got.dtype == dtype and run == len(chosen.unique())
        error = (got.double() - expected).norm() / expected.norm()
        assert error < (1e-4 if dtype == torch.float32 else 4e-3)
        alone = torch.cat([moe.native.forward(x[t:t + 1], chosen[t:t + 1], weights[t:t + 1],
                                               row_kernel_rows, row_kernel_rows)[0]
                           for t in range(tokens)])
        if row_kernel_rows == tokens or same_bits:
            assert torch.equal(alone, got)
    moe.experts_run = 0
    assert torch.equal(moe(x), moe.native.forward(x, chosen, weights, 4, 4)[0])
    assert moe.experts_run == len(chosen.unique())
    # Expert 1 chosen by no token: skipped, the others' pairs in their places.
    unused = torch.where(chosen == 1, 0, chosen)
    error = ((moe.native.forward(x, unused, weights, 4, 4)[0].double()
              - reference_experts(x, moe, unused, weights)).norm() / expected.norm())
    assert error < (1e-4 if dtype == torch.float32 else 4e-3)
    # A step of more tokens than the native layer takes groups its experts in torch.
    calls = []
    monkeypatch.setattr(moe, "native", NativeSpy(moe.native, calls))
    moe(x[:2])
    assert len(calls) == 1
    monkeypatch.setattr(experts_module, "NATIVE_MAX_TOKENS", tokens - 1)
    grouped = moe(x)
    assert len(calls) == 1
    assert (grouped.double() - expected).norm() / expected.norm() < 1e-2
    with pytest.raises(RuntimeError, match="out of range"):
        moe.native.forward(x, torch.full_like(chosen, num_experts), weights, 4, 4)


def write_moe_gguf(folder: Path, path: Path, qtype: Q) -> dict[str, np.ndarray]:
    """A saved Qwen3-MoE model's tensors (one matrix per expert, as checkpoints hold them) as
    llama.cpp writes them: each layer's experts stacked into one 3-D tensor per matrix in
    `qtype`, the router and norms in F32. Returns what each tensor should dequantize to."""
    to_gguf = {hf.replace("{}", "{layer}"): g.replace("{}", "{layer}")
               for g, hf in GGUF_TENSOR_NAMES.items()}
    state = {k: v.numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    stacks: dict[str, list[tuple[int, str]]] = {}
    singles = {}
    for name in state:
        parts = name.split(".")
        if "experts" in parts:
            layer, expert = parts[2], int(parts[5])
            template = ".".join([*parts[:2], "{layer}", *parts[3:5], "{expert}", *parts[6:]])
            stacks.setdefault(to_gguf[template].format(layer=layer), []).append((expert, name))
        else:
            layer = parts[2] if name.startswith("model.layers.") else ""
            template = name.replace(f".{layer}.", ".{layer}.", 1) if layer else name
            singles[to_gguf[template].format(layer=layer)] = name
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    config = json.loads((folder / "config.json").read_text())
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    expected = {}
    for gguf_name, hf_name in singles.items():
        kind = qtype if state[hf_name].ndim == 2 and "gate.weight" not in hf_name else Q.F32
        data = quantize(state[hf_name], kind)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        expected[hf_name] = dequantize(data, kind).reshape(state[hf_name].shape)
    for gguf_name, members in stacks.items():
        names = [name for _, name in sorted(members)]
        stacked = np.stack([state[name] for name in names])
        data = quantize(stacked, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        for name, rows in zip(names, dequantize(data, qtype).reshape(stacked.shape),
                              strict=True):
            expected[name] = rows
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_a_gguf_with_stacked_experts_is_served_as_stored(qtype, tmp_path):
    build_tiny_model("qwen3-moe", tmp_path)
    spec = read_spec(tmp_path)
    path = tmp_path / "tiny-moe.gguf"
    expected = write_moe_gguf(tmp_path, path, qtype)

    stored = read_gguf_weights(path, spec, keep_quantized=True)
    assert stored.keys() == expected.keys()
    expert = "model.layers.2.mlp.experts.3.down_proj.weight"
    assert isinstance(stored[expert], QuantizedWeight) and stored[expert].qtype == qtype
    for name, array in expected.items():
        weight = stored[name]
        got = dequantize_blocks(weight) if isinstance(weight, QuantizedWeight) else weight
        np.testing.assert_array_equal(got.numpy(), array)
    # The memory plan counts the experts' blocks as the file stores them.
    assert served_weight_bytes(spec, 4, "gguf", False, path) == sum(
        w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * 4 for w in stored.values())

    def runner(keep_quantized: bool) -> ModelRunner:
        weights = read_gguf_weights(path, spec, keep_quantized=keep_quantized)
        loaded = LoadedModel(spec, weights, tmp_path, "tiny",
                             "gguf" if keep_quantized else "none")
        return ModelRunner(loaded, ModelConfig(dtype="float32", quant_gemv_max_rows=4),
                           CacheConfig(block_size=4, num_blocks=64))

    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    table = list(range(8))
    dense = runner(False).execute(ModelInput([ScheduledSequence(ids, 0, table,
                                                                all_logits=True)]))
    served = runner(True)
    got = torch.cat([served.execute(ModelInput([ScheduledSequence(
        ids[s:s + 4], s, table, all_logits=True)])) for s in range(0, len(ids), 4)])
    assert typical_error(got, dense) <= (0.03 if qtype == Q.Q8_0 else 0.1)


def test_an_engine_serves_a_mixture_of_experts(tmp_path):
    """The whole path (scheduler, runner, sampler) over a random-weight Qwen3-MoE whose config
    alone is given, with the default model's tokenizer; experts quantized at load."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **TINY,
        "vocab_size": 49152, **ARCHITECTURES["qwen3-moe"][2]}))
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", quantization="int4",
              num_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(["Once upon a time", "Hello", "A"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6, 6]


def test_tensor_parallelism_refuses_experts(tmp_path):
    build_tiny_model("mixtral", tmp_path)
    spec = read_spec(tmp_path)
    check_tensor_parallel(spec, 1)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_tensor_parallel(spec, 2)


def test_the_decode_floor_counts_the_experts_a_step_reads(tmp_path):
    """One token reads k of E experts per layer; a large batch reads nearly all of them."""
    build_tiny_model("qwen3-moe", tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_blocks=16)
    model = runner.model
    cost = DecodeCost.of(model, runner.kv_cache_dtype)
    moes = sparse_layers_of(model)
    experts = sum(p.nbytes for moe in moes for p in moe.parts())
    others = model.weight_bytes() - experts
    assert cost.bytes_read(1, 0) == others + round(experts * 2 / 4)  # 2 of 4 experts
    assert cost.bytes_read(64, 0) == others + round(experts * (1 - 0.5 ** 64))
    expert_params = sum(p.numel for moe in moes for p in moe.parts())
    assert cost.flops(1) == round(2 * (model.num_parameters() - expert_params / 2))


def test_the_expert_width_transformers_misses_in_a_gguf_is_read_from_its_metadata(tmp_path):
    """transformers' GGUF conversion leaves Qwen3-MoE's moe_intermediate_size at its default
    (768); the converted config takes it from `qwen3moe.expert_feed_forward_length`."""
    build_tiny_model("qwen3-moe", tmp_path)
    write_moe_gguf(tmp_path, tmp_path / "tiny-moe.gguf", Q.Q8_0)
    config = transformers.Qwen3MoeConfig()
    assert config.moe_intermediate_size == 768
    missed_config_fields(config, tmp_path / "tiny-moe.gguf")
    assert config.moe_intermediate_size == 32


def test_the_plan_counts_all_parameters_and_those_a_token_runs():
    """Qwen3-30B-A3B's shape (with the default model's vocabulary): every expert is held, 8 of
    128 run per token; counted here from the config's numbers."""
    config = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    d, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    attention = h * d * (2 * heads + 2 * kv) + 2 * d  # q, o; k, v; q/k norms
    expert = 3 * h * config["moe_intermediate_size"]
    per_layer = attention + 2 * h + h * config["num_experts"]  # norms, router
    total = 2 * vocab * h + h + layers * (per_layer + config["num_experts"] * expert)
    active = total - layers * (config["num_experts"] - config["num_experts_per_tok"]) * expert
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--model", str(CONFIGS / "qwen3-30b-a3b"), "--quantization",
                     "int4", "--max-model-len", "2048", "--concurrency", "1", "--json"]) == 0
    report = json.loads(out.getvalue())
    assert (report["parameters"], report["active_parameters"]) == (total, active)
    assert "active per token" in format_plan(report)


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_a_step_counts_the_experts_it_read_as_transformers_routes(arch, tmp_path):
    """Each (layer, expert) pair a pass ran counts once however many of its tokens chose it:
    the distinct top-k experts of the router logits transformers returns, over the step's
    tokens; a few tokens, so that some steps leave experts unread."""
    model = build_tiny_model(arch, tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_blocks=64)
    gen = torch.Generator().manual_seed(4)
    top_k = model.config.num_experts_per_tok
    counts = []
    for n in (1, 2, 3, 5):
        ids = torch.randint(3, 256, (n,), generator=gen).tolist()
        with torch.no_grad():
            routers = model(torch.tensor([ids]), output_router_logits=True).router_logits
        expected = sum(len(set(logits.topk(top_k, dim=-1).indices.flatten().tolist()))
                       for logits in routers if logits is not None)
        output = runner.run(ModelInput([ScheduledSequence(ids, 0, list(range(2)))]))
        assert output.experts_read == expected, n
        counts.append(expected)
    assert counts[0] == len(sparse_layers_of(runner.model)) * top_k
    assert len(set(counts)) > 1  # the count follows the tokens' routing


def test_the_step_trace_shows_the_experts_each_step_read(tmp_path):
    """And the ready message (/v1/models' memory block) counts the parameters held, as
    transformers does, and those a token runs: 2 of 4 experts in two of three layers."""
    model = build_tiny_model("qwen3-moe", tmp_path)
    core = EngineCore(EngineConfig(ModelConfig(model=str(tmp_path), dtype="float32"),
                                   CacheConfig(block_size=4, num_blocks=64)))
    memory = ready_message(core).memory
    held = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in model.model.layers[0].mlp.experts.parameters()) // 4
    assert (memory["parameters"], memory["active_parameters"]) == (held, held - 2 * 2 * expert)
    core.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    steps = []
    while core.has_unfinished_requests():
        core.step()
        steps.append(core.last_step_stats)
    layers = len(sparse_layers_of(core.executor.runner.model))
    assert [s.num_experts_read for s in steps[1:]] == [layers * 2] * (len(steps) - 1)
    assert layers * 2 <= steps[0].num_experts_read <= layers * 4
    assert steps[-1].trace_event()["args"]["experts_read"] == layers * 2
