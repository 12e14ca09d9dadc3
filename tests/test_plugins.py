"""A policy from one module outside the package, loaded by TREADLE_PLUGINS (tests/toy_policy.py:
shortest prompt first, refusing prompts over its one setting): selectable by --policy, its
setting a flag of `treadle serve` and `treadle sim`, a variable and a config key, and it
schedules and refuses in the sim, in the engine core and through the engine process. Each in
a fresh process: a registered policy stays for the process's life."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import ROOT

TESTS = ROOT / "tests"


def run(*args: str, plugins: str = "toy_policy") -> subprocess.CompletedProcess:
    env = {**os.environ, "TREADLE_PLUGINS": plugins,
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


def help_text(command: str, plugins: str = "toy_policy") -> str:
    result = run("-m", "treadle.cli", command, "--help", plugins=plugins)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())


def test_the_plugins_policy_and_setting_are_flags_of_serve_and_sim():
    for command in ("serve", "sim"):
        text = help_text(command)
        assert "toy (shortest prompt first)" in text
        assert ("--toy-max-prompt-tokens TOY_MAX_PROMPT_TOKENS under --policy toy, the longest "
                "prompt admitted; longer ones are refused (default: no limit)") in text
        assert "--toy-max-prompt-tokens" not in help_text(command, plugins="")
    assert "{fcfs,priority,fair,deadline,toy}" in help_text("serve")
    result = run("-m", "treadle.cli", "serve", "--help", plugins="no_such_plugin")
    assert result.returncode == 2 and "TREADLE_PLUGINS" in result.stderr


def test_the_plugins_setting_from_the_environment_and_a_config_file(tmp_path):
    (tmp_path / "t.yaml").write_text("policy: toy\ntoy_max_prompt_tokens: 5\n")
    code = textwrap.dedent(f"""
        from treadle.plugins import load_plugins
        load_plugins()
        from treadle.cli import build_parser, serve_config
        args = build_parser().parse_args(["serve", "--config", {str(tmp_path / "t.yaml")!r}])
        engine = serve_config(args).engine.engine
        print(engine.policy, engine.policy_settings.toy_max_prompt_tokens)
        engine = serve_config(args, {{"TREADLE_TOY_MAX_PROMPT_TOKENS": "9"}}).engine.engine
        print(engine.policy_settings.toy_max_prompt_tokens)
        """)
    result = run("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["toy", "5", "9"]


def test_the_plugins_policy_schedules_and_refuses_in_the_sim(tmp_path):
    """One sequence at a time, everything queued at once: shortest prompt first, and the
    prompts over the limit refused (reason: the policy's name)."""
    out = tmp_path / "sim.json"
    result = run("-m", "treadle.cli", "sim", "--num-prompts", "40", "--policy", "fcfs,toy",
                 "--toy-max-prompt-tokens", "200", "--max-num-seqs", "1", "--output-len", "8",
                 "--json", str(out), "--per-request")
    assert result.returncode == 0, result.stderr
    fcfs, toy = json.loads(out.read_text())["runs"]
    assert toy["settings"]["toy_max_prompt_tokens"] == 200
    refused = [r for r in toy["requests"] if r["finish_reason"] == "toy"]
    assert refused and all(r["prompt_len"] > 200 for r in refused)
    admitted = sorted((r for r in toy["requests"] if r["finish_reason"] != "toy"),
                      key=lambda r: r["queue_s"])
    assert len(admitted) + len(refused) == 40
    assert [r["prompt_len"] for r in admitted] == sorted(r["prompt_len"] for r in admitted)
    assert fcfs["rejected"] == 0


def test_the_plugins_policy_in_the_engine_core_and_the_engine_process(tiny_folder):
    """LLM's engine core: one sequence at a time, the shortest prompt finishes first; AsyncLLM
    (the engine in its own process, which loads the plugin too): a prompt over the limit is
    refused with the policy's name as the reason, a short one runs."""
    code = textwrap.dedent(f"""
        import asyncio
        from treadle import AsyncLLM, LLM, SamplingParams
        from treadle.frontend.admission import EngineOverloaded

        settings = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=1,
                        policy="toy", toy_max_prompt_tokens=6)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        core = LLM({str(tiny_folder)!r}, **settings).engine
        print(type(core.scheduler.policy).__name__, core.refusal([5] * 7) is not None,
              core.refusal([5] * 6))
        for name, length in (("long", 6), ("short", 2), ("mid", 4)):
            core.add_request(name, [5] * length, params)
        order = []
        while core.has_unfinished_requests():
            order += [o.request_id for o in core.step() if o.finished]
        print(*order)

        async def serve():
            async with AsyncLLM({str(tiny_folder)!r}, **settings) as llm:
                try:
                    async for _ in llm.generate([5] * 7, params):
                        pass
                except EngineOverloaded as e:
                    print(e.reason)
                async for output in llm.generate([5] * 3, params):
                    pass
                print(output.finished)

        asyncio.run(serve())
        """)
    result = run("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["ShortestPromptFirst True None", "short mid long",
                                          "toy", "True"]
