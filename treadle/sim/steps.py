"""`treadle bench steps`: time mixed prefill + decode model passes over a grid and fit the
simulator's step-time profile (profile.py) to them.

Each grid point is one pass of the model runner: a prefill chunk of P tokens (after C tokens of
context) and D decode sequences at context C, for P x D x C over the grid (P = D = 0 skipped).
A point's time is the median of `repeats` passes after one warm-up (not the least: a served step
runs amid interference). The fit is checked on `held_out` passes at random (P, D, C) within the
grid's range, not used in the fit.

Beside the model pass, each step of the engine schedules, samples and updates its requests:
that work is timed on the engine core itself (steps of 1, 8 and 32 decodes, its `StepStats`:
the step's time less the model pass's), fitted as a cost per step plus one per decode, and
added to the profile's `const` and `decode_seqs`.

LoRA rows (with `lora_rank` > 0; the engine then serves LoRA, as `--enable-lora`): decode steps
and a prefill chunk are timed with their rows spread over 1 and up to LORA_ADAPTERS random
adapters of that rank and back to back without (the twin's time taken off, so the machine's
load drifts alike over both); the differences are fitted as a cost per adapter in the step plus
one per adapter row (the profile's `lora_adapters` and `lora_rows`). The adapters stay in their
slots: swapping one in when more than `max_loras` take turns is not in the term.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from treadle.config import EngineConfig, build_config
from treadle.core.engine_core import EngineCore
from treadle.core.sampling_params import SamplingParams
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.family import ModelSpec
from treadle.model.lora import MODULE_LAYERS
from treadle.model.runner import ModelRunner
from treadle.model.source import resolve_model
from treadle.sim.profile import (
    FEATURES,
    StepProfile,
    fit_profile,
    nonnegative_lstsq,
    shared_decode_context,
    step_features,
)

BLOCK_SIZE = 16
# The engine's own work is timed on steps of these many decodes, of requests of (prompt,
# output) tokens; the blocks they hold at once.
OVERHEAD_DECODES = (1, 8, 32)
OVERHEAD_TOKENS = (32, 24)
OVERHEAD_BLOCKS = max(OVERHEAD_DECODES) * -(-sum(OVERHEAD_TOKENS) // BLOCK_SIZE)
# The most adapters a LoRA step spreads its rows over (the engine's max_loras while timing):
# the server's default max_loras.
LORA_ADAPTERS = 4


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def step_input(prefill: int, decode: int, context: int, shared: bool = False) -> ModelInput:
    """A prefill chunk of `prefill` tokens after `context` tokens (when prefill > 0) and
    `decode` one-token sequences at `context`, each on blocks of its own; `shared`: the decodes
    share the full blocks of their context (a shared prompt prefix), each its own last one."""
    per_seq = -(-(context + prefill) // BLOCK_SIZE)
    seqs = []
    if prefill:
        seqs.append(ScheduledSequence([100 + i % 50 for i in range(prefill)], context,
                                      list(range(per_seq))))
    common = (context - 1) // BLOCK_SIZE if shared else 0
    for i in range(1, decode + 1):
        own = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(ScheduledSequence([100 + i % 50], context - 1,
                                      list(range(per_seq, per_seq + common)) + own[common:]))
    return ModelInput(seqs)


def shared_of(model_input: ModelInput) -> int:
    return shared_decode_context(((s.num_computed_tokens, s.block_table)
                                  for s in model_input.sequences if len(s.token_ids) == 1),
                                 BLOCK_SIZE)


def chunks_of(model_input: ModelInput) -> list[tuple[int, int]]:
    return [(s.num_computed_tokens, len(s.token_ids)) for s in model_input.sequences]


def time_step(runner: ModelRunner, model_input: ModelInput, repeats: int) -> float:
    runner.execute(model_input)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(model_input)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_overhead(core: EngineCore) -> tuple[float, float]:
    """Seconds of a step's engine work beside the model pass: (per step, per decode), fitted
    to the median over steps of `n` decodes each, for n in OVERHEAD_DECODES (sampled at
    temperature 1, the dearer draw)."""
    params = SamplingParams(max_tokens=OVERHEAD_TOKENS[1], ignore_eos=True, temperature=1.0,
                            seed=0)
    medians = []
    for n in OVERHEAD_DECODES:
        for i in range(n):
            core.add_request(f"overhead-{n}-{i}",
                             [100 + (i + j) % 50 for j in range(OVERHEAD_TOKENS[0])], params)
        seconds = []
        while core.has_unfinished_requests():
            core.step()
            step = core.last_step_stats
            if step is not None and step.num_prefill_tokens == 0 and step.num_decode_tokens == n:
                seconds.append(step.duration - step.model_duration)
        medians.append(statistics.median(seconds))
    per_decode, per_step = np.polyfit(OVERHEAD_DECODES, medians, 1)
    return max(float(per_step), 0.0), max(float(per_decode), 0.0)


def write_random_adapter(folder: Path, spec: ModelSpec, rank: int, seed: int) -> Path:
    """A PEFT folder of rank `rank` on every module LoRA serves, random weights (a step's time
    depends on their shapes, not their values)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for weight, shape in spec.expected_shapes().items():
        name = weight.removesuffix(".weight")
        parts = name.split(".")
        if len(parts) != 5 or parts[:2] != ["model", "layers"] or parts[-1] not in MODULE_LAYERS:
            continue  # not a module LoRA serves (norms, embeddings, experts)
        out_features, in_features = shape
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(
            rank, in_features, generator=generator) * 0.01
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(
            out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank,
        "target_modules": list(MODULE_LAYERS)}))
    return folder


