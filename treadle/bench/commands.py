"""Arguments and entry points of `treadle bench serve` and `treadle bench roofline`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from treadle.bench.workloads import BenchRequest

WORKLOADS = ("random", "synthetic-chat", "shared-prefix", "copy-edit", "file")


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(threads=None)  # the client runs no model
    parser.add_argument("--backend", choices=("openai", "grpc"), default="openai",
                        help="openai: streaming /v1/completions (Treadle, vLLM, llama.cpp); "
                             "grpc: Treadle's gRPC Generate")
    parser.add_argument("--base-url", required=True,
                        help="e.g. http://127.0.0.1:8000, or host:port with --backend grpc")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as a bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--tokenizer", default=None,
                        help="Hugging Face folder or .gguf file whose tokenizer builds the "
                             "prompts (default: the default model's)")
    parser.add_argument("--workload", choices=WORKLOADS, default="synthetic-chat")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input-len", type=int, default=128, help="random")
    parser.add_argument("--output-len", type=int, default=128, help="random, shared-prefix")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random")
    parser.add_argument("--max-input-len", type=int, default=None, help="synthetic-chat")
    parser.add_argument("--max-output-len", type=int, default=None,
                        help="synthetic-chat, copy-edit")
    parser.add_argument("--max-model-len", type=int, default=None, help="synthetic-chat")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix")
    parser.add_argument("--question-len", type=int, default=32, help="shared-prefix")
    parser.add_argument("--group-size", type=int, default=8, help="shared-prefix")
    parser.add_argument("--file", default=None,
                        help='file: JSONL rows {"prompt": text or token ids, "output_len": N, '
                             '"tenant": NAME (optional: sent as that tenant, per-tenant '
                             'report), "arrival": S (optional, on every row or none: the send '
                             'time, replacing the request rate)}')
    parser.add_argument("--request-rate", type=float_list, default=[float("inf")],
                        help="requests/s, comma-separated for one run each (default: inf, "
                             "all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps; 1 is Poisson, below is burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                        help="SLOs, e.g. ttft:500 tpot:50 (ttft, tpot, e2el)")
    parser.add_argument("--tenants", default=None, metavar="NAME:SHARE,...",
                        help="draw each request's tenant in proportion to the shares; sent as "
                             "`user` (or the tenant's --tenant-key); reports per-tenant "
                             "statistics and Jain's fairness index (a --file with a "
                             "tenant column names them itself)")
    parser.add_argument("--tenant-key", action="append", default=[], metavar="NAME=KEY",
                        help="send that tenant's requests with this API key (repeatable)")
    parser.add_argument("--slo", default=None, metavar="ttft:MS,tpot:MS",
                        help="objectives set on every request (ttft_ms, tpot_ms) and reported "
                             "as goodput")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapters the server serves: each request's model is one of "
                             "them, drawn at random (seeded)")
    parser.add_argument("--n", type=int, default=1,
                        help="choices per request, sampled at temperature 1 (openai backend; "
                             "output tokens count every choice's, TTFT is the first token of "
                             "any)")
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                        help="send prompts as token ids or as text")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="for servers that reject ignore_eos (outputs may end early)")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the report here")
    parser.add_argument("--plot", metavar="DIR", default=None, help="write PNG plots here")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    from treadle.bench import workloads
    from treadle.model.source import resolve_model
    from treadle.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(resolve_model(args.tokenizer).folder)
    with_text = args.prompt_format == "text"
    if args.workload == "random":
        return workloads.random_workload(tokenizer, args.num_prompts, args.input_len,
                                         args.output_len, seed=args.seed,
                                         range_ratio=args.range_ratio, with_text=with_text)
    if args.workload == "synthetic-chat":
        return workloads.synthetic_chat(tokenizer, args.num_prompts, seed=args.seed,
                                        max_model_len=args.max_model_len,
                                        max_input_len=args.max_input_len,
                                        max_output_len=args.max_output_len, with_text=with_text)
    if args.workload == "shared-prefix":
        return workloads.shared_prefix(tokenizer, args.num_prompts, args.prefix_len,
                                       args.question_len, args.output_len, args.group_size,
                                       seed=args.seed, with_text=with_text)
    if args.workload == "copy-edit":
        from treadle.bench.copy_workload import copy_edit

        return copy_edit(tokenizer, args.num_prompts, seed=args.seed,
                         max_output_len=args.max_output_len, with_text=with_text)
    if args.file is None:
        raise ValueError("--workload file needs --file PATH")
    return workloads.file_workload(tokenizer, args.file, with_text=with_text)


def run_serve(args: argparse.Namespace) -> int:
    from treadle.bench.metrics import parse_goodput
    from treadle.bench.serve import bench_serve, format_serve, parse_slo, parse_tenants
    from treadle.bench.workloads import summarize

    try:
        slos = parse_goodput(args.goodput)
        tenants = parse_tenants(args.tenants) if args.tenants else None
        tenant_keys = {}
        for item in args.tenant_key:
            name, sep, key = item.partition("=")
            if not (sep and name and key):
                raise ValueError(f"--tenant-key {item!r} is not NAME=KEY")
            tenant_keys[name] = key
        objectives = parse_slo(args.slo) if args.slo else None
        requests = build_workload(args)
        report = bench_serve(args.base_url, args.model, requests, args.request_rate,
                             burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                             slos=slos, prompt_format=args.prompt_format,
                             ignore_eos=args.ignore_eos, seed=args.seed,
                             backend=args.backend, api_key=args.api_key,
                             progress=args.progress, tenants=tenants,
                             tenant_keys=tenant_keys, objectives=objectives,
                             lora_modules=args.lora_modules, n=args.n)
    except (ValueError, OSError) as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 1
    report["workload"] = {"name": args.workload, **summarize(requests)}
    print(format_serve(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        from treadle.bench.plots import plot_serve

        for path in plot_serve(report, args.plot):
            print(f"wrote {path}")
    return 0


def add_roofline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[1, 8, 32, 128])
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_roofline(args: argparse.Namespace) -> int:
    from treadle.bench.roofline import bench_roofline, format_roofline

    report = bench_roofline(args.model, args.dtype, args.batch_sizes, args.context_len,
                            args.quantization, args.load_format)
    print(json.dumps(report, indent=2) if args.json else format_roofline(report))
    return 0
