"""`treadle serve | generate | bench forward | offline | serve | roofline`."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

import torch

from treadle.config import DEFAULT_DTYPE, DTYPES


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                        help="auto (default): bfloat16 where the CPU computes it natively "
                             "(AVX-512 BF16, AMX), else float32")
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
    srv.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs",
                     help="queue order; priority honours each request's `priority` field")
    srv.add_argument("--max-queued-requests", type=int, default=256,
                     help="requests waiting for their first token; past it: 429")
    srv.add_argument("--max-queued-tokens", type=int, default=None,
                     help="prompt tokens waiting for their first token; past it: 429")
    srv.add_argument("--api-key", action="append", default=[],
                     help="require `Authorization: Bearer KEY` on /v1/* and /tokenize "
                          "(repeatable)")
    srv.add_argument("--api-key-file", default=None, help="API keys, one per line")
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
                          "they are aborted")

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
    add_model_args(fwd)
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
    roof = bench.add_parser("roofline", help="memory bandwidth, matmul rate, decode-step floor")
    add_model_args(roof)
    add_roofline_args(roof)
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
    if args.bench == "forward":
        from treadle.bench.forward import bench_forward, format_forward

        report = bench_forward(args.model, args.dtype, args.batch_sizes, args.thread_counts,
                               context_len=args.context_len)
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
    raise SystemExit(0)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from treadle.engine.async_engine import AsyncEngine
    from treadle.server.openai.app import build_app

    # Configured first: the first start's GGUF conversion and kernel build say what they do.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    try:
        keys = list(args.api_key)
        if args.api_key_file is not None:
            with open(args.api_key_file) as f:
                keys += [line.strip() for line in f if line.strip()]
        # --threads goes to the engine process (default: one per core); this one keeps to HTTP
        # and tokenizing.
        engine = AsyncEngine(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                             max_num_seqs=args.max_num_seqs, policy=args.policy,
                             engine_threads=args.threads,
                             max_queued_requests=args.max_queued_requests,
                             max_queued_tokens=args.max_queued_tokens,
                             trace_file=args.trace_file, log_prompts=args.log_prompts)
    except (ValueError, OSError) as e:  # a bad model path or setting, an unreadable key file
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    app = build_app(engine, api_keys=keys, allowed_origins=args.allowed_origins,
                    max_request_bytes=args.max_request_bytes,
                    grpc_address=None if args.no_grpc else (args.host, args.grpc_port),
                    enable_debug_endpoints=args.enable_debug_endpoints)
    # On SIGTERM uvicorn stops accepting, lets in-flight requests finish up to the timeout,
    # then cancels them (which aborts them in the engine) and runs the lifespan's shutdown.
    # Then it re-raises the signal for the handler it found: let that handler exit 0.
    signal.signal(signal.SIGTERM, exit_cleanly)
    uvicorn.run(app, host=args.host, port=args.port,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


def generate(args: argparse.Namespace) -> int:
    from treadle.engine.sampling_params import SamplingParams
    from treadle.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        llm = LLM(model=args.model, dtype=args.dtype)
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
