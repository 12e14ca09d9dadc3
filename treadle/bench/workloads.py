"""Benchmark workloads: lists of requests (prompt token ids, and the number of tokens to generate).

`synthetic_chat` draws (prompt length, output length) pairs from `data/sharegpt_lengths.json`, a
reconstruction of the lengths of ShareGPT conversations as vLLM's and SGLang's serving benchmarks
use them (ShareGPT_V3_unfiltered_cleaned_split, first human turn as the prompt, first reply as
the output; kept when prompt >= 4 and output >= 4 tokens, prompt <= 1024 and prompt + output <=
2048). It is rebuilt from published statistics, not from the data set: the bin counts are the
example Prometheus histograms of prompt and generated tokens (2104 requests) in SGLang's
docs/references/production_metrics.md (late-2024 version), cross-checked against the prompt
histogram in sgl-project/sglang PR #1853 and against the token totals vLLM's benchmark_serving
prints for 1000 ShareGPT prompts (means ~215 prompt and ~198 output tokens). Within a bin,
lengths follow a power law whose exponent makes the mean equal the published mean (238 prompt,
202 output tokens); prompt and output lengths are drawn independently (no joint statistics are
published). The JSON file's "source" and "method" fields say the same at length.

`random_workload` gives fixed (or uniformly spread) lengths. `shared_prefix` gives groups of
requests that share a long system prompt (what prefix caching is for). `file_workload` reads
prompts and output lengths from a JSONL file.

Prompts are random words from the tokenizer's vocabulary: tokens that are one lowercase word
after a space and encode back to themselves, so the prompt has exactly the drawn number of
tokens and its text re-encodes to the same ids with byte-level BPE tokenizers. The token ids are
the source of truth; `prompt` holds their decoded text for frontends that need text. Lengths
depend only on the seed (not on the tokenizer); token choices depend on the seed and the
tokenizer's vocabulary.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from treadle.tokenizer import Tokenizer

DATA_DIR = Path(__file__).parent / "data"
SHAREGPT_LENGTHS = DATA_DIR / "sharegpt_lengths.json"

MAX_REDRAWS = 100_000  # per request, when a length cap rejects draws
WORD = re.compile(r"[a-z]{2,12}")
MIN_WORD_POOL = 256  # fewer word tokens than this: fall back to every ordinary token


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate (sampled with ignore_eos, so exactly this many)
    prompt: str | None = None  # the ids' decoded text
    tenant: str | None = None  # whose request (a workload file's "tenant"); None: not given
    arrival: float | None = None  # send time, s from the start (a workload file's "arrival");
    # None: drawn from the request rate

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LengthBin:
    lo: int
    hi: int  # inclusive
    count: int


@dataclass(frozen=True)
class LengthMarginal:
    """Lengths in bins; within a bin, density proportional to x ** -exponent on [lo, hi + 1),
    floored to an integer."""

    bins: tuple[LengthBin, ...]
    exponent: float
    published_mean: float

    def _cdf(self, b: LengthBin, x: float) -> float:
        top = b.hi + 1
        if abs(self.exponent - 1.0) < 1e-9:
            return math.log(x / b.lo) / math.log(top / b.lo)
        e = 1.0 - self.exponent
        return (x ** e - b.lo ** e) / (top ** e - b.lo ** e)

    def _inverse_cdf(self, b: LengthBin, u: float) -> float:
        top = b.hi + 1
        if abs(self.exponent - 1.0) < 1e-9:
            return b.lo * (top / b.lo) ** u
        e = 1.0 - self.exponent
        return (b.lo ** e + u * (top ** e - b.lo ** e)) ** (1.0 / e)

    def sample(self, rng: random.Random) -> int:
        b = rng.choices(self.bins, weights=[b.count for b in self.bins])[0]
        return min(b.hi, max(b.lo, math.floor(self._inverse_cdf(b, rng.random()))))

    def mean(self) -> float:
        """The exact mean of `sample`."""
        total = sum(b.count for b in self.bins)
        return sum(b.count * sum(k * (self._cdf(b, k + 1) - self._cdf(b, k))
                                 for k in range(b.lo, b.hi + 1))
                   for b in self.bins) / total

    @property
    def min_len(self) -> int:
        return self.bins[0].lo

    @property
    def max_len(self) -> int:
        return self.bins[-1].hi


@dataclass(frozen=True)
class LengthHistogram:
    prompt: LengthMarginal
    output: LengthMarginal
    max_total_len: int  # the data set's own filter: drawn pairs above it are redrawn
    source: str
    method: str

    def sample(self, rng: random.Random) -> tuple[int, int]:
        while True:
            prompt_len, output_len = self.prompt.sample(rng), self.output.sample(rng)
            if prompt_len + output_len <= self.max_total_len:
                return prompt_len, output_len


def _marginal(d: dict) -> LengthMarginal:
    return LengthMarginal(bins=tuple(LengthBin(b["lo"], b["hi"], b["count"]) for b in d["bins"]),
                          exponent=float(d["within_bin_exponent"]),
                          published_mean=float(d["published_mean"]))


@lru_cache(maxsize=1)
def sharegpt_lengths() -> LengthHistogram:
    data = json.loads(SHAREGPT_LENGTHS.read_text())
    return LengthHistogram(prompt=_marginal(data["prompt"]), output=_marginal(data["output"]),
                           max_total_len=data["filter"]["max_total_len"],
                           source=data["source"], method=data["method"])


def vocabulary_words(tokenizer: Tokenizer) -> list[int]:
    """Ids of tokens that are one lowercase word (after a space) and encode back to themselves;
    every ordinary (non-special) id when the vocabulary has too few such words."""
    special = set(tokenizer.all_special_ids)
    candidates = [(i, tok[1:]) for tok, i in tokenizer.get_vocab().items()
                  if i not in special and tok[:1] in ("Ġ", "▁") and WORD.fullmatch(tok[1:])]
    if len(candidates) >= MIN_WORD_POOL:
        words = [w for _, w in candidates]
        spaced = tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"]
        bare = tokenizer(words, add_special_tokens=False)["input_ids"]
        pool = sorted(i for (i, _), s, b in zip(candidates, spaced, bare, strict=True)
                      if s == [i] or b == [i])
        if len(pool) >= MIN_WORD_POOL:
            return pool
    return [i for i in range(len(tokenizer)) if i not in special]


def _check_cap(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _build(tokenizer: Tokenizer, lengths: list[tuple[int, int]], seed: int, with_text: bool
           ) -> list[BenchRequest]:
    pool = vocabulary_words(tokenizer)
    rng = random.Random(f"treadle-prompt-tokens-{seed}")
    requests = []
    for prompt_len, output_len in lengths:
        ids = rng.choices(pool, k=prompt_len)
        text = tokenizer.decode(ids) if with_text else None
        requests.append(BenchRequest(ids, output_len, text))
    return requests


def synthetic_chat(tokenizer: Tokenizer, num_prompts: int, seed: int = 0,
                   max_model_len: int | None = None, max_input_len: int | None = None,
                   max_output_len: int | None = None, with_text: bool = True
                   ) -> list[BenchRequest]:
    """`num_prompts` requests with ShareGPT-like prompt and output lengths.

    `max_input_len` and `max_output_len` clip the drawn lengths (so the shape of the other
    length is kept); a pair whose clipped total exceeds `max_model_len` is redrawn, as vLLM's
    filter drops it."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    for name, value in (("max_model_len", max_model_len), ("max_input_len", max_input_len),
                        ("max_output_len", max_output_len)):
        _check_cap(name, value)
    hist = sharegpt_lengths()
    in_cap = max_input_len or hist.prompt.max_len
    out_cap = max_output_len or hist.output.max_len
    if max_model_len is not None and \
            min(hist.prompt.min_len, in_cap) + min(hist.output.min_len, out_cap) > max_model_len:
        raise ValueError(f"max_model_len={max_model_len} is below the shortest request")
    rng = random.Random(seed)
    lengths = []
    for _ in range(num_prompts):
        for _ in range(MAX_REDRAWS):
            prompt_len, output_len = hist.sample(rng)
            prompt_len, output_len = min(prompt_len, in_cap), min(output_len, out_cap)
            if max_model_len is None or prompt_len + output_len <= max_model_len:
                break
        else:
            raise ValueError(f"max_model_len={max_model_len} rejects nearly every request; "
                             "lower max_input_len / max_output_len")
        lengths.append((prompt_len, output_len))
    return _build(tokenizer, lengths, seed, with_text)