def lora_points(prefill_tokens: list[int], decode_seqs: list[int], context_lens: list[int]
                ) -> list[tuple[int, int, int, int]]:
    """(P, D, C, adapters) of the steps timed with and without adapters: each decode count
    over one adapter and over as many as it has rows (up to LORA_ADAPTERS), and the largest
    prefill chunk of one adapter."""
    context = max(context_lens)
    points = [(0, d, context, k) for d in sorted(set(decode_seqs)) if d
              for k in sorted({1, min(d, LORA_ADAPTERS)})]
    return points + ([(max(prefill_tokens), 0, context, 1)] if max(prefill_tokens) else [])


def with_adapters(model_input: ModelInput, adapters: list[Path]) -> ModelInput:
    """The same step with sequence i on adapter i mod len(adapters)."""
    return ModelInput([dataclasses.replace(s, lora_id=i % len(adapters) + 1,
                                           lora_path=str(adapters[i % len(adapters)]))
                       for i, s in enumerate(model_input.sequences)])


def lora_extra_seconds(runner: ModelRunner, base: ModelInput, adapted: ModelInput,
                       repeats: int) -> float:
    """The median over `repeats` pairs of (adapted - base) seconds, each pair back to back."""
    runner.execute(adapted)  # warm-up, and its adapters loaded into their slots
    runner.execute(base)
    extra = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(adapted)
        middle = time.perf_counter()
        runner.execute(base)
        extra.append((middle - start) - (time.perf_counter() - middle))
    return statistics.median(extra)


