"""Sampler tests on constructed logits: greedy, seeding, filters, penalties, logprobs."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from twostep.sample import sampler as sampler_mod
from twostep.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    apply_penalties,
    is_greedy,
    make_generator,
    prompt_logprobs,
)
from twostep.sampling_params import SamplingParams


def row(prompt=(), output=(), seed=None, **params) -> SamplingRow:
    p = SamplingParams(seed=seed, **params)
    return SamplingRow(p, list(prompt), list(output), make_generator(seed))


def log_probs(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def sample_many(logits_row: torch.Tensor, n: int, seed: int = 0, seeded_rows: bool = False, **params) -> list[int]:
    """n draws of one distribution in one batch: rows with their own seeds, or
    unseeded rows sharing a seeded sampler generator."""
    rows = [row(seed=(seed + i) if seeded_rows else None, **params) for i in range(n)]
    sampler = Sampler(torch.Generator().manual_seed(seed))
    return sampler(logits_row.expand(n, -1), rows).token_ids


def chi_square(tokens: list[int], expected: dict[int, float]) -> float:
    counts = Counter(tokens)
    assert set(counts) <= set(expected), f"sampled outside the support: {set(counts) - set(expected)}"
    n = len(tokens)
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in expected.items())


# Critical values of chi-square at p = 0.001 (draws are seeded, so this only guards the maths).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 9: 27.88}


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(6)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_ties_go_to_lowest_id():
    logits = torch.zeros(3, 10)
    logits[0, [3, 7]] = 5.0
    logits[1, [9, 2, 4]] = 1.0
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(3)])
    assert out.token_ids == [3, 2, 0]


def test_greedy_rows_unaffected_by_sampled_rows_in_batch():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    rows = [row(temperature=0.0), row(temperature=1.0), row(temperature=0.0),
            row(temperature=0.7, seed=3), row(temperature=0.0)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_all_greedy_without_penalties_is_just_argmax(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the all-greedy path must not sort, draw noise or sample")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch.Tensor, "exponential_", forbidden)
    monkeypatch.setattr(Sampler, "_sample", forbidden)
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    rows = [row(temperature=0.0, logprobs=2) for _ in range(4)]
    assert apply_penalties(logits, rows) is logits
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert all(len(lp) == 2 for lp in out.logprobs)


def test_logits_are_cast_and_never_modified():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    before = logits.clone()
    rows = [row(temperature=0.0, repetition_penalty=1.3, presence_penalty=1.0, output=[1, 2], min_tokens=5,
                max_tokens=10, stop_token_ids=[0]),
            row(temperature=1.0, seed=5)]
    out = Sampler()(logits, rows)
    assert torch.equal(logits, before)
    assert all(isinstance(t, int) for t in out.token_ids)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(3, 10), [row(), row()])


# ---------------------------------------------------------------- seeding


def run_steps(target: dict, position: int, batch: int, steps: int = 20, other_seed: int = 99) -> list[int]:
    """Decode `steps` tokens for a seeded target row placed at `position` among
    `batch` rows; the other rows (random, seeded, greedy) change with other_seed."""
    vocab = 64
    target_row = row(prompt=[1, 2, 3], **target)
    others = [row(prompt=[4], temperature=1.0),                          # shared generator
              row(prompt=[5], temperature=0.8, seed=other_seed),          # its own seed
              row(prompt=[6], temperature=0.0),                           # greedy
              row(prompt=[7], temperature=1.3, top_k=5, seed=other_seed + 1)]
    rows = others[:batch - 1]
    rows.insert(position, target_row)
    sampler = Sampler(torch.Generator().manual_seed(other_seed))
    data = torch.Generator().manual_seed(other_seed + 7)
    tokens = []
    for step in range(steps):
        target_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))
        logits = torch.randn(len(rows), vocab, generator=data) * 3
        logits[position] = target_logits
        out = sampler(logits, rows)
        for r, t in zip(rows, out.token_ids):
            r.output_token_ids.append(t)
        tokens.append(out.token_ids[position])
    return tokens


def test_seeded_row_independent_of_batch_and_position():
    target = dict(seed=1234, temperature=0.9, top_p=0.95, frequency_penalty=0.5)
    alone = run_steps(target, position=0, batch=1)
    first = run_steps(target, position=0, batch=5, other_seed=7)
    last = run_steps(target, position=4, batch=5, other_seed=8)
    middle = run_steps(target, position=2, batch=3, other_seed=9)
    assert alone == first == last == middle
    assert len(set(alone)) > 5   # really sampling, not stuck on one token


def test_different_seeds_differ():
    a = run_steps(dict(seed=1, temperature=1.0), position=0, batch=1)
    b = run_steps(dict(seed=2, temperature=1.0), position=0, batch=1)
    assert a != b
    assert a == run_steps(dict(seed=1, temperature=1.0), position=1, batch=4)


# ---------------------------------------------------------------- filters


def test_top_k_only_samples_the_k_largest():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(5))
    top3 = set(logits.topk(3).indices.tolist())
    tokens = sample_many(logits, 2000, seed=0, seeded_rows=True, top_k=3)
    assert set(tokens) == top3
    probs = logits[list(top3)].softmax(-1).tolist()
    assert chi_square(tokens, dict(zip(top3, probs))) < CHI2_999[2]


@pytest.mark.parametrize("top_p", [1.0, 0.999])   # topk path and sort path
def test_top_k_keeps_ties_with_the_kth(top_p):
    logits = torch.tensor([5.0, 4.0, 1.0, 4.0, 4.0, 0.0])
    tokens = sample_many(logits, 2000, seed=21, top_k=2, top_p=top_p, temperature=3.0)
    assert set(tokens) == {0, 1, 3, 4}


def test_top_k_mixed_with_top_p_rows_in_one_batch():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(22))
    rows = [row(top_k=2), row(top_p=0.5, top_k=10), row()]
    sampler = Sampler(torch.Generator().manual_seed(23))
    seen = [set(), set(), set()]
    for _ in range(300):
        for s, t in zip(seen, sampler(logits * 0.3, rows).token_ids):
            s.add(t)
    assert seen[0] == set(logits[0].topk(2).indices.tolist())
    probs = (logits[1] * 0.3).softmax(-1)
    top10 = probs.topk(10)
    renorm = top10.values / top10.values.sum()
    keep = int((renorm.cumsum(-1) - renorm < 0.5 - 1e-6).sum())
    assert seen[1] == set(top10.indices[:keep].tolist())
    assert len(seen[2]) > 20


def test_top_k_larger_than_vocab_is_no_filter():
    logits = torch.zeros(4)
    tokens = sample_many(logits, 400, seed=1, top_k=100)
    assert set(tokens) == {0, 1, 2, 3}


@pytest.mark.parametrize("top_p, support", [(0.8, {0, 1}), (0.81, {0, 1, 2}), (0.5, {0}), (0.3, {0}),
                                            (0.96, {0, 1, 2, 3}), (1e-9, {0})])
def test_top_p_keeps_the_nucleus(top_p, support):
    probs = [0.5, 0.3, 0.15, 0.05]
    tokens = sample_many(log_probs(probs), 4000, seed=2, top_p=top_p)
    assert set(tokens) == support
    mass = sum(probs[t] for t in support)
    if len(support) > 1:
        expected = {t: probs[t] / mass for t in support}
        assert chi_square(tokens, expected) < CHI2_999[len(support) - 1]


@pytest.mark.parametrize("probs, top_p, support", [([0.39, 0.33, 0.17, 0.11], 0.72, {0, 1}),
                                                   ([0.24, 0.23, 0.22, 0.22, 0.09], 0.47, {0, 1}),
                                                   ([0.24, 0.23, 0.22, 0.22, 0.09], 0.24, {0})])
def test_top_p_exact_boundary_not_decided_by_rounding(probs, top_p, support):
    # In float32 these prefixes sum to just below top_p (e.g. 0.71999997 for 0.72).
    tokens = sample_many(log_probs(probs), 2000, seed=20, top_p=top_p)
    assert set(tokens) == support


def test_top_p_unsorted_vocab_and_per_row():
    # Same distribution with the ids shuffled; two rows with different top_p in one batch.
    probs = torch.tensor([0.05, 0.3, 0.5, 0.15])
    logits = probs.log().expand(2, -1)
    rows = [row(top_p=0.8), row(top_p=0.9)]
    seen = [set(), set()]
    sampler = Sampler(torch.Generator().manual_seed(3))
    for _ in range(300):
        for s, t in zip(seen, sampler(logits, rows).token_ids):
            s.add(t)
    assert seen == [{2, 1}, {2, 1, 3}]


@pytest.mark.parametrize("min_p, support", [(0.2, {0, 1, 2}), (0.6, {0, 1}), (0.9, {0}), (0.05, {0, 1, 2, 3, 4})])
def test_min_p(min_p, support):
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]   # thresholds: 0.08, 0.24, 0.36, 0.02
    tokens = sample_many(log_probs(probs), 4000, seed=4, min_p=min_p)
    assert set(tokens) == support
    mass = sum(probs[t] for t in support)
    if len(support) > 1:
        assert chi_square(tokens, {t: probs[t] / mass for t in support}) < CHI2_999[len(support) - 1]


def test_top_k_top_p_min_p_combined():
    probs = [0.04, 0.35, 0.06, 0.25, 0.2, 0.1]   # sorted: 1, 3, 4, 5, 2, 0
    logits = log_probs(probs)
    # top_k=4 keeps {1,3,4,5} (mass 0.9) -> renormalised 0.389, 0.278, 0.222, 0.111;
    # top_p=0.7: mass before id 4 is 0.667 < 0.7, before id 5 is 0.889 -> {1,3,4};
    # min_p=0.6 drops p < 0.6 * 0.35 = 0.21 -> {1,3}.
    tokens = sample_many(logits, 4000, seed=5, top_k=4, top_p=0.7, min_p=0.6)
    assert set(tokens) == {1, 3}
    assert chi_square(tokens, {1: 0.35 / 0.6, 3: 0.25 / 0.6}) < CHI2_999[1]
    tokens = sample_many(logits, 4000, seed=6, top_k=4, top_p=0.7)
    assert set(tokens) == {1, 3, 4}
    tokens = sample_many(logits, 4000, seed=7, top_k=2, top_p=0.99)
    assert set(tokens) == {1, 3}


def test_filters_apply_after_temperature():
    probs = [0.5, 0.3, 0.15, 0.05]
    # temperature 0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 (/0.365)
    # -> 0.685, 0.247, 0.062, 0.007; top_p=0.9 now keeps {0, 1} (0.932 before id 2).
    tokens = sample_many(log_probs(probs), 4000, seed=8, temperature=0.5, top_p=0.9)
    assert set(tokens) == {0, 1}
    assert chi_square(tokens, {0: 0.25 / 0.34, 1: 0.09 / 0.34}) < CHI2_999[1]


def test_frequencies_match_the_distribution():
    logits = torch.randn(10, generator=torch.Generator().manual_seed(9)) * 1.5
    for temperature in (1.0, 0.7):
        expected = (logits / temperature).softmax(-1).tolist()
        tokens = sample_many(logits, 20000, seed=10, temperature=temperature)
        assert chi_square(tokens, dict(enumerate(expected))) < CHI2_999[9]
    # Rows with their own generators follow the same distribution.
    tokens = sample_many(logits, 3000, seed=11, seeded_rows=True)
    assert chi_square(tokens, dict(enumerate(logits.softmax(-1).tolist()))) < CHI2_999[9]


def test_masked_tokens_are_never_sampled():
    logits = torch.full((20,), float("-inf"))
    logits[[3, 11]] = torch.tensor([0.0, 1.0])
    tokens = sample_many(logits, 2000, seed=12)
    assert set(tokens) == {3, 11}


def test_zero_noise_cannot_pick_a_masked_token(monkeypatch):
    # exponential_ may return exactly 0; p / 0 must not let a p = 0 token win via NaN.
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    logits = torch.tensor([0.0, 2.0, 1.0, -5.0])
    tokens = sample_many(logits, 4, seed=0, top_k=2) + sample_many(logits, 4, seed=0, seeded_rows=True, top_k=2)
    assert set(tokens) <= {1, 2}


# ---------------------------------------------------------------- temperature


def test_tiny_temperature_behaves_like_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(13))
    top2 = logits.topk(2, dim=-1).values
    logits[:, 0] = top2[:, 0] - 0.05   # a near-tie with the argmax for every row
    params = dict(temperature=1e-3)
    assert not is_greedy(SamplingParams(**params))   # really goes through the sampling path
    rows = [row(seed=s, **params) for s in range(4)]
    sampler = Sampler(torch.Generator().manual_seed(0))
    for _ in range(50):
        assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()
    # Below GREEDY_TEMPERATURE the row is plain greedy.
    assert is_greedy(SamplingParams(temperature=1e-7))


def test_high_temperature_flattens():
    logits = torch.linspace(0, 6, 8)   # softmax: the top token has p = 0.576
    cold = Counter(sample_many(logits, 4000, seed=14, temperature=1.0))
    hot = Counter(sample_many(logits, 4000, seed=15, temperature=100.0))
    assert cold[7] / 4000 > 0.5 and cold[0] / 4000 < 0.01
    assert all(abs(hot[t] / 4000 - 1 / 8) < 0.03 for t in range(8))


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, -3.0, 4.0, 0.0, -0.5]])
    r = row(prompt=[1, 2, 2], output=[2, 5, 6, 40], repetition_penalty=2.0)  # 40 >= vocab: ignored
    out = apply_penalties(logits, [r])
    expected = logits.clone()
    expected[0, 1] = 1.0       # 2.0 / 2
    expected[0, 2] = -2.0      # -1.0 * 2, once although seen three times
    expected[0, 5] = 2.0       # 4.0 / 2
    expected[0, 6] = 0.0       # 0 stays 0
    assert torch.equal(out, expected)
    assert logits[0, 1] == 2.0   # input untouched


def test_presence_frequency_over_output_only():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, -3.0, 4.0, 0.0, -0.5]])
    r = row(prompt=[3, 3, 1], output=[4, 4, 6, 4], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [r])
    expected = logits.clone()
    expected[0, 4] -= 0.5 + 3 * 0.25
    expected[0, 6] -= 0.5 + 0.25
    assert torch.equal(out, expected)   # prompt tokens 1 and 3 untouched


def test_penalties_batched_and_ordered():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(16))
    rows = [
        row(prompt=[1, 2], output=[2, 5], repetition_penalty=1.5),
        row(prompt=[3], output=[7, 7, 9], presence_penalty=-1.0, frequency_penalty=2.0),
        row(prompt=[0, 15], output=[15, 15, 8], repetition_penalty=0.8, presence_penalty=0.3, frequency_penalty=0.1),
        row(prompt=[1, 2, 3], output=[4]),
    ]
    out = apply_penalties(logits, rows)
    expected = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        for t in set(r.prompt_token_ids + r.output_token_ids):   # repetition first
            v = expected[i, t].item()
            expected[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t, c in Counter(r.output_token_ids).items():        # then presence / frequency
            expected[i, t] -= p.presence_penalty + p.frequency_penalty * c
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[3], logits[3])


def test_no_penalty_returns_input_unchanged():
    logits = torch.randn(2, 8)
    rows = [row(output=[1, 2]), row(temperature=0.0, min_tokens=2, output=[1, 2], stop_token_ids=[3])]
    assert apply_penalties(logits, rows) is logits


def test_min_tokens_blocks_stop_ids():
    logits = torch.zeros(3, 10)
    eos = {2, 9}
    rows = [row(output=[1, 1], min_tokens=3, stop_token_ids=[4]),
            row(output=[1, 1, 1], min_tokens=3, stop_token_ids=[4]),
            row(output=[], min_tokens=1)]
    for r in rows:
        r.params.all_stop_token_ids = set(eos)
    out = apply_penalties(logits, rows)
    assert torch.isinf(out[0, [2, 4, 9]]).all() and (out[0, [2, 4, 9]] < 0).all()
    assert torch.isfinite(out[0, [0, 1, 3, 5, 6, 7, 8]]).all()
    assert torch.equal(out[1], logits[1])   # min_tokens reached
    assert torch.isinf(out[2, [2, 9]]).all() and torch.isfinite(out[2, [4]]).all()


def test_min_tokens_through_sampler():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 10.0   # EOS is by far the likeliest
    logits[0, 6] = 1.0
    r = row(temperature=0.0, min_tokens=2)
    r.params.all_stop_token_ids = {2}
    sampler = Sampler()
    assert sampler(logits, [r]).token_ids == [6]
    r.output_token_ids.append(6)
    assert sampler(logits, [r]).token_ids == [6]
    r.output_token_ids.append(6)
    assert sampler(logits, [r]).token_ids == [2]
    sampled = row(temperature=1.0, seed=0, min_tokens=1)
    sampled.params.all_stop_token_ids = {2}
    assert 2 not in sample_tokens(logits, sampled, 200)


def sample_tokens(logits: torch.Tensor, r: SamplingRow, steps: int) -> set[int]:
    sampler = Sampler()
    return {sampler(logits, [r]).token_ids[0] for _ in range(steps)}


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    r = row(temperature=0.0, output=[0], presence_penalty=0.2)
    assert Sampler()(logits, [r]).token_ids == [1]


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_logits():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(17))
    raw_lp = torch.log_softmax(logits, -1)
    argmax = logits.argmax(-1)
    rows = [
        # the penalty pushes the raw argmax down, so the sampled token has rank > 1
        row(temperature=0.0, output=[argmax[0].item()], presence_penalty=2.0, repetition_penalty=2.0, logprobs=1),
        row(temperature=0.8, seed=3, logprobs=5),
        row(temperature=1.0, seed=4),
        row(temperature=0.0, logprobs=0),
    ]
    out = Sampler()(logits, rows)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        tok = out.token_ids[i]
        entry = out.logprobs[i]
        n = rows[i].params.logprobs
        assert tok in entry
        assert entry[tok].logprob == pytest.approx(raw_lp[i, tok].item(), abs=1e-6)
        assert entry[tok].rank == 1 + int((raw_lp[i] > raw_lp[i, tok]).sum())
        assert entry[tok].decoded_token is None
        top = raw_lp[i].topk(n) if n else None
        expected_ids = {tok} | (set(top.indices.tolist()) if n else set())
        assert set(entry) == expected_ids
        if n:
            for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert entry[t].rank == rank
                assert entry[t].logprob == pytest.approx(v, abs=1e-6)
    assert out.token_ids[0] != argmax[0].item()
    assert out.logprobs[0][out.token_ids[0]].rank > 1
    assert len(out.logprobs[0]) == 2
    assert list(out.logprobs[3]) == [argmax[3].item()] and out.logprobs[3][argmax[3].item()].rank == 1


def test_logprob_ranks_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    out = Sampler()(logits, [row(temperature=0.0, logprobs=4)])
    entry = out.logprobs[0]
    assert out.token_ids == [1]
    assert {t: lp.rank for t, lp in entry.items()} == {1: 1, 2: 1, 3: 3, 0: 4}


def test_prompt_logprobs_constructed():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0],
                           [2.0, 2.0, 0.0, -1.0],
                           [0.0, 0.0, 0.0, 0.0]])
    targets = [0, 1, 3]
    out = prompt_logprobs(logits, targets, num_top=2)
    assert len(out) == 3

    def lp(r, t):
        return logits[r, t].item() - math.log(sum(math.exp(v) for v in logits[r].tolist()))

    assert set(out[0]) == {0, 3, 2}
    assert out[0][0].logprob == pytest.approx(lp(0, 0), abs=1e-6) and out[0][0].rank == 4
    assert (out[0][3].rank, out[0][2].rank) == (1, 2)
    assert out[0][3].logprob == pytest.approx(lp(0, 3), abs=1e-6)
    assert set(out[1]) == {0, 1}
    assert out[1][1].rank == 1 and out[1][0].rank == 1
    assert out[2][3].logprob == pytest.approx(math.log(0.25), abs=1e-6) and out[2][3].rank == 1
    only = prompt_logprobs(logits, targets, num_top=0)
    assert [list(e) for e in only] == [[0], [1], [3]]
    with pytest.raises(ValueError):
        prompt_logprobs(logits, [0, 1], num_top=1)


def test_prompt_logprobs_chunking(monkeypatch):
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(18)).half()
    targets = torch.randint(0, 50, (7,), generator=torch.Generator().manual_seed(19)).tolist()
    whole = prompt_logprobs(logits, targets, num_top=3)
    monkeypatch.setattr(sampler_mod, "PROMPT_LOGPROBS_CHUNK", 2)
    assert prompt_logprobs(logits, targets, num_top=3) == whole
    raw = torch.log_softmax(logits.float(), -1)
    for t, entry in enumerate(whole):
        assert entry[targets[t]].logprob == pytest.approx(raw[t, targets[t]].item(), abs=1e-6)
