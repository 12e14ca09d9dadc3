"""`treadle serve | generate | sim | bench forward | offline | serve | soak | roofline | steps`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import torch

from treadle.config import DEFAULT_DTYPE, DTYPES, QUANTIZATION_CHOICES


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def quantization_list(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    for name in names:
        if name not in QUANTIZATION_CHOICES:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {QUANTIZATION_CHOICES}")
    return names


def add_model_args(parser: argparse.ArgumentParser, several_quantizations: bool = False) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                        help="auto (default): bfloat16 where the CPU computes it natively "
                             "(AVX-512 BF16, AMX), else float32")
    quantization_help = ("auto (default): a GGUF's Q4_0/Q4_1/Q8_0 matrices served as stored; "
                         "none: dequantized to --dtype; int8/int4: quantized at load")
    if several_quantizations:
        parser.add_argument("--quantization", type=quantization_list, default=["none", "auto"],
                            help="comma-separated, each measured in turn; " + quantization_help)
    else:
        parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto",
                            help=quantization_help)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    srv = commands.add_parser("serve", help="the OpenAI-compatible REST server and the gRPC "
                                            "server, over one engine")
    add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="context length (default: the model's own)")
    srv.add_argument("--max-num-seqs", type=int, default=128,
                     help="most sequences in one model pass")
    srv.add_argument("--policy", choices=("fcfs", "priority", "fair", "deadline"),
                     default="fcfs",
                     help="queue order: fcfs; priority (each request's `priority` field, lower "
                          "first, may preempt); fair (fair share between tenants); deadline "
                          "(earliest deadline first, refusing TTFTs it cannot meet with 429)")
    srv.add_argument("--max-num-partial-prefills", type=int, default=4,
                     help="most requests mid-prefill that get a chunk in one step")
    srv.add_argument("--long-prefill-token-threshold", type=int, default=256,
                     help="most prompt tokens one request computes in one step")
    srv.add_argument("--max-queue-wait", type=float, default=None, metavar="SECONDS",
                     help="a request still waiting (never scheduled) past it ends with 503 / an "
                          "SSE queue_timeout error / gRPC DEADLINE_EXCEEDED (default: no limit)")
    srv.add_argument("--max-kv-blocks-per-tenant", type=int, default=None,
                     help="most KV cache blocks one tenant's running requests may hold when "
                          "another of its requests is admitted (default: no cap)")
    srv.add_argument("--max-requests-per-tenant", type=int, default=None,
                     help="requests in flight per tenant; past it: 429 tenant_requests")
    srv.add_argument("--max-queued-tokens-per-tenant", type=int, default=None,
                     help="prompt tokens waiting for their first token, per tenant; past it: "
                          "429 tenant_queued_tokens")
    srv.add_argument("--tenant-weight", action="append", default=[], metavar="NAME=WEIGHT",
                     help="a tenant's weight under --policy fair (default 1; repeatable; "
                          "overrides the key file's)")
    srv.add_argument("--max-tenants", type=int, default=1024,
                     help="distinct tenants named by clients' `user` fields that are tracked; "
                          "later ones share the tenant 'other'")
    srv.add_argument("--max-tenant-labels", type=int, default=32,
                     help="distinct `tenant` label values in the metrics; later tenants are "
                          "labelled 'other'")
    srv.add_argument("--isolate-prefix-cache-by-tenant", action="store_true",
                     help="tenants never share prefix-cache blocks (the cache salt includes "
                          "the tenant), so none can probe another's prompts through timing")
    srv.add_argument("--default-ttft-ms", type=float, default=None,
                     help="TTFT objective of requests that set none (default: none)")
    srv.add_argument("--default-tpot-ms", type=float, default=None,
                     help="TPOT objective of requests that set none (default: none)")
    srv.add_argument("--max-queued-requests", type=int, default=256,
                     help="requests waiting for their first token; past it: 429")
    srv.add_argument("--max-queued-tokens", type=int, default=None,
                     help="prompt tokens waiting for their first token; past it: 429")
    srv.add_argument("--api-key", action="append", default=[],
                     help="require `Authorization: Bearer KEY` on every route but /health and "
                          "/ready, and on gRPC (repeatable)")
    srv.add_argument("--api-key-file", default=None,
                     help="API keys, one per line: KEY, NAME:KEY or NAME:KEY:WEIGHT; NAME is "
                          "the tenant of the key's requests (default key-N), WEIGHT its weight "
                          "under --policy fair")
    srv.add_argument("--metrics-without-auth", action="store_true",
                     help="serve /metrics without a key, for scrapers that cannot send one")
    srv.add_argument("--allowed-origins", action="append", default=[],
                     help="an origin browsers may call from (CORS; repeatable; none by default)")
    srv.add_argument("--max-request-bytes", type=int, default=4 << 20,
                     help="larger request bodies get 413")
    srv.add_argument("--grpc-port", type=int, default=50051, help="the gRPC frontend's port")
    srv.add_argument("--no-grpc", action="store_true", help="serve REST only")
    srv.add_argument("--trace-file", default=None,
                     help="write every engine step to this Chrome-trace/Perfetto JSON file")
    srv.add_argument("--enable-debug-endpoints", action="store_true",
                     help="GET /debug/requests/{id}: a recent request's timeline")
    srv.add_argument("--log-prompts", action="store_true",
                     help="include the prompt text in each finished request's log line")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds in-flight requests may take to finish before "
                          "they end with a server_shutdown error")
    srv.add_argument("--max-engine-restarts", type=int, default=5,
                     help="restarts of a dead engine in a row (backing off 0.5 s, 1 s, 2 s, ...) "
                          "before the server exits with status 1")
    srv.add_argument("--no-restart-engine", action="store_true",
                     help="exit (status 1) when the engine dies, for an orchestrator to restart")
    srv.add_argument("--engine-stall-timeout", type=float, default=30.0,
                     help="seconds a busy engine may go without finishing a step before /ready "
                          "and /health turn 503 (status stalled)")

    env = commands.add_parser("env", help="what to paste into a bug report: versions, CPU, the "
                                          "dtype auto picks, fast paths, kernel build")
    env.add_argument("--json", action="store_true", help="print the report as JSON")

    gen = commands.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    add_model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, not through the model's chat template")

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                          required=True)
    fwd = bench.add_parser("forward", help="decode-step time against the machine's floor")
    add_model_args(fwd, several_quantizations=True)
    fwd.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32, 128])
    fwd.add_argument("--thread-counts", type=int_list, default=[1, 2])
    fwd.add_argument("--context-len", type=int, default=128)
    fwd.add_argument("--json", action="store_true", help="print the report as JSON")

    off = bench.add_parser("offline", help="LLM.generate against Hugging Face generate")
    add_model_args(off)
    off.add_argument("--num-prompts", type=int, default=200)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--max-input-len", type=int, default=None)
    off.add_argument("--max-output-len", type=int, default=None)
    off.add_argument("--hf-batch-size", type=int, default=None)
    off.add_argument("--json", action="store_true", help="print the report as JSON")

    from treadle.bench.commands import add_roofline_args, add_serve_args

    add_serve_args(bench.add_parser("serve", help="replay a workload against an "
                                    "OpenAI-compatible server"))
    from treadle.bench.soak import add_soak_args

    add_soak_args(bench.add_parser("soak", help="a mixed load for a while (default 10m): "
                                   "errors, memory of both processes, leaked KV blocks"))
    roof = bench.add_parser("roofline", help="memory bandwidth, matmul rate, decode-step floor")
    add_model_args(roof)
    add_roofline_args(roof)
    from treadle.bench.steps import add_steps_args

    steps = bench.add_parser("steps", help="time mixed prefill+decode steps; fit the step-time "
                                           "profile `treadle sim` uses")
    add_model_args(steps)
    add_steps_args(steps)

    from treadle.sim.commands import add_sim_args

    add_sim_args(commands.add_parser("sim", help="replay a workload through the real scheduler "
                                                 "in virtual time (no model)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "env":
        from treadle.environment import collect_env, format_env

        report = collect_env()
        print(json.dumps(report, indent=2) if args.json else format_env(report))
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.command == "generate":
        return generate(args)
    if args.command == "sim":
        from treadle.sim.commands import run_sim

        return run_sim(args)
    if args.bench == "steps":
        from treadle.bench.steps import run_steps

        return run_steps(args)
    if args.bench == "soak":
        from treadle.bench.soak import run_soak

        return run_soak(args)
    if args.bench == "forward":
        from treadle.bench.forward import bench_forward, format_forward

        report = bench_forward(args.model, args.dtype, args.batch_sizes, args.thread_counts,
                               context_len=args.context_len,
                               quantizations=tuple(args.quantization))
        print(json.dumps(report, indent=2) if args.json else format_forward(report))
        return 0
    if args.bench in ("serve", "roofline"):
        from treadle.bench.commands import run_roofline, run_serve

        return run_serve(args) if args.bench == "serve" else run_roofline(args)
    from treadle.bench.offline import bench_offline, format_offline

    kwargs = {k: v for k, v in dict(max_input_len=args.max_input_len,
                                    max_output_len=args.max_output_len,
                                    hf_batch_size=args.hf_batch_size).items() if v is not None}
    report = bench_offline(args.model, args.dtype, num_prompts=args.num_prompts, seed=args.seed,
                           **kwargs)
    print(json.dumps(report, indent=2) if args.json else format_offline(report))
    return 0


def exit_cleanly(*_: object) -> None:
    # The server has shut down and nothing is left to save: skip the interpreter's teardown of
    # torch and transformers (a second or more), so the process ends within its shutdown timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse_tenant_weights(items: list[str]) -> dict[str, float]:
    """["alice=2", "bob=0.5"] -> {"alice": 2.0, "bob": 0.5}; ValueError if malformed."""
    weights = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            weight = float(value) if sep and name else float("nan")
        except ValueError:
            weight = float("nan")
        if not (weight > 0 and weight != float("inf")):
            raise ValueError(f"--tenant-weight {item!r} is not NAME=WEIGHT with WEIGHT > 0")
        weights[name] = weight
    return weights


def serve(args: argparse.Namespace) -> int:
    from treadle.engine.async_engine import AsyncEngine
    from treadle.server.auth import key_weights, parse_api_keys
    from treadle.server.openai.app import build_app, run

    # Configured first: the first start's GGUF conversion and kernel build say what they do.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    try:
        lines: list[str] = []
        if args.api_key_file is not None:
            with open(args.api_key_file) as f:
                lines = f.read().splitlines()
        keys = parse_api_keys(args.api_key, lines)
        weights = {**key_weights(keys), **parse_tenant_weights(args.tenant_weight)}
        scheduler_options = dict(
            max_num_partial_prefills=args.max_num_partial_prefills,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_queue_wait=args.max_queue_wait,
            max_kv_blocks_per_tenant=args.max_kv_blocks_per_tenant, tenant_weights=weights)
        # --threads goes to the engine process (default: one per core); this one keeps to HTTP
        # and tokenizing.
        engine = AsyncEngine(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                             max_num_seqs=args.max_num_seqs, policy=args.policy,
                             engine_threads=args.threads,
                             max_queued_requests=args.max_queued_requests,
                             max_queued_tokens=args.max_queued_tokens,
                             trace_file=args.trace_file, log_prompts=args.log_prompts,
                             max_restarts=0 if args.no_restart_engine
                             else args.max_engine_restarts,
                             stall_timeout=args.engine_stall_timeout,
                             quantization=args.quantization,
                             scheduler_options=scheduler_options,
                             max_requests_per_tenant=args.max_requests_per_tenant,
                             max_queued_tokens_per_tenant=args.max_queued_tokens_per_tenant,
                             max_tenants=args.max_tenants,
                             max_tenant_labels=args.max_tenant_labels,
                             isolate_prefix_cache_by_tenant=args.isolate_prefix_cache_by_tenant,
                             default_ttft=None if args.default_ttft_ms is None
                             else args.default_ttft_ms / 1e3,
                             default_tpot=None if args.default_tpot_ms is None
                             else args.default_tpot_ms / 1e3)
    except (ValueError, OSError) as e:  # a bad model path or setting, an unreadable key file
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    app = build_app(engine, api_keys=keys, allowed_origins=args.allowed_origins,
                    max_request_bytes=args.max_request_bytes,
                    grpc_address=None if args.no_grpc else (args.host, args.grpc_port),
                    enable_debug_endpoints=args.enable_debug_endpoints,
                    metrics_without_auth=args.metrics_without_auth)
    # On SIGTERM uvicorn stops accepting, lets in-flight requests finish up to the timeout,
    # then run() ends them with a server_shutdown error, and the lifespan's shutdown runs.
    # Then uvicorn re-raises the signal for the handler it found: let that handler exit 0.
    signal.signal(signal.SIGTERM, exit_cleanly)
    return run(app, engine, args.host, args.port, args.shutdown_timeout)


def generate(args: argparse.Namespace) -> int:
    from treadle.engine.sampling_params import SamplingParams
    from treadle.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization)
        prompt = args.prompt if args.raw or not llm.tokenizer.chat_template \
            else llm.chat_prompt(args.prompt)
        output = llm.generate([prompt], params, use_tqdm=False)[0]
    except ValueError as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    print(output.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
