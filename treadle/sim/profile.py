"""The step-time model: a step's seconds as a linear function of what the step computes.

    step_s = const + b * prefill_tokens + c * decode_seqs + d * decode_context
             + e * prefill_attention + f * integer_rows + g * dense_weights
             + h * shared_context + i * lora_adapters + j * lora_rows

prefill_tokens: tokens of chunks longer than one token (the runner's prefill path);
decode_seqs: one-token chunks (its decode path); decode_context: the context lengths those read;
prefill_attention: sum over chunks of n * (start + n) / 1000 (the query x key products). With
quantized weights a step of at most `gemv_rows` rows runs the integer kernel, whose cost grows
with each row (integer_rows: the step's rows there, else 0), and a larger one the dense float
path, which reads the float copy of every weight once (dense_weights: 1 there, else 0): one
line through both regimes fits neither. shared_context: decode context in KV blocks that an
earlier decode of the same step reads too (a shared prefix), taken out of decode_context: a
block read again in one step comes from cache. lora_adapters: the distinct LoRA adapters whose
rows the step runs (each read and multiplied on its own); lora_rows: the token rows that run
with an adapter (base rows pay nothing). Fitted
by least squares (numpy) to measured steps (`treadle bench steps`), saved as a small JSON profile
that names the machine and model it came from. `fit_profile` reports the relative error on
held-out steps. The LoRA terms are fitted apart, to the difference adapters make to the same
steps (`bench steps`); a profile saved before them has them at 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np

FEATURES = ("const", "prefill_tokens", "decode_seqs", "decode_context", "prefill_attention",
            "integer_rows", "dense_weights", "shared_context", "lora_adapters", "lora_rows")
LORA_FEATURES = ("lora_adapters", "lora_rows")
DEFAULT_PROFILE = Path(__file__).parent / "data" / "default_profile.json"


def shared_decode_context(decodes: Iterable[tuple[int, Sequence[int]]], block_size: int
                          ) -> int:
    """Tokens of decode context in full blocks that an earlier decode of the step reads too;
    `decodes`: (tokens already computed, block table) of each one-token chunk."""
    # All decodes' full blocks in one list: those counted twice are the shared ones (one list
    # and one set: a loop with a seen-set showed in `treadle sim`'s time).
    blocks = list(chain.from_iterable(block_ids[:num_computed // block_size]
                                      for num_computed, block_ids in decodes))
    return (len(blocks) - len(set(blocks))) * block_size


def step_features(chunks: Iterable[tuple[int, int]], gemv_rows: int | None = None,
                  shared_context: int = 0, lora_adapters: int = 0, lora_rows: int = 0
                  ) -> list[float]:
    """Features of one step from its chunks: (tokens already computed, new tokens) each;
    `gemv_rows`: the quantized layers' crossover (None: float weights, one regime);
    `shared_context`: what `shared_decode_context` counts; `lora_adapters`, `lora_rows`: the
    distinct adapters among the chunks and the rows (tokens) of chunks that have one."""
    prefill = decode = decode_context = attention = 0
    for start, n in chunks:
        if n == 1:
            decode += 1
            decode_context += start + 1
        else:
            prefill += n
            attention += n * (start + n)
    rows = prefill + decode
    integer = gemv_rows is not None and rows <= gemv_rows
    return [1.0, float(prefill), float(decode), float(decode_context - shared_context),
            attention / 1000.0, float(rows) if integer else 0.0,
            1.0 if gemv_rows is not None and not integer else 0.0, float(shared_context),
            float(lora_adapters), float(lora_rows)]


@dataclass
class StepProfile:
    coefficients: dict[str, float]  # seconds per unit of each feature
    model: str = "unknown"
    machine: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)  # how it was fitted and its error
    notes: str = ""
    gemv_rows: int | None = None  # the quantized layers' crossover it was measured with

    def predict(self, features: Sequence[float]) -> float:
        c = self.coefficients
        seconds = sum(c.get(name, 0.0) * x for name, x in zip(FEATURES, features, strict=True))
        return max(seconds, 1e-6)  # a step always takes some time: the clock must advance

    def predict_chunks(self, chunks: Iterable[tuple[int, int]], shared_context: int = 0,
                       lora_adapters: int = 0, lora_rows: int = 0) -> float:
        return self.predict(step_features(chunks, self.gemv_rows, shared_context,
                                          lora_adapters, lora_rows))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path | None = None) -> StepProfile:
        """A profile from a JSON file; None: the default model's, shipped with the package."""
        data = json.loads(Path(path or DEFAULT_PROFILE).read_text())
        unknown = set(data.get("coefficients", {})) - set(FEATURES)
        if unknown:
            raise ValueError(f"profile {path}: unknown features {sorted(unknown)}")
        coefficients = data.get("coefficients", {})
        if "decode_context" in coefficients and "shared_context" not in coefficients:
            # Fitted before shared_context was split out of decode_context: it counts shared
            # context as any decode context, as it did when fitted (the shipped default too).
            coefficients["shared_context"] = coefficients["decode_context"]
        for name in LORA_FEATURES:  # fitted before LoRA rows were measured: no cost known
            coefficients.setdefault(name, 0.0)
        return cls(**{k: data[k] for k in ("coefficients", "model", "machine", "fit", "notes",
                                           "gemv_rows") if k in data})

    @classmethod
    def constant(cls, seconds: float) -> StepProfile:
        """Every step takes `seconds` (tests; a deterministic clock)."""
        return cls({"const": seconds}, model="constant")


def fit_coefficients(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares of relative error: each step's row divided by its seconds, so a 20 ms
    decode step counts as much as a 2 s prefill (plain least squares fits the big steps and
    misses small ones by half). Coefficients stay >= 0 (a negative cost per token is noise,
    and would let large steps predict negative times): negative columns are dropped and the
    rest refitted, until none is negative."""
    return nonnegative_lstsq(features / seconds[:, None], np.ones_like(seconds))


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares x @ coef ~ y with coef >= 0: negative columns dropped and the rest
    refitted, until none is negative."""
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        sub, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (sub >= 0).all():
            break
        keep[np.flatnonzero(keep)[sub < 0]] = False
    coef = np.zeros(x.shape[1])
    coef[keep] = sub
    return coef


def fit_profile(train: Sequence[tuple[Sequence[float], float]],
                held_out: Sequence[tuple[Sequence[float], float]] = (), **meta) -> StepProfile:
    """A profile fitted to (features, seconds) pairs; its error on `held_out` (and on the
    training steps) in `fit`."""
    x = np.asarray([f for f, _ in train], dtype=float)
    y = np.asarray([s for _, s in train], dtype=float)
    coef = fit_coefficients(x, y)
    profile = StepProfile(dict(zip(FEATURES, map(float, coef), strict=True)), **meta)
    profile.fit = {"method": "least squares of relative error on measured steps; negative "
                             "coefficients dropped and the rest refitted",
                   "train_steps": len(train),
                   "train_error": prediction_error(profile, train)}
    if held_out:
        profile.fit["held_out_steps"] = len(held_out)
        profile.fit["held_out_error"] = prediction_error(profile, held_out)
    return profile


def prediction_error(profile: StepProfile, steps: Sequence[tuple[Sequence[float], float]]
                     ) -> dict[str, float]:
    """Relative errors |predicted - measured| / measured over `steps`: mean, median, max."""
    rel = np.asarray([abs(profile.predict(f) - s) / s for f, s in steps])
    return {"mean_rel": float(rel.mean()), "median_rel": float(np.median(rel)),
            "max_rel": float(rel.max())}