def lora_cost(runner: ModelRunner, rank: int, points: list[tuple[int, int, int, int]],
              repeats: int, progress: bool) -> dict:
    """Seconds LoRA rows add to a step: per adapter in it and per adapter row, fitted (>= 0)
    to the extra time of each of `points` with adapters of `rank` over the same step
    without."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [write_random_adapter(Path(tmp) / f"adapter-{i}", runner.spec, rank, i)
                    for i in range(LORA_ADAPTERS)]
        for p, d, c, k in points:
            base = step_input(p, d, c)
            extra = lora_extra_seconds(runner, base, with_adapters(base, adapters[:k]), repeats)
            rows.append({"prefill_tokens": p, "decode_seqs": d, "context": c, "adapters": k,
                         "extra_s": extra})
            if progress:
                print(f"    lora P={p:<5} D={d:<4} C={c:<5} adapters={k} "
                      f"{extra * 1e3:+8.2f} ms", flush=True)
    per_adapter, per_row = nonnegative_lstsq(
        np.asarray([[r["adapters"], r["prefill_tokens"] + r["decode_seqs"]] for r in rows],
                   dtype=float), np.asarray([r["extra_s"] for r in rows]))
    return {"rank": rank, "per_adapter_s": float(per_adapter), "per_row_s": float(per_row),
            "steps": rows}


def bench_steps(model: str | None, dtype: str, quantization: str, prefill_tokens: list[int],
                decode_seqs: list[int], context_lens: list[int], repeats: int = 3,
                held_out: int = 12, seed: int = 0, progress: bool = True,
                quant_gemv_max_rows: int | None = None, load_format: str = "auto",
                lora_rank: int = 0) -> dict:
    """`lora_rank` > 0: the LoRA terms measured with adapters of that rank (else 0)."""
    began = time.perf_counter()
    num_blocks = max((max(decode_seqs) + 2) * -(-(max(context_lens) + max(prefill_tokens))
                                                // BLOCK_SIZE), OVERHEAD_BLOCKS)
    lora = ({"enable_lora": True, "max_loras": LORA_ADAPTERS, "max_lora_rank": lora_rank}
            if lora_rank else {})
    core = EngineCore(build_config(EngineConfig, {
        "model": model, "device": "cpu", "dtype": dtype, "quantization": quantization,
        "quant_gemv_max_rows": quant_gemv_max_rows, "block_size": BLOCK_SIZE,
        "num_blocks": num_blocks, "enable_prefix_caching": False,
        "load_format": load_format, **lora}))
    # First, while the engine's blocks hold its own requests' KV: the grid below writes its
    # steps' KV into blocks the engine's cache manager does not know of.
    per_step, per_decode = engine_overhead(core)
    runner = core.executor.runner
    # The quantized layers' crossover, one number for the whole model: the most common one
    # among its shapes (pinned with quant_gemv_max_rows, every shape has the same).
    crossovers = Counter(runner.gemv_rows.values())
    gemv_rows = crossovers.most_common(1)[0][0] if crossovers else None
    grid = [(p, d, c, False) for p in prefill_tokens for d in decode_seqs for c in context_lens
            if p or d]
    # Decodes sharing a prefix at the longest context, with and without a prefill beside them.
    grid += [(p, d, max(context_lens), True) for p in sorted({0, prefill_tokens[len(
        prefill_tokens) // 2]}) for d in decode_seqs if d >= 8]
    rng = random.Random(seed)
    extra = [(rng.randint(0, max(prefill_tokens)), rng.randint(0, max(decode_seqs)),
              rng.randint(min(context_lens), max(context_lens)), rng.random() < 0.3)
             for _ in range(held_out)]
    extra = [(p, d, c, shared) if p or d else (p, 1, c, shared) for p, d, c, shared in extra]
    rows = []
    for kind, points in (("fit", grid), ("held_out", extra)):
        for p, d, c, shared in points:
            model_input = step_input(p, d, c, shared)
            seconds = time_step(runner, model_input, repeats)
            rows.append({"set": kind, "prefill_tokens": p, "decode_seqs": d, "context": c,
                         "shared": shared, "features": step_features(
                             chunks_of(model_input), gemv_rows, shared_of(model_input)),
                         "seconds": seconds})
            if progress:
                print(f"{kind:>8} P={p:<5} D={d:<4} C={c:<5} {seconds * 1e3:8.2f} ms"
                      f"{' shared prefix' if shared else ''}", flush=True)
    lora_fit = (lora_cost(runner, lora_rank, lora_points(prefill_tokens, decode_seqs,
                                                         context_lens), repeats, progress)
                if lora_rank else None)
    train = [(r["features"], r["seconds"]) for r in rows if r["set"] == "fit"]
    test = [(r["features"], r["seconds"]) for r in rows if r["set"] == "held_out"]
    source = resolve_model(model)
    profile = fit_profile(
        train, test, model=source.name, gemv_rows=gemv_rows,
        machine={"cpu": cpu_name(), "cores": os.cpu_count(),
                 "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                 **runner.platform_info()},
        notes="")
    for r in rows:
        r["predicted"] = profile.predict(r["features"])
    # The errors above are the model pass's; the engine's own work is added after the fit.
    profile.coefficients["const"] += per_step
    profile.coefficients["decode_seqs"] += per_decode
    if lora_fit is not None:  # the grid's steps had no adapter rows: its fit left these at 0
        profile.coefficients["lora_adapters"] = lora_fit["per_adapter_s"]
        profile.coefficients["lora_rows"] = lora_fit["per_row_s"]
        profile.fit["lora"] = lora_fit
    profile.fit.update({"engine_overhead_s": {"per_step": per_step, "per_decode": per_decode},
                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "grid": {"prefill_tokens": prefill_tokens, "decode_seqs": decode_seqs,
                                 "context_lens": context_lens}, "repeats": repeats,
                        "seconds_taken": round(time.perf_counter() - began, 1)})
    return {"profile": profile, "rows": rows}


def format_steps(report: dict) -> str:
    profile: StepProfile = report["profile"]
    lines = [f"model {profile.model}  {profile.machine.get('cpu')}  threads "
             f"{profile.machine.get('torch_threads')}  dtype {profile.machine.get('dtype')}",
             "step_s = " + " + ".join(f"{profile.coefficients[f]:.3g}*{f}" for f in FEATURES)]
    overhead = profile.fit.get("engine_overhead_s")
    if overhead:
        lines.append(f"of which the engine's work beside the model pass: "
                     f"{overhead['per_step'] * 1e3:.2f} ms a step + "
                     f"{overhead['per_decode'] * 1e3:.3f} ms a decode (the rows below: the "
                     "model pass alone)")
    lora = profile.fit.get("lora")
    if lora:
        lines.append(f"LoRA rows (rank {lora['rank']}, fitted apart on the same steps with and "
                     f"without adapters): {lora['per_adapter_s'] * 1e3:.3f} ms an adapter + "
                     f"{lora['per_row_s'] * 1e3:.4f} ms a row")
    lines += [f"{'set':>8} {'P':>5} {'D':>4} {'C':>5} {'ms':>8} {'pred ms':>8} {'err':>6}"]
    for r in report["rows"]:
        err = (r["predicted"] - r["seconds"]) / r["seconds"]
        lines.append(f"{r['set']:>8} {r['prefill_tokens']:>5} {r['decode_seqs']:>4} "
                     f"{r['context']:>5} {r['seconds'] * 1e3:>8.2f} {r['predicted'] * 1e3:>8.2f} "
                     f"{err:>6.0%}{'  shared prefix' if r['shared'] else ''}")
    for key in ("train_error", "held_out_error"):
        if key in profile.fit:
            e = profile.fit[key]
            lines.append(f"{key}: mean {e['mean_rel']:.1%}, median {e['median_rel']:.1%}, "
                         f"max {e['max_rel']:.1%}")
    return "\n".join(lines)


def run_steps(args) -> int:
    report = bench_steps(args.model, args.dtype, args.quantization, args.prefill_tokens,
                         args.decode_seqs, args.context_lens, args.repeats, args.held_out,
                         args.seed, quant_gemv_max_rows=args.quant_gemv_max_rows,
                         load_format=args.load_format, lora_rank=args.lora_rank)
    report["profile"].notes = args.notes
    report["profile"].save(args.output)
    print(format_steps(report))
    print(f"wrote {args.output}")
    return 0
