"""One config, built from `treadle serve` flags, a --config file or `LLM(...)` keywords: the same
names everywhere, defaults from the dataclasses, flags over the file, a bad value refused with
its setting's name before anything starts; and the frontend process never imports torch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from treadle.cli import build_parser, serve_config
from treadle.config import (
    POLICIES,
    AdmissionConfig,
    APIKey,
    AsyncEngineConfig,
    CacheConfig,
    DataParallelConfig,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
    ServerConfig,
    SupervisionConfig,
    build_config,
    parse_bytes,
    setting_fields,
)
from treadle.core.sched.policy import POLICIES as POLICY_CLASSES
from treadle.llm import LLM


def from_flags(*flags: str) -> ServeConfig:
    return serve_config(build_parser().parse_args(["serve", *flags]))


def test_no_flags_give_the_dataclass_defaults():
    assert from_flags() == ServeConfig()
    assert ServeConfig().engine == AsyncEngineConfig(EngineConfig(), AdmissionConfig(),
                                                     SupervisionConfig(), ObservabilityConfig())


def test_every_setting_is_a_flag_and_names_are_unique():
    names = [f.name for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig,
                                AdmissionConfig, SupervisionConfig, ObservabilityConfig,
                                DataParallelConfig, ServerConfig)
             for f in dataclasses.fields(cls)]
    names += ["policy", "trace_file", "speculative_config"]
    names += [f.name for policy in POLICIES.values() if policy.settings
              for f in dataclasses.fields(policy.settings)]
    assert len(names) == len(set(names)) == len(setting_fields(ServeConfig))
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    # Settings given otherwise: tenant_weights by --tenant-weight, api_keys by --api-key(-file).
    for name in set(names) - {"tenant_weights", "api_keys"}:
        assert f"--{name.replace('_', '-')}" in help_text, name


def test_flags_reach_every_section():
    config = from_flags(
        "--model", "m.gguf", "--dtype", "float32", "--threads", "3", "--block-size", "32",
        "--num-blocks", "100", "--kv-cache-memory-bytes", "512MiB", "--no-enable-prefix-caching",
        "--max-num-batched-tokens", "1024", "--max-num-seqs", "8", "--policy", "fair",
        "--tenant-weight", "alice=2", "--max-queued-requests", "9", "--default-ttft-ms", "250",
        "--no-restart-engine", "--log-prompts", "--max-tenant-labels", "4", "--port", "9000",
        "--api-key", "k1", "--allowed-origins", "https://a", "--allowed-origins",
        "https://b", "--chat-template", "{{ messages }}", "--max-request-bytes", "1MiB")
    engine = config.engine.engine
    assert engine.model == ModelConfig(model="m.gguf", dtype="float32")
    assert engine.cache == CacheConfig(block_size=32, num_blocks=100,
                                       kv_cache_memory_bytes=512 << 20,
                                       enable_prefix_caching=False)
    assert engine.scheduler == SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8,
                                               tenant_weights={"alice": 2.0})
    assert (engine.parallel.engine_threads, engine.policy) == (3, "fair")
    assert config.engine.admission == AdmissionConfig(max_queued_requests=9,
                                                      default_ttft_ms=250.0)
    assert config.engine.supervision.max_engine_restarts == 0
    assert config.engine.observability == ObservabilityConfig(log_prompts=True,
                                                              max_tenant_labels=4)
    assert config.server == ServerConfig(
        port=9000, grpc_port=None, api_keys=(APIKey("key-1", "k1"),),
        allowed_origins=("https://a", "https://b"), chat_template="{{ messages }}",
        max_request_bytes=1 << 20)


def test_an_api_key_file_binds_keys_to_adapters(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nacme:sk-1:2:acme-sql,acme-chat\nbeta:sk-2::beta-sql\nops:sk-3\n")
    config = from_flags("--api-key-file", str(path))
    assert config.server.api_keys == (APIKey("acme", "sk-1", 2.0, ("acme-sql", "acme-chat")),
                                      APIKey("beta", "sk-2", None, ("beta-sql",)),
                                      APIKey("ops", "sk-3"))
    assert config.engine.engine.scheduler.tenant_weights == {"acme": 2.0}
    path.write_text("acme:sk-1:2:acme-sql,\n")
    with pytest.raises(ValueError, match="line 1: adapter names"):
        from_flags("--api-key-file", str(path))


@pytest.mark.parametrize("suffix", [".toml", ".json", ".yaml"])
def test_a_config_file_under_the_flags(tmp_path, suffix):
    settings = {"block_size": 8, "kv_cache_memory_bytes": "2GiB", "max_num_seqs": 4,
                "policy": "priority", "port": 9100, "tenant_weights": {"bob": 3.0},
                "api_keys": ["alice:ka:2"], "max_engine_restarts": 1,
                "isolate_prefix_cache_by_tenant": True}
    path = tmp_path / f"treadle{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(settings))
    elif suffix == ".yaml":
        path.write_text(yaml.safe_dump(settings))
    else:
        path.write_text("\n".join(f"{k} = {json.dumps(v)}" if not isinstance(v, dict)
                                  else f"{k} = {{ bob = 3.0 }}" for k, v in settings.items()))
    config = from_flags("--config", str(path), "--max-num-seqs", "16", "--port", "9200")
    engine = config.engine.engine
    assert (engine.cache.block_size, engine.cache.kv_cache_memory_bytes) == (8, 2 << 30)
    assert engine.scheduler.max_num_seqs == 16 and config.server.port == 9200  # flags win
    assert engine.policy == "priority" and config.engine.supervision.max_engine_restarts == 1
    assert engine.scheduler.tenant_weights == {"bob": 3.0, "alice": 2.0}  # the key's weight
    assert config.server.api_keys == (APIKey("alice", "ka", 2.0),)
    assert config.engine.admission.isolate_prefix_cache_by_tenant


@pytest.mark.parametrize(("setting", "value"), [
    ("dtype", "float16"),  # ModelConfig
    ("block_size", 0),  # CacheConfig
    ("kv_cache_memory_bytes", "lots"),
    ("max_num_seqs", 0),  # SchedulerConfig
    ("engine_threads", 0),  # ParallelConfig
    ("policy", "lifo"),  # EngineConfig
    ("max_tenants", 0),  # AdmissionConfig
    ("default_tpot_ms", -5),
    ("engine_stall_timeout", 0),  # SupervisionConfig
    ("max_timelines", -1),  # ObservabilityConfig
    ("port", 70000),  # ServerConfig
    ("max_num_seqs", "8"),  # a wrong type
    ("log_prompts", 1),
    ("block_sise", 16),  # no such setting
])
def test_a_bad_setting_is_named(tmp_path, setting, value):
    with pytest.raises(ValueError, match=setting):
        build_config(ServeConfig, {setting: value})
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({setting: value}))
    with pytest.raises(ValueError, match=setting):
        from_flags("--config", str(path))


def test_bad_files_and_byte_sizes(tmp_path):
    with pytest.raises(ValueError, match="no-such.toml"):
        from_flags("--config", str(tmp_path / "no-such.toml"))
    (tmp_path / "broken.toml").write_text("block_size = = 3")
    with pytest.raises(ValueError, match="broken.toml"):
        from_flags("--config", str(tmp_path / "broken.toml"))
    (tmp_path / "c.ini").write_text("block_size: 3")
    with pytest.raises(ValueError, match=r"\.yaml, \.toml or \.json"):
        from_flags("--config", str(tmp_path / "c.ini"))
    (tmp_path / "broken.yaml").write_text("block_size: [3")
    with pytest.raises(ValueError, match="broken.yaml"):
        from_flags("--config", str(tmp_path / "broken.yaml"))
    assert [parse_bytes(t) for t in ("1024", "2GiB", "1.5 kB", "3mib")] == [
        1024, 2 << 30, 1500, 3 << 20]
    with pytest.raises(SystemExit):  # argparse: the flag's own error, exit status 2
        from_flags("--kv-cache-memory-bytes", "2 parsecs")


def test_serve_refuses_a_bad_setting_before_starting():
    result = subprocess.run([sys.executable, "-m", "treadle.cli", "serve", "--block-size", "0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "block_size must be >= 1" in result.stderr


def test_llm_takes_the_same_names_and_refuses_bad_ones_before_loading():
    with pytest.raises(ValueError, match="max_queued_requests"):  # a frontend setting
        LLM(max_queued_requests=3)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(long_prefill_token_threshold=0)


def test_the_policy_names_are_the_registry():
    assert set(POLICIES) == set(POLICY_CLASSES)


def test_the_frontend_never_imports_torch():
    code = ("import sys, treadle.server.openai.app, treadle.server.launcher, treadle.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_environment_sits_between_the_file_and_the_flags(tmp_path):
    path = tmp_path / "treadle.yaml"
    path.write_text("block_size: 8\nmax_num_seqs: 4\nport: 9100\n")
    environ = {"TREADLE_CONFIG": str(path), "TREADLE_MAX_NUM_SEQS": "6", "TREADLE_PORT": "9300",
               "TREADLE_ENABLE_PREFIX_CACHING": "false", "TREADLE_SERVED_MODEL_NAME": "a,b",
               "TREADLE_KV_CACHE_MEMORY_BYTES": "1GiB", "TREADLE_THREADS": "9",
               "TREADLE_DISABLE": "all"}  # not a setting: left alone
    args = build_parser().parse_args(["serve", "--port", "9400"])
    config = serve_config(args, environ)
    engine = config.engine.engine
    assert engine.cache.block_size == 8  # the file
    assert engine.scheduler.max_num_seqs == 6 and not engine.cache.enable_prefix_caching  # env
    assert engine.cache.kv_cache_memory_bytes == 1 << 30
    assert config.server.port == 9400  # the flag over the environment
    assert config.server.served_model_name == ("a", "b")
    assert engine.parallel.engine_threads is None  # --threads is an alias: the name is the flag's
    assert serve_config(args, {"TREADLE_ENGINE_THREADS": "3"}).engine.engine.parallel\
        .engine_threads == 3
    for variable, value in (("TREADLE_BLOCK_SIZE", "big"), ("TREADLE_POLICY", "lifo"),
                            ("TREADLE_LOG_PROMPTS", "maybe")):
        with pytest.raises(ValueError, match=variable):
            serve_config(args, {variable: value})


def test_help_shows_defaults_and_the_environment():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"]
                         .format_help().split())
    assert "--max-logprobs MAX_LOGPROBS most logprobs" in help_text
    assert "(default: 20)" in help_text and "(default: auto)" in help_text
    assert "TREADLE_<FLAG>" in help_text and "a flag over the environment" in help_text
    assert "--no-grpc" not in help_text


def test_grpc_is_opt_in_and_the_new_settings_are_checked():
    assert ServeConfig().server.grpc_port is None
    assert from_flags("--grpc-port", "0").server.grpc_port == 0
    config = from_flags("--served-model-name", "x", "y", "--max-logprobs", "5", "--seed", "3",
                        "--generation-config", "vllm", "--uvicorn-log-level", "warning",
                        "--disable-uvicorn-access-log", "--root-path", "/api",
                        "--sse-keepalive-interval", "2.5")
    assert config.server.served_model_name == ("x", "y")
    assert config.engine.engine.model == ModelConfig(generation_config="vllm", max_logprobs=5,
                                                     seed=3)
    assert (config.server.uvicorn_log_level, config.server.disable_uvicorn_access_log,
            config.server.root_path, config.server.sse_keepalive_interval) == (
        "warning", True, "/api", 2.5)
    for setting, value in (("ssl_keyfile", "k.pem"), ("sse_keepalive_interval", 0),
                           ("uvicorn_log_level", "loud"), ("max_logprobs", -1), ("seed", -1)):
        with pytest.raises(ValueError, match=setting):
            build_config(ServeConfig, {setting: value})
