"""`treadle serve | generate | sim | bench forward | offline | serve | soak | roofline | steps`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from treadle.config import (
    KV_CACHE_DTYPES,
    OPERATIONS,
    QUANTIZATION_CHOICES,
    SCHEDULING,
    SERVER,
    EngineConfig,
    ModelConfig,
    ServeConfig,
    build_config,
    field_default,
    grouped_settings,
    read_settings_file,
    setting_fields,
)
from treadle.flags import add_setting_flag, has_flag
from treadle.plugins import load_plugins

ENV_PREFIX = "TREADLE_"
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True,
            "0": False, "false": False, "no": False, "off": False}
SETTINGS_EPILOG = (
    "Every flag may also be set in the environment as TREADLE_<FLAG> (TREADLE_BLOCK_SIZE=32, "
    "TREADLE_ENABLE_PREFIX_CACHING=false, TREADLE_SERVED_MODEL_NAME=a,b) or in a --config file "
    "(TREADLE_CONFIG). Precedence: a flag over the environment, over the file, over the "
    "default shown.")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def choice_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of `choices`."""
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(f"{name!r} is not one of {choices}")
        return names
    return parse


def add_model_args(parser: argparse.ArgumentParser, several_quantizations: bool = False,
                   device: bool = True) -> None:
    """`device`: whether the command takes --device (the CPU-only benches do not)."""
    settings = setting_fields(ModelConfig)
    for name in ("model", "device", "dtype", "quantization", "load_format"):
        f = settings[name]
        if name == "device" and not device:
            continue
        if name == "quantization" and several_quantizations:
            parser.add_argument("--quantization", type=choice_list(QUANTIZATION_CHOICES),
                                default=["none", "auto"], help="comma-separated, each measured "
                                "in turn; " + f.metadata["help"])
        else:
            add_setting_flag(parser, f, default=field_default(f))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def add_serve_settings(srv: argparse.ArgumentParser) -> None:
    """Every engine and server setting as a flag named after it (the registered policies'
    too), grouped as config.py titles them, and --config FILE."""
    srv.add_argument("--config", default=None, metavar="FILE",
                     help="settings from a YAML (.yaml), TOML (.toml) or JSON (.json) file, "
                          "keyed by the flags' names with underscores (block_size: 32)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for title, f in grouped_settings(ServeConfig):
        if title not in groups:
            groups[title] = srv.add_argument_group(title)
        if has_flag(f):
            add_setting_flag(groups[title], f)
    # The settings given otherwise: tenant_weights, api_keys (serve_config reads these).
    groups[SCHEDULING].add_argument(
        "--tenant-weight", action="append", metavar="NAME=WEIGHT", default=argparse.SUPPRESS,
        help="a tenant's weight under policies that share by tenant (default 1; repeatable; "
             "overrides the key file's)")
    groups[SERVER].add_argument(
        "--api-key", action="append", default=argparse.SUPPRESS,
        help="require `Authorization: Bearer KEY` on every route but /health and /ready, and "
             "on gRPC (repeatable)")
    groups[SERVER].add_argument(
        "--api-key-file", default=argparse.SUPPRESS,
        help="API keys, one per line: KEY, NAME:KEY, NAME:KEY:WEIGHT or "
             "NAME:KEY:[WEIGHT]:ADAPTER[,ADAPTER...]; NAME is the tenant of the key's requests "
             "(default key-N), WEIGHT its weight, ADAPTERs the only LoRA adapters it may use "
             "(besides the base model; it may not load or unload any); a key reads its own "
             "tenant's request records (explain, timelines, the dashboard's rows), keys named "
             "admin every tenant's")
    groups[OPERATIONS].add_argument(
        "--no-restart-engine", dest="max_engine_restarts", action="store_const", const=0,
        default=argparse.SUPPRESS,
        help="exit (status 1) when the engine dies, for an orchestrator to restart")


def add_plan_args(plan: argparse.ArgumentParser) -> None:
    """`treadle plan`: the serve settings that change memory, under the same flags."""
    settings = setting_fields(EngineConfig)
    for name, help in (("model", None),
                       ("dtype", "auto: what the engine would pick on this CPU"),
                       ("quantization", "auto: a GGUF's matrices as stored"),
                       ("max_model_len", "tokens per request"),
                       ("dense_batch_weights", "with quantization, also a dense copy"),
                       ("block_size", None),
                       ("kv_cache_dtype", None),
                       ("max_num_batched_tokens", None),
                       ("long_prefill_token_threshold", "most prompt tokens of one request per "
                        "step")):
        add_setting_flag(plan, settings[name], help=help)
    plan.add_argument("--concurrency", type=int, default=None,
                      help="requests of max_model_len tokens at once (default: --max-num-seqs's "
                           "default)")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")


def run_plan(args: argparse.Namespace) -> int:
    from treadle.model.memory import format_plan, plan

    settings = {k: v for k, v in vars(args).items() if k not in ("command", "concurrency", "json")}
    try:
        if args.concurrency is not None and args.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
        report = plan(build_config(EngineConfig, settings), args.concurrency)
    except ValueError as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    add_serve_settings(commands.add_parser(
        "serve", help="the OpenAI-compatible REST server (and with --grpc-port the gRPC server) "
        "over one engine", epilog=SETTINGS_EPILOG))
    from treadle.chat_cli import add_chat_args

    add_chat_args(commands.add_parser("chat", help="chat in the terminal with the local engine "
                                                   "or any OpenAI-compatible server (--url)"))

    env = commands.add_parser("env", help="what to paste into a bug report: versions, CPU, the "
                                          "dtype auto picks, fast paths, kernel build")
    env.add_argument("--json", action="store_true", help="print the report as JSON")

    add_plan_args(commands.add_parser("plan", help="how much fits: memory of the weights, KV "
                                                   "cache and activations against free memory"))

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
    fwd.add_argument("--kv-cache-dtype", type=choice_list(KV_CACHE_DTYPES), default=["auto"],
                     help="comma-separated, each measured in turn: auto (the model's dtype, "
                          "bfloat16 under a float32 model), bfloat16, float32, int8")
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
    add_model_args(roof, device=False)
    add_roofline_args(roof)
    from treadle.sim.commands import add_sim_args, add_steps_args

    steps = bench.add_parser("steps", help="time mixed prefill+decode steps; fit the step-time "
                                           "profile `treadle sim` uses")
    add_model_args(steps, device=False)
    add_steps_args(steps)
    add_sim_args(commands.add_parser("sim", help="replay a workload through the real scheduler "
                                                 "in virtual time (no model)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        load_plugins()  # first: the policies they register bring flags
    except ImportError as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "chat":
        from treadle.chat_cli import run_chat

        return run_chat(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "env":
        from treadle.environment import collect_env, format_env

        report = collect_env()
        print(json.dumps(report, indent=2) if args.json else format_env(report))
        return 0
    if args.threads is not None:
        import torch  # here: `treadle serve`'s process never imports it

        torch.set_num_threads(args.threads)
    if args.command == "generate":
        return generate(args)
    if args.command == "sim":
        from treadle.sim.commands import run_sim

        return run_sim(args)
    if args.bench == "steps":
        from treadle.sim.steps import run_steps

        return run_steps(args)
    if args.bench == "soak":
        from treadle.bench.soak import run_soak

        return run_soak(args)
    if args.bench == "forward":
        from treadle.bench.forward import bench_forward, format_forward

        report = bench_forward(args.model, args.dtype, args.batch_sizes, args.thread_counts,
                               context_len=args.context_len,
                               quantizations=tuple(args.quantization), device=args.device,
                               load_format=args.load_format,
                               kv_cache_dtypes=tuple(args.kv_cache_dtype))
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
                           device=args.device, load_format=args.load_format, **kwargs)
    print(json.dumps(report, indent=2) if args.json else format_offline(report))
    return 0


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


def env_settings(parser: argparse.ArgumentParser, environ: Mapping[str, str]
                 ) -> dict[str, Any]:
    """The flags of `parser` set in `environ` as TREADLE_<FLAG> (TREADLE_BLOCK_SIZE=32; a
    repeatable flag's values comma-separated; a switch true/false), typed as the flag types
    them. ValueError naming the variable for a bad value."""
    settings: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._StoreConstAction | \
                                                   argparse._HelpAction):
            continue
        variable = ENV_PREFIX + action.option_strings[0].lstrip("-").replace("-", "_").upper()
        text = environ.get(variable)
        if text is None:
            continue
        try:
            settings[action.dest] = env_value(action, text)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"{variable}={text!r}: {e}") from None
    return settings


def env_value(action: argparse.Action, text: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction):
        if text.lower() not in BOOLEANS:
            raise ValueError(f"expected one of {', '.join(BOOLEANS)}")
        return BOOLEANS[text.lower()]
    several = isinstance(action, argparse._AppendAction) or action.nargs == "+"
    values = [action.type(v) if action.type else v
              for v in (text.split(",") if several else [text])]
    for value in values:
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return values if several else values[0]


def serve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                 ) -> ServeConfig:
    """The whole config of `treadle serve`: the defaults, then the --config file's settings,
    then the environment's (TREADLE_<FLAG>; `environ` None: os.environ), then the flags given.
    ValueError naming the setting for a bad one; OSError for an unreadable key file."""
    from treadle.server.auth import key_weights, parse_api_keys

    serve_parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    env = env_settings(serve_parser, os.environ if environ is None else environ)
    config_file = args.config if args.config is not None else env.pop("config", None)
    settings = read_settings_file(config_file) if config_file is not None else {}
    settings.update(env)
    settings.update((name, value) for name, value in vars(args).items()
                    if name not in ("command", "config"))
    # Keys: bare keys (--api-key), then key lines (a file's `api_keys`, the key file's; see
    # server/auth.py); their weights, then --tenant-weight's, override a file's tenant_weights.
    lines = list(settings.pop("api_keys", ()))
    api_key_file = settings.pop("api_key_file", None)
    if api_key_file is not None:
        with open(api_key_file) as f:
            lines += f.read().splitlines()
    keys = parse_api_keys(settings.pop("api_key", ()), lines)
    settings["api_keys"] = tuple(keys)
    settings["tenant_weights"] = {**settings.get("tenant_weights", {}), **key_weights(keys),
                                  **parse_tenant_weights(settings.pop("tenant_weight", ()))}
    return build_config(ServeConfig, settings)


def serve(args: argparse.Namespace) -> int:
    from treadle.frontend.async_engine import AsyncEngine
    from treadle.server.launcher import serve as serve_frontends

    # Configured first: the first start's GGUF conversion and kernel build say what they do.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    try:
        config = serve_config(args)
        engine = AsyncEngine(config.engine)
    except (ValueError, OSError) as e:  # a bad model path or setting, an unreadable file
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    code = serve_frontends(engine, config.server)
    # Nothing is left to save: skip the interpreter's teardown of the server's modules, so the
    # process ends within its shutdown timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def generate(args: argparse.Namespace) -> int:
    from treadle.core.sampling_params import SamplingParams
    from treadle.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
                  device=args.device, load_format=args.load_format)
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
