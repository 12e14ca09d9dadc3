"""The batched sampler against references computed independently in numpy: top-k / top-p /
min-p masks, vLLM's penalties, logit bias, raw logprobs; seeded rows that do not depend on the
batch; and chi-square tests that draws follow the distribution they claim to."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_utils import build_tiny_model, make_runner

from treadle.core import sampler as sampler_module
from treadle.core.sampler import DRAW_BLOCK, Sampler, SamplingOptions
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.kernels import sampling_kernels

VOCAB = 64
sampler = Sampler()


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def reference_probs(logits: np.ndarray, o: SamplingOptions) -> np.ndarray:
    """The distribution of one random row, by the definitions: temperature, then min-p (keep
    p >= min_p * max p), then top-k (the k largest), then top-p (the fewest most likely tokens,
    after top-k, whose mass reaches top_p)."""
    x = logits.astype(np.float64) / o.temperature
    keep = np.ones(x.shape, dtype=bool)
    if o.min_p > 0:
        p = np_softmax(x)
        keep &= p >= o.min_p * p.max()
    if o.top_k > 0:
        keep &= x >= np.sort(x[keep])[::-1][min(o.top_k, keep.sum()) - 1]
    if o.top_p < 1:
        p = np_softmax(np.where(keep, x, -np.inf))
        order = np.argsort(-p, kind="stable")
        n_keep = int(np.searchsorted(np.cumsum(p[order]), o.top_p)) + 1
        in_top_p = np.zeros_like(keep)
        in_top_p[order[:n_keep]] = True
        keep &= in_top_p
    return np_softmax(np.where(keep, x, -np.inf))


def reference_penalties(logits: np.ndarray, prompt: list[int], output: list[int],
                        o: SamplingOptions) -> np.ndarray:
    """vLLM's definition (vllm/model_executor/layers/utils.py, apply_penalties), token by token."""
    x = logits.astype(np.float64).copy()
    counts = np.bincount(np.array(output, dtype=int), minlength=len(x))
    for token in set(prompt) | set(output):
        x[token] = x[token] / o.repetition_penalty if x[token] > 0 else \
            x[token] * o.repetition_penalty
    return x - o.frequency_penalty * counts - o.presence_penalty * (counts > 0)


FILTERS = [
    SamplingOptions(temperature=1.0),
    SamplingOptions(temperature=0.7),
    SamplingOptions(temperature=1.3, top_k=1),
    SamplingOptions(temperature=1.0, top_k=5),
    SamplingOptions(temperature=1.0, top_k=VOCAB + 10),
    SamplingOptions(temperature=1.0, top_p=0.5),
    SamplingOptions(temperature=0.8, top_p=0.9),
    SamplingOptions(temperature=1.0, top_p=1e-4),
    SamplingOptions(temperature=1.0, min_p=0.1),
    SamplingOptions(temperature=2.0, min_p=0.5),
    SamplingOptions(temperature=1.0, top_k=10, top_p=0.8),
    SamplingOptions(temperature=0.9, top_k=20, top_p=0.95, min_p=0.05),
    SamplingOptions(temperature=1.5, top_k=3, min_p=0.2),
]


def test_filters_match_numpy_reference_with_each_row_its_own_params():
    logits = random_logits(len(FILTERS))
    probs = Sampler.probabilities(logits, FILTERS).double().numpy()
    for row, o in enumerate(FILTERS):
        expected = reference_probs(logits[row].numpy(), o)
        assert np.array_equal(probs[row] > 0, expected > 0), (row, o)  # the same tokens kept
        np.testing.assert_allclose(probs[row], expected, atol=1e-6, err_msg=str(o))
        if o.top_k > 0:
            assert (expected > 0).sum() <= o.top_k


def test_a_row_with_filters_off_is_unchanged_by_its_neighbours():
    logits = random_logits(len(FILTERS))
    together = Sampler.probabilities(logits, FILTERS)
    for row, o in enumerate(FILTERS):
        alone = Sampler.probabilities(logits[row:row + 1], [o])
        assert torch.equal(together[row], alone[0]), o


