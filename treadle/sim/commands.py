"""Arguments and entry point of `treadle sim`, and the arguments of `bench steps` (here, not in
steps.py: building the CLI's parser must not import torch)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from treadle.config import ModelConfig, policy_help, setting_fields
from treadle.flags import add_setting_flag, has_flag
from treadle.sim.settings import (
    DEFAULT_MAX_MODEL_LEN,
    SimSettings,
    parse_setting,
    sim_setting_fields,
)
from treadle.sim.workload import SimRequest


def add_sim_args(parser: argparse.ArgumentParser) -> None:
    from treadle.bench.commands import WORKLOADS, float_list

    parser.set_defaults(threads=None)
    w = parser.add_argument_group("workload (bench serve's, a trace, or a bench serve report)")
    w.add_argument("--workload", choices=(*WORKLOADS, "trace", "bench-json"),
                   default="synthetic-chat")
    w.add_argument("--trace", default=None, help="trace: a JSONL trace (see treadle/sim/"
                   "workload.py); bench-json: a `bench serve --json` report")
    w.add_argument("--run", type=int, default=0, help="bench-json: which run of the report")
    w.add_argument("--save-trace", default=None, help="write the workload as a JSONL trace")
    w.add_argument("--tokenizer", default=None)
    w.add_argument("--num-prompts", type=int, default=100)
    w.add_argument("--seed", type=int, default=0)
    for name, default in (("input-len", 128), ("output-len", 128), ("max-input-len", None),
                          ("max-output-len", None), ("max-model-len", None), ("prefix-len", 512),
                          ("question-len", 32), ("group-size", 8)):
        w.add_argument(f"--{name}", type=int, default=default)
    w.add_argument("--range-ratio", type=float, default=0.0)
    w.add_argument("--file", default=None, help="file workload: bench serve's JSONL prompts")
    w.add_argument("--request-rate", type=float, default=float("inf"))
    w.add_argument("--burstiness", type=float, default=1.0)
    w.add_argument("--tenants", type=int, default=1,
                   help="bench workloads: spread requests round robin over this many tenants")
    w.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="bench workloads: each request's LoRA adapter, drawn from these by "
                        "--seed as `bench serve --lora-modules` draws them (a trace names "
                        "its own: \"lora\"); needs --enable-lora")
    w.add_argument("--ttft", type=float, default=None, help="objective for every request (s)")
    w.add_argument("--tpot", type=float, default=None, help="objective for every request (s)")

    e = parser.add_argument_group("engine settings (per replica: treadle serve's flags and "
                                  "defaults) and the sim's own")
    for f in sim_setting_fields().values():
        if f.name == "policy":
            add_setting_flag(e, f, help=policy_help() + "; comma-separated to compare",
                             choices=None)
        elif f.name == "num_blocks":
            add_setting_flag(e, f, none="as many as --kv-cache-memory holds")
        elif f.name == "max_model_len":  # --max-model-len: the workload's longest request
            add_setting_flag(e, f, flag="--max-model-len-engine", dest="engine_max_model_len",
                             none=f"the default model's, {DEFAULT_MAX_MODEL_LEN}")
        elif has_flag(f):
            add_setting_flag(e, f)
    e.add_argument("--sweep", default=None, metavar="NAME=V1,V2",
                   help="one run per value of a setting, e.g. max_num_batched_tokens=256,512")

    o = parser.add_argument_group("step time and output")
    o.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG plots here: the trade-off across the runs (a sweep, "
                        "policies or rates) and KV cache usage over time")
    o.add_argument("--profile", default=None,
                   help="step-time profile JSON (default: the default model's, shipped)")
    o.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS")
    o.add_argument("--json", metavar="FILE", default=None, help="write the reports here")
    o.add_argument("--per-request", action="store_true", help="per-request rows in --json")
    o.add_argument("--rates", type=float_list, default=None,
                   help="comma-separated request rates, one run each (bench workloads)")


def add_steps_args(parser: argparse.ArgumentParser) -> None:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    parser.add_argument("--prefill-tokens", type=ints, default=[0, 32, 128, 512])
    # 1, 2 and 4 decodes: either side of the quantized layers' crossover (2-4 rows here).
    parser.add_argument("--decode-seqs", type=ints, default=[0, 1, 2, 4, 8, 32])
    parser.add_argument("--context-lens", type=ints, default=[64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--held-out", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="step_profile.json", help="the profile JSON")
    parser.add_argument("--notes", default="", help="kept in the profile (e.g. the machine's load)")
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="time LoRA rows with random adapters of this rank (the server's "
                             "--max-lora-rank default) for the profile's LoRA terms; 0: skip "
                             "them (the engine then serves no LoRA while timing)")
    add_setting_flag(parser, setting_fields(ModelConfig)["quant_gemv_max_rows"], default=None,
                     help="as `treadle serve`'s: pin the quantized layers' crossover to the "
                          "server's")


def build_requests(args: argparse.Namespace, rate: float) -> list[SimRequest]:
    from treadle.sim import workload

    if args.lora_modules and args.workload in ("trace", "bench-json"):
        raise ValueError("--lora-modules draws adapters for bench workloads: a trace names "
                         "each request's (\"lora\"), a bench serve report its own")
    if args.workload == "trace":
        return workload.read_trace(_need(args.trace, "--trace"))
    if args.workload == "bench-json":
        report = json.loads(Path(_need(args.trace, "--trace")).read_text())
        return workload.from_bench_serve(report, args.run)
    from treadle.bench.commands import build_workload
    from treadle.bench.serve import send_times

    bench_args = argparse.Namespace(**vars(args), prompt_format="ids")
    bench_requests = build_workload(bench_args)
    times = send_times(bench_requests, rate, args.burstiness, args.seed)
    requests = workload.from_bench(bench_requests, times, args.lora_modules, args.seed)
    for i, r in enumerate(requests):
        r.tenant = f"t{i % args.tenants}" if args.tenants > 1 else r.tenant
        r.ttft, r.tpot = args.ttft, args.tpot
    return requests


def _need(value: str | None, flag: str) -> str:
    if value is None:
        raise ValueError(f"this workload needs {flag} PATH")
    return value


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (absent ones keep SimSettings' defaults), but --policy."""
    given = {name: getattr(args, name) for name in sim_setting_fields() if hasattr(args, name)}
    if hasattr(args, "engine_max_model_len"):
        given["max_model_len"] = args.engine_max_model_len
    given.pop("policy", None)
    return given


