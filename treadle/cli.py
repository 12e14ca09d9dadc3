"""`treadle generate | bench forward | bench offline`."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from treadle.config import DEFAULT_DTYPE, DTYPES


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    from treadle.bench.offline import bench_offline, format_offline

    kwargs = {k: v for k, v in dict(max_input_len=args.max_input_len,
                                    max_output_len=args.max_output_len,
                                    hf_batch_size=args.hf_batch_size).items() if v is not None}
    report = bench_offline(args.model, args.dtype, num_prompts=args.num_prompts, seed=args.seed,
                           **kwargs)
    print(json.dumps(report, indent=2) if args.json else format_offline(report))
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
