"""Native kernels, compiled on first use with torch's C++ extension builder and cached.

`paged_decode_attention` is None where the build fails (no compiler, say): attention then takes
its pure-torch path, which gives the same results, slower.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


def build_paged_decode_attention() -> Callable | None:
    if os.environ.get("TREADLE_NO_KERNELS"):
        return None
    from torch.utils.cpp_extension import load

    from treadle.model.loader import cache_dir

    build_dir = cache_dir() / "kernels"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        module = load(name="treadle_paged_attention", sources=[str(SOURCE)],
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                      extra_ldflags=["-fopenmp", "-lmvec"], build_directory=str(build_dir),
                      verbose=False)
    except Exception as e:  # a missing compiler must not stop serving
        logger.warning("native paged attention unavailable, using torch: %s", e)
        return None
    return module.paged_decode_attention


paged_decode_attention = build_paged_decode_attention()
