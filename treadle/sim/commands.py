"""Arguments and entry point of `treadle sim`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from treadle.config import ROUTER_NAMES
from treadle.sim.settings import SimSettings, parse_setting
from treadle.sim.workload import SimRequest

# SmolLM2-135M's KV bytes per block of 16 tokens: layers x (K, V) x 16 x kv heads x dim x bf16.
DEFAULT_BYTES_PER_BLOCK = 30 * 2 * 16 * 3 * 64 * 2


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
    w.add_argument("--ttft", type=float, default=None, help="objective for every request (s)")
    w.add_argument("--tpot", type=float, default=None, help="objective for every request (s)")

    e = parser.add_argument_group("engine settings (per replica)")
    e.add_argument("--policy", default="fcfs",
                   help="fcfs, priority, fair, deadline; comma-separated to compare")
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument("--max-num-seqs", type=int, default=128)
    e.add_argument("--long-prefill-token-threshold", type=int, default=256)
    e.add_argument("--max-num-partial-prefills", type=int, default=4)
    e.add_argument("--max-queue-wait", type=float, default=None)
    e.add_argument("--max-kv-blocks-per-tenant", type=int, default=None,
                   help="most KV blocks one tenant's running requests hold (default: no cap)")
    e.add_argument("--fair-chunk-tokens", type=int, default=None,
                   help="under fair, while more than one tenant is known, the most prompt "
                        "tokens per step of a long prompt (default: "
                        "--long-prefill-token-threshold)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache blocks (default: from --kv-cache-memory)")
    e.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB (default 1)")
    e.add_argument("--bytes-per-block", type=int, default=None,
                   help="KV bytes of one block (default: the default model's, bfloat16)")
    e.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    e.add_argument("--max-model-len-engine", dest="engine_max_model_len", type=int,
                   default=8192, help="the engine's context limit")
    e.add_argument("--replicas", type=int, default=1)
    e.add_argument("--router", choices=ROUTER_NAMES, default="round-robin")
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


def build_requests(args: argparse.Namespace, rate: float) -> list[SimRequest]:
    from treadle.sim import workload

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
    requests = workload.from_bench(bench_requests, times)
    for i, r in enumerate(requests):
        r.tenant = f"t{i % args.tenants}" if args.tenants > 1 else r.tenant
        r.ttft, r.tpot = args.ttft, args.tpot
    return requests


def _need(value: str | None, flag: str) -> str:
    if value is None:
        raise ValueError(f"this workload needs {flag} PATH")
    return value


def base_settings(args: argparse.Namespace) -> SimSettings:
    num_blocks = args.num_blocks or max(1, int(args.kv_cache_memory * (1 << 30)) //
                                        (args.bytes_per_block or DEFAULT_BYTES_PER_BLOCK))
    return SimSettings(
        policy=args.policy.split(",")[0], max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_queue_wait=args.max_queue_wait,
        max_kv_blocks_per_tenant=args.max_kv_blocks_per_tenant,
        fair_chunk_tokens=args.fair_chunk_tokens, block_size=args.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.engine_max_model_len, replicas=args.replicas, router=args.router)


def runs_of(args: argparse.Namespace) -> list[tuple[str, SimSettings, float]]:
    """(label, settings, request rate) for each run asked for."""
    base = base_settings(args)
    rates = args.rates or [args.request_rate]
    policies = [p for p in args.policy.split(",") if p]
    variants: list[tuple[str, SimSettings]] = [
        (p if len(policies) > 1 else "", dataclasses.replace(base, policy=p)) for p in policies]
    if args.sweep:
        name, sep, values = args.sweep.partition("=")
        if not sep:
            raise ValueError(f"--sweep {args.sweep!r} is not NAME=V1,V2")
        name = name.replace("-", "_")
        variants = [(f"{label} {name}={v}".strip(),
                     dataclasses.replace(s, **{name: parse_setting(name, v)}))
                    for label, s in variants for v in values.split(",") if v]
    return [((f"{label} rate={rate:g}" if len(rates) > 1 else label).strip() or "run",
             settings, rate) for label, settings in variants for rate in rates]


def run_sim(args: argparse.Namespace) -> int:
    from treadle.bench.metrics import parse_goodput
    from treadle.sim.profile import StepProfile
    from treadle.sim.report import format_kv, format_table, format_tenants, summarize
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
            result = simulate(workloads[rate], settings, profile)
            report = summarize(result, slos, per_request=args.per_request)
            report["label"], report["settings"] = label, dataclasses.asdict(settings)
            report["request_rate"] = rate
            labels.append(label)
            reports.append(report)
    except (ValueError, OSError) as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    first = workloads[runs[0][2]]
    print(f"{len(first)} requests, profile {profile.model} "
          f"({profile.machine.get('cpu', '?')}), {runs[0][1].replicas} replica(s), "
          f"{runs[0][1].num_blocks} KV blocks of {runs[0][1].block_size} tokens each")
    print(format_table(labels, reports))
    for label, report in zip(labels, reports, strict=True):
        if len(report["tenants"]) > 1:
            print(f"-- {label} tenants (Jain's index {report['jain_index']:.3f})")
            print(format_tenants(report))
        print(f"-- {label} {format_kv(report)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": dataclasses.asdict(profile),
                                               "runs": reports}, indent=2))
    if args.plot:
        from treadle.sim.plots import plot_sim

        for path in plot_sim(labels, reports, args.plot):
            print(f"wrote {path}")
    return 0
