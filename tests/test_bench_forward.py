"""`treadle bench forward`'s KV cache: its sequences' contexts hold data, not the untouched
zero pages a fresh cache reads as (attention over those reads one page from cache)."""

from __future__ import annotations

import pytest
import torch

from treadle.bench.forward import fill_kv_cache
from treadle.model.attention import KVCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_every_slot_of_every_layer_holds_data(dtype):
    cache = KVCache(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8,
                    dtype=dtype)
    fill_kv_cache(cache)
    tensors = cache.keys + cache.values
    for tensor in tensors:
        assert tensor.dtype == dtype
        assert (tensor != 0).any(-1).all()  # no slot's vector left zero
    assert not torch.equal(tensors[0], tensors[1])  # each layer its own values
    for scales in cache.key_scales + cache.value_scales:
        if dtype == torch.int8:
            assert torch.all(scales == 1 / 127)
        else:
            assert scales is None