def test_penalties_match_vllm_definition():
    gen = torch.Generator().manual_seed(1)
    rows = 6
    logits = random_logits(rows, seed=1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 1, 30, 7, 0)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (0, 4, 12, 8, 3, 6)]
    options = [
        SamplingOptions(repetition_penalty=1.3),
        SamplingOptions(temperature=1.0, frequency_penalty=0.7),
        SamplingOptions(presence_penalty=-1.5, repetition_penalty=0.8),
        SamplingOptions(temperature=0.5),  # no penalties: must be left as is
        SamplingOptions(presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=2.0),
        SamplingOptions(frequency_penalty=0.3, presence_penalty=0.4),
    ]
    out = Sampler.apply_bias_and_penalties(logits, options, prompts, outputs).double().numpy()
    for row, o in enumerate(options):
        expected = reference_penalties(logits[row].numpy(), prompts[row], outputs[row], o)
        np.testing.assert_allclose(out[row], expected, rtol=1e-6, atol=1e-5, err_msg=str(o))
    assert np.array_equal(out[3], logits[3].double().numpy())


def test_penalties_by_hand():
    # Prompt-only tokens get the repetition penalty but neither frequency nor presence.
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    o = SamplingOptions(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = Sampler.apply_bias_and_penalties(logits, [o], [[0, 1]], [[2, 2]])
    assert out.tolist() == [[1.0, -4.0, 1.0 / 2 - 2 * 0.5 - 0.25, 1.0]]


def test_penalties_need_histories():
    with pytest.raises(ValueError, match="penalties need"):
        sampler(random_logits(1), [SamplingOptions(presence_penalty=1.0)], [None])


def test_logit_bias_and_suppressed_tokens():
    logits = random_logits(3, seed=2)
    options = [SamplingOptions(logit_bias={3: 100.0, 7: -5.5}),
               SamplingOptions(suppressed_token_ids=[int(logits[1].argmax())]),
               SamplingOptions(logit_bias={0: 1.0}, suppressed_token_ids=[1, 2])]
    out = Sampler.apply_bias_and_penalties(logits, options, None, None)
    expected = logits.clone()
    expected[0, 3] += 100
    expected[0, 7] -= 5.5
    expected[1, int(logits[1].argmax())] = -math.inf
    expected[2, 0] += 1
    expected[2, [1, 2]] = -math.inf
    assert torch.equal(out, expected)
    assert logits.isfinite().all()  # the caller's tensor is untouched
    tokens = sampler(logits, options, [None] * 3).token_ids
    assert tokens[0] == 3  # greedy follows the bias
    assert tokens[1] == int(expected[1].argmax()) != int(logits[1].argmax())
    # Random rows never draw a suppressed token.
    many = sampler(logits[2:].expand(2000, -1),
                   [SamplingOptions(temperature=1.0, suppressed_token_ids=[1, 2])] * 2000,
                   [None] * 2000).token_ids
    assert not {1, 2} & set(many)


def test_greedy_takes_the_argmax_and_leaves_its_generator_alone():
    logits = random_logits(4, seed=3)
    options = [SamplingOptions(), SamplingOptions(top_k=3, top_p=0.1, min_p=0.9),
               SamplingOptions(repetition_penalty=100.0), SamplingOptions()]
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    out = sampler(logits, options, [None, gen, None, None], [[], [], [int(logits[2].argmax())],
                                                             []], [[], [], [], []])
    assert out.token_ids[:2] == logits[:2].argmax(dim=-1).tolist()
    assert out.token_ids[2] != int(logits[2].argmax())  # the penalty steers greedy too
    assert torch.equal(gen.get_state(), state)
    assert out.logprobs is None


def test_logprobs_are_raw_log_softmax_with_top_n_and_rank():
    logits = random_logits(5, seed=4)
    options = [SamplingOptions(num_logprobs=5),
               SamplingOptions(temperature=0.5, top_k=3, num_logprobs=20),
               SamplingOptions(temperature=1.0),  # asks for none
               SamplingOptions(logit_bias={9: 50.0}, repetition_penalty=1.5, num_logprobs=0),
               SamplingOptions(temperature=2.0, frequency_penalty=1.0, num_logprobs=3)]
    out = sampler(logits, options, [None] * 5, [[1, 2]] * 5, [[9, 9, 4]] * 5)
    assert out.logprobs is not None and out.logprobs[2] is None
    raw = torch.log_softmax(logits.double(), dim=-1).numpy()
    for row, o in enumerate(options):
        lp = out.logprobs[row]
        if o.num_logprobs is None:
            continue
        assert lp is not None
        token = out.token_ids[row]
        assert lp.token_id == token
        # From the raw logits: bias, penalties and temperature leave them unchanged.
        assert lp.logprob == pytest.approx(raw[row, token], abs=1e-5)
        assert lp.rank == 1 + int((np.delete(raw[row], token) >= raw[row, token]).sum())
        order = np.argsort(-raw[row], kind="stable")[:o.num_logprobs]
        assert lp.top_token_ids == order.tolist()
        np.testing.assert_allclose(lp.top_logprobs, raw[row, order], atol=1e-5)
    assert out.logprobs[3].token_id == 9 and out.logprobs[3].top_token_ids == []


def test_seeded_rows_do_not_depend_on_the_batch():
    """A seeded request gives the same tokens alone and in a batch of 32 of mixed parameters,
    over several steps, wherever it sits in the batch."""
    target = SamplingOptions(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
                             repetition_penalty=1.2, frequency_penalty=0.3, num_logprobs=2)
    others = [SamplingOptions(), SamplingOptions(temperature=1.0),
              SamplingOptions(temperature=0.5, top_p=0.3),
              SamplingOptions(temperature=1.2, top_k=2, presence_penalty=1.0),
              SamplingOptions(temperature=1.0, min_p=0.3, logit_bias={5: 3.0}),
              SamplingOptions(temperature=0.7, suppressed_token_ids=[0, 1], num_logprobs=4)]
    steps = 8
    step_logits = [random_logits(1, seed=100 + s) for s in range(steps)]
    prompt = [3, 4, 5, 3]

    def run(batch: int, position: int, seed: int = 1234) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        other_gens = [torch.Generator().manual_seed(i) if i % 3 == 0 else None
                      for i in range(batch)]
        output: list[int] = []
        for s in range(steps):
            logits = random_logits(batch, seed=200 + s)
            logits[position] = step_logits[s][0]
            options = [others[i % len(others)] for i in range(batch)]
            options[position] = target
            gens = list(other_gens)
            gens[position] = gen
            tokens = sampler(logits, options, gens, [prompt] * batch,
                             [output] * batch).token_ids
            output = output + [tokens[position]]
        return output

    alone = run(1, 0)
    assert run(32, 0) == alone
    assert run(32, 17) == alone
    assert run(32, 31) == alone
    assert run(1, 0, seed=4321) != alone  # the seed does matter


def test_empty_batch_and_shape_checks():
    assert sampler(torch.empty(0, VOCAB), [], []).token_ids == []
    with pytest.raises(ValueError, match="rows of logits"):
        sampler(random_logits(2), [SamplingOptions()], [None, None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_logits_on_the_gpu_with_cpu_generators():
    logits = random_logits(4, seed=9)
    options = [SamplingOptions(logit_bias={2: 5.0}, num_logprobs=3),
               SamplingOptions(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05,
                               repetition_penalty=1.3, num_logprobs=2),
               SamplingOptions(temperature=1.0),
               SamplingOptions(suppressed_token_ids=[int(logits[3].argmax())])]
    history = ([[1, 2]] * 4, [[3]] * 4)
    cpu = sampler(logits, options, [None, torch.Generator().manual_seed(3), None, None], *history)
    gpu = sampler(logits.cuda(), options, [None, torch.Generator().manual_seed(3), None, None],
                  *history)
    assert [gpu.token_ids[i] for i in (0, 1, 3)] == [cpu.token_ids[i] for i in (0, 1, 3)]
    for row in (0, 1):
        assert gpu.logprobs[row].top_token_ids == cpu.logprobs[row].top_token_ids
        assert gpu.logprobs[row].logprob == pytest.approx(cpu.logprobs[row].logprob, abs=1e-5)


# --- Chi-square goodness of fit ------------------------------------------------------------

def chi_square_critical(df: int, z: float = 3.090232) -> float:
    """The upper 0.1% point of chi-square with `df` degrees of freedom, by the Wilson-Hilferty
    approximation (Abramowitz & Stegun 26.4.17): df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3, with
    z = 3.090232 the 0.999 quantile of the standard normal. Within 0.6% of the exact value for
    df >= 10 (149.50 against scipy.stats.chi2.ppf(0.999, 100) = 149.45)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi_square(tokens: list[int], probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of the draws against `probs`, pooling the categories expected fewer
    than 5 times into one (the usual validity rule); returns (statistic, degrees of freedom)."""
    n = len(tokens)
    observed = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    expected = probs * n
    assert observed[expected == 0].sum() == 0, "drew a token of probability 0"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # too small a pooled bin: fold it into the smallest big one
        smallest = int(np.argmin(exp[:-1]))
        obs[smallest] += obs[-1]
        exp[smallest] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


@pytest.fixture(scope="module")
def tiny_model_logits(tmp_path_factory) -> torch.Tensor:
    """Next-token logits [vocab] of a tiny random-weight Llama after a short prompt."""
    folder = tmp_path_factory.mktemp("tiny-llama-sampler")
    build_tiny_model("llama", folder)
    runner = make_runner(folder)
    logits = runner.execute(ModelInput([ScheduledSequence([1, 17, 99, 42, 7], 0, [0])]))
    return logits[0]


SAMPLES = 20_000


@pytest.fixture(params=["native", "torch"])
def unfiltered_path(request, monkeypatch) -> str:
    """Unfiltered rows sample in the native kernel where it is built, else in torch: test
    both."""
    if request.param == "native" and sampling_kernels() is None:
        pytest.skip("native kernels unavailable")
    if request.param == "torch":
        monkeypatch.setattr(sampler_module, "sampling_kernels", lambda: None)
    return request.param


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_one_follows_the_softmax(tiny_model_logits, seeded, unfiltered_path):
    probs = torch.softmax(tiny_model_logits.double(), dim=-1).numpy()
    batch = tiny_model_logits.expand(SAMPLES, -1)
    options = [SamplingOptions(temperature=1.0)] * SAMPLES
    if seeded:
        # One generator shared by every row: the rows draw one after another from one stream,
        # as the steps of one seeded request do.
        gen = torch.Generator().manual_seed(8)
        tokens = sampler(batch, options, [gen] * SAMPLES).token_ids
    else:
        with torch.random.fork_rng():
            torch.manual_seed(7)
            tokens = sampler(batch, options, [None] * SAMPLES).token_ids
    stat, df = chi_square(tokens, probs)
    assert df >= 10
    assert stat < chi_square_critical(df), (stat, df)
    # The test has power: the same draws are far from a slightly different distribution.
    wrong = torch.softmax(tiny_model_logits.double() / 0.9, dim=-1).numpy()
    wrong_stat, wrong_df = chi_square(tokens, wrong)
    assert wrong_stat > chi_square_critical(wrong_df)


def test_filtered_draws_follow_the_reference_distribution(tiny_model_logits):
    o = SamplingOptions(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01)
    probs = reference_probs(tiny_model_logits.numpy(), o)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        tokens = sampler(tiny_model_logits.expand(SAMPLES, -1), [o] * SAMPLES,
                         [None] * SAMPLES).token_ids
    stat, df = chi_square(tokens, probs)
    assert df >= 10
    assert stat < chi_square_critical(df), (stat, df)


@pytest.mark.parametrize("vocab", [DRAW_BLOCK, 3 * DRAW_BLOCK + 37])
def test_draws_cross_the_blocks_of_the_two_level_search(vocab, unfiltered_path):
    """Mass only on the first and last tokens of blocks, the vocabulary's first and last token
    and, for a vocabulary that is no whole number of blocks, inside the padded last block: the
    block and offset arithmetic must land on each, and never on a token of probability 0."""
    probs = np.zeros(vocab)
    support = sorted({0, vocab - 1} | {b * DRAW_BLOCK + e for b in range(vocab // DRAW_BLOCK)
                                       for e in (0, DRAW_BLOCK - 1)})
    probs[support] = np.arange(1, len(support) + 1, dtype=np.float64)
    probs /= probs.sum()
    batch = torch.tensor(probs, dtype=torch.float32).log().expand(SAMPLES, -1)
    gen = torch.Generator().manual_seed(5)
    tokens = sampler(batch, [SamplingOptions(temperature=1.0)] * SAMPLES,
                     [gen] * SAMPLES).token_ids
    stat, df = chi_square(tokens, probs)
    assert stat < chi_square_critical(df), (stat, df)


def test_native_and_torch_paths_draw_the_same_token_at_the_same_u():
    """Both invert the cumulative distribution of softmax(logits / t) at u: the same token
    but where u falls within rounding of a boundary (none does here), whatever the
    temperature, with forbidden (-inf) tokens never drawn, and at u near 0 and 1."""
    kernels = sampling_kernels()
    if kernels is None:
        pytest.skip("native kernels unavailable")
    rows, vocab = 300, 3 * DRAW_BLOCK + 37
    logits = random_logits(rows, vocab, seed=4)
    logits[::3, ::2] = float("-inf")
    temperatures = torch.tensor([(0.05, 0.7, 1.0, 2.5)[r % 4] for r in range(rows)])
    u = torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    u[:4], u[4:8] = 0.0, 1 - 2 ** -40
    options = [SamplingOptions(temperature=float(t)) for t in temperatures]
    native = kernels.sample_rows(logits, temperatures, u)
    reference = Sampler.draw(Sampler.probabilities(logits, options), u)
    assert torch.equal(native, reference)
    assert torch.isfinite(logits[torch.arange(rows), native]).all()
