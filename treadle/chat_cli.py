"""`treadle chat`: an interactive chat in the terminal, streamed, with the conversation's history,
against the local engine (AsyncLLM: the model loads in an engine process of its own) or any
OpenAI-compatible server (`--url`). `/reset` forgets the history, `/exit` (or end of input)
quits. Replies go to stdout, one per turn; everything else to stderr, so that piped output holds
only the replies."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from treadle.config import DTYPES, QUANTIZATION_CHOICES
from treadle.sse import sse_data

Messages = list[dict[str, str]]
Reply = Callable[[Messages], AsyncIterator[str]]  # the history -> the answer's text pieces


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="an OpenAI-compatible server (http://host:8000 or .../v1); "
                             "default: the local engine")
    parser.add_argument("--api-key", default=None, help="with --url: its Bearer key")
    parser.add_argument("--model", default=None,
                        help="local: a Hugging Face folder or .gguf file (default: "
                             "SmolLM2-135M-Instruct); with --url: the model's name (default: "
                             "the server's first)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="local: the dtype")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto",
                        help="local: the quantization")
    parser.add_argument("--system", default=None, help="a system message, kept across /reset")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    parser.add_argument("--temperature", type=float, default=None,
                        help="default: the model's generation config's, else 1")


def run_chat(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(chat(args))
    except KeyboardInterrupt:
        return 0


async def chat(args: argparse.Namespace) -> int:
    sampling: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if args.url is not None:
        async with httpx.AsyncClient(base_url=api_base(args.url), timeout=None, headers={
                "Authorization": f"Bearer {args.api_key}"} if args.api_key else None) as client:
            try:
                model = args.model or await first_model(client)
            except (httpx.HTTPError, ValueError) as e:
                print(f"treadle: cannot reach {args.url}: {e}", file=sys.stderr)
                return 1
            return await converse(remote_reply(client, model, sampling), args.system)
    from treadle.async_llm import AsyncLLM
    from treadle.core.sampling_params import SamplingParams

    try:
        llm = AsyncLLM(args.model, dtype=args.dtype, quantization=args.quantization)
    except ValueError as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    print("loading the model...", file=sys.stderr)
    async with llm:
        params = SamplingParams(**{**llm.engine.sampling_defaults, **sampling})

        async def reply(messages: Messages) -> AsyncIterator[str]:
            sent = 0
            async for output in llm.generate(llm.chat_prompt(messages), params):
                text = output.outputs[0].text
                yield text[sent:]
                sent = len(text)

        return await converse(reply, args.system)


async def converse(reply: Reply, system: str | None) -> int:
    """Read turns from stdin until /exit or its end; stream each reply to stdout."""
    start: Messages = [{"role": "system", "content": system}] if system else []
    history = list(start)
    interactive = sys.stdin.isatty()
    print("/reset forgets the conversation, /exit quits", file=sys.stderr)
    while True:
        try:
            line = await asyncio.to_thread(input, "> " if interactive else "")
        except EOFError:
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history = list(start)
            print("(history cleared)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        answer = ""
        try:
            async for piece in reply(history):
                answer += piece
                print(piece, end="", flush=True)
        except (ValueError, RuntimeError, httpx.HTTPError) as e:  # too long a history, a 4xx
            print(f"\ntreadle: {e}", file=sys.stderr)
            history.pop()
            continue
        print(flush=True)
        history.append({"role": "assistant", "content": answer})


def api_base(url: str) -> str:
    """http://host:8000, http://host:8000/ or http://host:8000/v1 -> http://host:8000/v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


async def first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError("the server lists no models")
    return models[0]["id"]


def remote_reply(client: httpx.AsyncClient, model: str, sampling: dict[str, Any]) -> Reply:
    async def reply(messages: Messages) -> AsyncIterator[str]:
        body = {"model": model, "messages": messages, "stream": True, **sampling}
        async with client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise ValueError(f"HTTP {response.status_code}: {error_message(response)}")
            async for data in sse_data(response):
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise ValueError(event["error"].get("message", "the server failed"))
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece

    return reply


def error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
