"""Tensor parallelism: the model split across `tensor_parallel_size` ranks over torch.distributed
(treadle/model/parallel.py says how), rank 0 in the engine's own process, the others in worker
processes this executor starts.

Each step rank 0 pickles the step's `ModelInput` once and writes it down every worker's stdin
pipe, then all ranks run the same pass, meeting in its all-reduces (gloo); the logits are gathered
on rank 0. Why pipes rather than a collective broadcast: a worker waits for the next step
without a gloo timeout however long the engine idles, and when the engine process dies (even
killed) its end of the pipe closes and the worker reads EOF and exits: no process outlives the
engine.

Workers are started with `subprocess` (a fresh interpreter, as multiprocessing's spawn does): the
engine process is a daemonic multiprocessing child, which multiprocessing forbids to have
children of its own.

The backend is gloo: the model computes on CPU tensors, which NCCL does not take (it would be
the choice for a runner on CUDA devices).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import weakref
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from treadle.config import EngineConfig
from treadle.core.executor.base import Executor, ModelFacts, verify_rows
from treadle.model.attention import KVCache
from treadle.model.batch import ModelInput, ModelOutput
from treadle.model.capabilities import torch_dtype
from treadle.model.family import ModelSpec
from treadle.model.loader import load_model, read_spec
from treadle.model.memory import check_weights_fit
from treadle.model.parallel import (
    TensorShard,
    check_tensor_parallel,
    parallelize,
    plan_shard,
    shard_weight,
)
from treadle.model.runner import ModelRunner
from treadle.model.source import resolve_model

logger = logging.getLogger(__name__)

BACKEND = "gloo"
# How long a rank waits in a collective (or for the others to join) before failing: long enough
# for a step of a large prefill on a slow CPU, short enough that a wedged rank ends the wait.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
WORKER_EXIT_SECONDS = 10.0


class TensorParallelExecutor(Executor):
    """Rank 0 of `tensor_parallel_size` in this process; ranks 1.. in worker processes."""

    def __init__(self, config: EngineConfig) -> None:
        world_size = config.parallel.tensor_parallel_size
        spec = read_spec(resolve_model(config.model.model).folder)
        check_tensor_parallel(spec, world_size)
        check_weights_fit(config.model)  # all ranks share this machine's memory
        threads = max(1, (config.parallel.engine_threads or torch.get_num_threads())
                      // world_size)
        self.world_size, self.threads = world_size, threads
        store_dir = tempfile.mkdtemp(prefix="treadle-tp-")
        init_method = f"file://{store_dir}/store"
        self.workers = [start_worker(rank, world_size, init_method, config, threads)
                        for rank in range(1, world_size)]
        # Stops the workers when this executor is closed, collected, or the interpreter exits.
        self.stop = weakref.finalize(self, stop_ranks, self.workers, store_dir)
        try:
            self.runner = start_rank(0, world_size, init_method, config, threads)
        except BaseException:
            self.stop()
            raise
        self.facts = ModelFacts(spec, self.runner.max_model_len, self.runner.num_blocks,
                                spec.vocab_size, frozenset(spec.eos_token_ids),
                                self.runner.kv_size, self.runner.model.resident_bytes(),
                                spec.num_parameters(), spec.active_parameters())

    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        message = pickle.dumps(model_input, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, worker in enumerate(self.workers, start=1):
            if worker.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with status "
                                   f"{worker.returncode}")
            worker.stdin.write(message)
            worker.stdin.flush()
        return self.runner.run(model_input)

    def close(self) -> None:
        self.stop()

    def platform_info(self) -> dict[str, Any]:
        return {**self.runner.platform_info(),
                "tensor_parallel": f"{self.world_size} ranks ({BACKEND}), "
                                   f"{self.threads} threads each"}


def start_worker(rank: int, world_size: int, init_method: str, config: EngineConfig,
                 threads: int) -> subprocess.Popen:
    worker = subprocess.Popen(
        [sys.executable, "-c", "from treadle.core.executor.tensor_parallel import worker_main; "
                               "worker_main()"], stdin=subprocess.PIPE)
    pickle.dump((rank, world_size, init_method, config, threads), worker.stdin)
    worker.stdin.flush()
    return worker


def stop_ranks(workers: list[subprocess.Popen], store_dir: str) -> None:
    """Tell each worker to exit (None), wait, kill any that does not; leave the process group."""
    for worker in workers:
        try:
            pickle.dump(None, worker.stdin)
            worker.stdin.close()
        except OSError:  # it is gone already
            pass
    for worker in workers:
        try:
            worker.wait(WORKER_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    if dist.is_initialized():
        dist.destroy_process_group()
    shutil.rmtree(store_dir, ignore_errors=True)


def start_rank(rank: int, world_size: int, init_method: str, config: EngineConfig,
               threads: int) -> ModelRunner:
    """Join the process group, load this rank's shard, agree with the others on the KV cache's
    blocks; RuntimeError naming the first rank that failed to load."""
    torch.set_num_threads(threads)
    dist.init_process_group(BACKEND, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    spec = read_spec(resolve_model(config.model.model).folder)
    shard = plan_shard(spec, rank, world_size)
    error = None
    try:
        runner = load_shard(config, shard, spec)
    except Exception as e:  # every rank must reach the gather below, or the others hang
        error = f"tensor-parallel rank {rank}: {type(e).__name__}: {e}"
    errors: list[str | None] = [None] * world_size
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if failed:
        raise RuntimeError(failed[0])
    agree_on_kv_blocks(runner)
    parallelize(runner.model, shard)
    return runner


def load_shard(config: EngineConfig, shard: TensorShard, spec: ModelSpec) -> ModelRunner:
    """A `ModelRunner` over `shard`'s slice of every weight of the model of `spec`, with the KV
    cache of its own KV heads."""
    model = config.model
    loaded = load_model(model.model, torch_dtype(model.dtype), model.quantization,
                        select=lambda name, w: shard_weight(name, w, shard, spec.head_dim),
                        load_format=model.load_format)
    loaded = replace(loaded, spec=shard.local_spec(loaded.spec))
    return ModelRunner(loaded, model, config.cache, config.scheduler, verify_rows(config))


def agree_on_kv_blocks(runner: ModelRunner) -> None:
    """Every rank sizes its cache from the memory it sees free; the scheduler hands out one set
    of block ids, so all take the smallest count (a cache lazily zeroed: rebuilt for free)."""
    blocks = torch.tensor([runner.num_blocks])
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
    num_blocks = int(blocks)
    if num_blocks < runner.num_blocks:
        spec = runner.spec
        runner.kv_cache = KVCache(spec.num_layers, num_blocks, runner.block_size,
                                  spec.num_kv_heads, spec.head_dim, runner.kv_storage_dtype())
        runner.kv_size = replace(runner.kv_size, num_blocks=num_blocks)


def worker_main() -> None:
    """A worker's life: its rank's setup from stdin, then one `ModelInput` per step until None
    (the executor closes) or EOF (the engine process died)."""
    stdin = sys.stdin.buffer
    rank, world_size, init_method, config, threads = pickle.load(stdin)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s "
                                                   f"treadle-tp-rank{rank} %(name)s: %(message)s")
    try:
        runner = start_rank(rank, world_size, init_method, config, threads)
    except Exception:
        logger.exception("rank %d failed to start", rank)
        os._exit(1)
    logger.info("rank %d of %d ready: %s", rank, world_size, runner.platform_info())
    while True:
        try:
            model_input = pickle.load(stdin)
        except EOFError:
            break
        if model_input is None:
            break
        try:
            runner.run(model_input)
        except ValueError:
            pass  # a batch the runner rejects before any collective: rank 0 rejects it alike
        except Exception:
            # Mid-pass: rank 0 is waiting in a collective; exiting closes this rank's
            # connections, which ends that wait with an error instead of a timeout.
            logger.exception("rank %d failed in a step", rank)
            os._exit(1)
    dist.destroy_process_group()
    os._exit(0)  # skip torch's interpreter teardown (seconds)