def runs_of(args: argparse.Namespace) -> list[tuple[str, SimSettings, float]]:
    """(label, settings, request rate) for each run asked for."""
    base = given_settings(args)
    rates = args.rates or [args.request_rate]
    policies = [p for p in getattr(args, "policy", "").split(",") if p]
    variants: list[tuple[str, SimSettings]] = [
        (p if len(policies) > 1 else "", SimSettings(**base, policy=p)) for p in policies
    ] if policies else [("", SimSettings(**base))]
    if args.sweep:
        name, sep, values = args.sweep.partition("=")
        if not sep:
            raise ValueError(f"--sweep {args.sweep!r} is not NAME=V1,V2")
        name = name.replace("-", "_")
        variants = [(f"{label} {name}={v}".strip(), s.replace(**{name: parse_setting(name, v)}))
                    for label, s in variants for v in values.split(",") if v]
    return [((f"{label} rate={rate:g}" if len(rates) > 1 else label).strip() or "run",
             settings, rate) for label, settings in variants for rate in rates]


def run_sim(args: argparse.Namespace) -> int:
    from treadle.bench.metrics import parse_goodput
    from treadle.sim.profile import StepProfile
    from treadle.sim.report import (
        format_adapters,
        format_kv,
        format_table,
        format_tenants,
        summarize,
    )
    from treadle.sim.simulator import simulate
    from treadle.sim.workload import write_trace

    try:
        slos = parse_goodput(args.goodput)
        profile = StepProfile.load(args.profile)
        runs = runs_of(args)
        workloads: dict[float, list[SimRequest]] = {}
        labels, reports = [], []
        for label, settings, rate in runs:
            if rate not in workloads:
                workloads[rate] = build_requests(args, rate)
                if args.save_trace:
                    write_trace(workloads[rate], args.save_trace)
            if not settings.engine.model.enable_lora and any(
                    r.lora is not None for r in workloads[rate]):
                raise ValueError("the workload's requests name LoRA adapters: serving them "
                                 "needs --enable-lora, as treadle serve does")
            result = simulate(workloads[rate], settings, profile)
            report = summarize(result, slos, per_request=args.per_request)
            report["label"], report["settings"] = label, settings.as_dict()
            report["request_rate"] = rate
            labels.append(label)
            reports.append(report)
    except (ValueError, OSError) as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    first = workloads[runs[0][2]]
    cache = runs[0][1].engine.cache
    print(f"{len(first)} requests, profile {profile.model} "
          f"({profile.machine.get('cpu', '?')}), {runs[0][1].replicas} replica(s), "
          f"{cache.num_blocks} KV blocks of {cache.block_size} tokens each")
    print(format_table(labels, reports))
    for label, report in zip(labels, reports, strict=True):
        if len(report["tenants"]) > 1:
            print(f"-- {label} tenants (Jain's index {report['jain_index']:.3f})")
            print(format_tenants(report))
        if report["adapters"]:
            print(f"-- {label} LoRA adapters (at most {report['most_loras_in_a_step']} in a "
                  f"step, --max-loras {report['settings']['max_loras']})")
            print(format_adapters(report))
        print(f"-- {label} {format_kv(report)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": dataclasses.asdict(profile),
                                               "runs": reports}, indent=2))
    if args.plot:
        from treadle.sim.plots import plot_sim

        for path in plot_sim(labels, reports, args.plot):
            print(f"wrote {path}")
    return 0