def random_workload(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int,
                    seed: int = 0, range_ratio: float = 0.0, with_text: bool = True
                    ) -> list[BenchRequest]:
    """`num_prompts` requests of `input_len` prompt and `output_len` output tokens; with
    `range_ratio` r > 0, each length is uniform in [len * (1 - r), len * (1 + r)]."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return max(1, rng.randint(round(n * (1 - range_ratio)), round(n * (1 + range_ratio))))

    lengths = [(draw(input_len), draw(output_len)) for _ in range(num_prompts)]
    return _build(tokenizer, lengths, seed, with_text)


def shared_prefix(tokenizer: Tokenizer, num_prompts: int, prefix_len: int, question_len: int,
                  output_len: int, group_size: int, seed: int = 0, with_text: bool = True
                  ) -> list[BenchRequest]:
    """`num_prompts` requests in groups of `group_size`: each group's requests start with the
    same `prefix_len`-token system prompt and end with their own `question_len` tokens. The
    requests are shuffled, so a group's members arrive spread over the run, not back to back."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    for name, value in (("prefix_len", prefix_len), ("question_len", question_len),
                        ("output_len", output_len), ("group_size", group_size)):
        _check_cap(name, value)
    pool = vocabulary_words(tokenizer)
    rng = random.Random(f"treadle-shared-prefix-{seed}")
    prefixes = [rng.choices(pool, k=prefix_len) for _ in range(-(-num_prompts // group_size))]
    ids = [prefixes[i // group_size] + rng.choices(pool, k=question_len)
           for i in range(num_prompts)]
    rng.shuffle(ids)
    return [BenchRequest(p, output_len, tokenizer.decode(p) if with_text else None) for p in ids]


def file_workload(tokenizer: Tokenizer, path: str | Path, with_text: bool = True
                  ) -> list[BenchRequest]:
    """Requests from a JSONL file of {"prompt": text or token ids, "output_len": int} rows,
    each optionally with "tenant": a name (the field `treadle sim` traces use), whose requests
    bench serve sends as that tenant, and "arrival": when to send it, in seconds from the
    start (as in a trace; every row or none), instead of the request rate's draw: the same
    requests at the same times with and without another tenant's. A text prompt is tokenized
    without special tokens (the server adds its own) and kept as given for frontends that take
    text."""
    requests = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, output_len = row["prompt"], row["output_len"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line_no}: expected a JSON object with prompt and "
                             f"output_len ({e})") from None
        if not isinstance(output_len, int) or output_len < 1:
            raise ValueError(f"{path}:{line_no}: output_len must be an integer >= 1")
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
            ids, text = prompt, tokenizer.decode(prompt) if with_text else None
        else:
            raise ValueError(f"{path}:{line_no}: prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError(f"{path}:{line_no}: empty prompt")
        tenant = row.get("tenant")
        if tenant is not None and not (isinstance(tenant, str) and tenant):
            raise ValueError(f"{path}:{line_no}: tenant must be a non-empty string")
        arrival = row.get("arrival")
        if arrival is not None and (isinstance(arrival, bool) or not isinstance(
                arrival, int | float) or not 0 <= arrival < math.inf):
            raise ValueError(f"{path}:{line_no}: arrival must be a number of seconds >= 0")
        if requests and (arrival is None) != (requests[-1].arrival is None):
            raise ValueError(f"{path}:{line_no}: give every row an arrival, or none")
        requests.append(BenchRequest(ids, output_len, text, tenant,
                                     None if arrival is None else float(arrival)))
    return requests


def summarize(requests: list[BenchRequest]) -> dict:
    n = len(requests)
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {"num_prompts": n, "total_prompt_tokens": prompt_tokens,
            "total_output_tokens": output_tokens,
            "mean_prompt_len": prompt_tokens / n if n else 0.0,
            "mean_output_len": output_tokens / n if n else 0.0,
            "longest_prompt_len": max((r.prompt_len for r in requests), default=0),
            "longest_output_len": max((r.output_len for r in requests), default=0)}


def draw_adapters(names: list[str], count: int, seed: int) -> list[str]:
    """Each of `count` requests' adapter, drawn from `names` by `seed` (`treadle sim` draws
    the same, so a simulated run and a served one give each request the same adapter)."""
    draw = random.Random(seed)
    return [draw.choice(names) for _ in range(count)]
