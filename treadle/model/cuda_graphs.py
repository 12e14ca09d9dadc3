"""Decode steps as CUDA graphs: a step of decode tokens only replays a graph captured at startup,
so a small batch costs one launch rather than hundreds of kernel launches from Python.

As vLLM does, graphs are captured for a few batch sizes (GRAPH_BATCH_SIZES up to
max_num_seqs), and a step pads its batch to the next one. The graph reads static buffers: token
ids, positions, cache slots, block tables as wide as max_model_len and context lengths. A step
fills their first rows with its sequences' and the rest with padding: token 0 at position 0,
writing and reading the cache's `pad_block`, which no sequence owns, so padding never touches a
sequence's keys and values. Rows do not interact in a decode step, so a sequence's logits do not
depend on the padding.

Steps with a prefill chunk, prompt logprobs, pooling rows, or more sequences than the largest
size run eagerly. Without `capture` (on the CPU, in tests) the same padded step runs eagerly
over the static buffers, which is what a replay computes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Protocol

import torch

from treadle.model.attention import AttentionMetadata, KVCache
from treadle.model.batch import ModelInput
from treadle.model.layers import DecoderModel

logger = logging.getLogger(__name__)


class GraphedRunner(Protocol):
    """What the graphs read of the runner (model/runner.py's ModelRunner)."""

    model: DecoderModel
    kv_cache: KVCache
    device: torch.device
    block_size: int
    max_model_len: int
    windows: list[int]


GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, GRAPH_BATCH_SIZES[-1])
    return [s for s in GRAPH_BATCH_SIZES if s < largest] + [largest]


def graph_output_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """The captured graphs' float32 logits, which stay allocated (one per size)."""
    return sum(graph_batch_sizes(max_num_seqs)) * vocab_size * 4


def capture_decode_graphs(runner: GraphedRunner, max_num_seqs: int) -> DecodeGraphs | None:
    """The runner's decode graphs, or None (every step eager) where capturing fails, out of
    memory say: serving slower beats not serving."""
    try:
        return DecodeGraphs(runner, max_num_seqs)
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        logger.warning("capturing decode steps as CUDA graphs failed, running them eagerly "
                       "(--enforce-eager skips the attempt): %s", e)
        torch.cuda.empty_cache()
        return None


class DecodeGraphs:
    def __init__(self, runner: GraphedRunner, max_num_seqs: int, capture: bool = True) -> None:
        self.runner = runner
        self.sizes = graph_batch_sizes(max_num_seqs)
        rows = self.sizes[-1]
        max_blocks = -(-runner.max_model_len // runner.block_size)
        pad_block = runner.kv_cache.pad_block
        device = runner.device
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), pad_block * runner.block_size, dtype=torch.long,
                                device=device)
        self.block_tables = torch.full((rows, max_blocks), pad_block, dtype=torch.long,
                                       device=device)
        self.context_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        if capture:
            self.capture()

    def serves(self, model_input: ModelInput) -> bool:
        """A step of decode tokens only, each wanting its last logits, no more than fit."""
        sequences = model_input.sequences
        return 0 < len(sequences) <= self.sizes[-1] and all(
            len(s.token_ids) == 1 and not s.all_logits and s.num_hidden_rows is None
            for s in sequences)

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def forward(self, size: int) -> torch.Tensor:
        """Logits [size, vocab] of the first `size` rows of the static buffers."""
        runner, model = self.runner, self.runner.model
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], decode_indices=None,
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size], prefills=[],
            max_context_len=runner.max_model_len)
        attention = {None: meta} | {w: replace(meta, window=w) for w in runner.windows}
        hidden = model.hidden_states(self.input_ids[:size], self.positions[:size], attention,
                                     runner.kv_cache)
        return model.logits(model.final_hidden(hidden))

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, sharing one memory pool; each size runs once
        eagerly before its capture (Triton compiles its kernel, cuBLAS picks its algorithms)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured decode steps as CUDA graphs for batch sizes %s in %.1f s",
                    self.sizes, self.capture_seconds)

    def run(self, model_input: ModelInput) -> torch.Tensor:
        """Float32 logits [sequences, vocab] of a step `serves` accepts."""
        sequences = model_input.sequences
        num_seqs, bs = len(sequences), self.runner.block_size
        size = self.padded_size(num_seqs)
        pad_block = self.runner.kv_cache.pad_block
        ids, positions, slots, lens = [], [], [], []
        # Only the columns this step's contexts reach: the kernel reads no further, and padding
        # rows read their first column alone.
        width = max(s.num_computed_tokens for s in sequences) // bs + 1
        tables = torch.full((size, width), pad_block, dtype=torch.long)
        for row, seq in enumerate(sequences):
            position = seq.num_computed_tokens
            ids.append(seq.token_ids[0])
            positions.append(position)
            slots.append(seq.block_table[position // bs] * bs + position % bs)
            lens.append(position + 1)
            used = seq.block_table[:position // bs + 1]
            tables[row, :len(used)] = torch.tensor(used, dtype=torch.long)
        padding = size - num_seqs
        for buffer, values, pad in ((self.input_ids, ids, 0), (self.positions, positions, 0),
                                    (self.slots, slots, pad_block * bs),
                                    (self.context_lens, lens, 1)):
            buffer[:size].copy_(torch.tensor(values + [pad] * padding, dtype=torch.long))
        self.block_tables[:size, :width].copy_(tables)
        graph = self.graphs.get(size)
        if graph is None:
            return self.forward(size)[:num_seqs]
        graph.replay()
        # A copy: the next replay overwrites the graph's output.
        return self.outputs[size][:num_seqs].clone()
