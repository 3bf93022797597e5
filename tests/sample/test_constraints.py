"""Step 0 of sampling: grammar bitmasks, allowed_token_ids, bad_words and logit_bias on fixed
logits, and the SamplingParams checks for them."""
from __future__ import annotations

import pytest
import torch

from twostep.sample.constraints import apply_constraints, banned_words_next, unpack_bitmask
from twostep.sample.sampler import Sampler, SamplingRow
from twostep.sampling_params import SamplingParams, StructuredOutputsParams

V = 70   # not a multiple of 32: the last bitmask word is partly padding


def _bitmask(allowed: list[int], vocab: int = V) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)   # as int32 bit patterns


def _row(params: SamplingParams, output=(), bitmask=None) -> SamplingRow:
    return SamplingRow(params, [1, 2], list(output), None, bitmask)


def test_unpack_bitmask_matches_the_bits():
    allowed = [0, 5, 31, 32, 63, 69]     # 31: the sign bit of word 0
    got = unpack_bitmask(_bitmask(allowed), V)
    assert got.shape == (V,)
    assert got.nonzero().flatten().tolist() == allowed


def test_bitmask_masks_only_its_row_and_leaves_the_input_alone():
    logits = torch.randn(2, V)
    before = logits.clone()
    rows = [_row(SamplingParams(temperature=0), bitmask=_bitmask([3, 40])), _row(SamplingParams(temperature=0))]
    out = apply_constraints(logits, rows)
    assert torch.equal(logits, before)
    assert torch.isinf(out[0]).sum() == V - 2 and out[0, 3] == logits[0, 3] and out[0, 40] == logits[0, 40]
    assert torch.equal(out[1], logits[1])
    tokens = Sampler()(logits, rows).token_ids
    assert tokens[0] in (3, 40) and tokens[0] == (3 if logits[0, 3] > logits[0, 40] else 40)


def test_no_constraints_returns_the_same_tensor():
    logits = torch.randn(1, V)
    assert apply_constraints(logits, [_row(SamplingParams())]) is logits


def test_allowed_token_ids_and_logit_bias():
    logits = torch.zeros(1, V)
    p = SamplingParams(temperature=0, allowed_token_ids=[4, 9, 11], logit_bias={9: 2.5, 11: -1.0, 30: 100})
    out = apply_constraints(logits, [_row(p)])[0]
    assert out[4] == 0 and out[9] == 2.5 and out[11] == -1.0
    assert out[30] == float("-inf")        # biased, but not allowed
    assert torch.isinf(out).sum() == V - 3
    assert Sampler()(logits, [_row(p)]).token_ids == [9]


def test_logit_bias_alone_is_added():
    logits = torch.zeros(1, V)
    p = SamplingParams(temperature=0, logit_bias={7: 100.0, 8: -100.0})
    out = apply_constraints(logits, [_row(p)])[0]
    assert out[7] == 100 and out[8] == -100 and out[0] == 0


@pytest.mark.parametrize("output,banned", [([], [5]), ([1], [5]), ([3], [5, 4]), ([2, 3], [5, 4]),
                                           ([3, 2], [5])])
def test_bad_words_ban_the_token_that_completes_a_word(output, banned):
    words = [[5], [3, 4]]
    assert banned_words_next(words, output) == banned
    p = SamplingParams(temperature=0)
    p.bad_words_token_ids = words
    out = apply_constraints(torch.zeros(1, V), [_row(p, output)])[0]
    assert sorted(out.isinf().nonzero().flatten().tolist()) == sorted(banned)


@pytest.mark.parametrize("kw,message", [
    (dict(logit_bias={3: 101}), "logit_bias values"),
    (dict(logit_bias={-1: 1}), "logit_bias keys"),
    (dict(logit_bias={"3": 1}), "logit_bias keys"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "exactly one"),
    (dict(structured_outputs={}), "exactly one"),
    (dict(structured_outputs={"jsn": {}}), "unknown fields"),
    (dict(structured_outputs={"json": "{not json"}), "not valid JSON"),
    (dict(structured_outputs={"choice": []}), "choice"),
    (dict(structured_outputs={"regex": ""}), "regex"),
])
def test_bad_constraint_params_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_structured_outputs_from_dict_and_key():
    a = SamplingParams(structured_outputs={"json": '{"type": "object"}'}).structured_outputs
    b = StructuredOutputsParams(json={"type": "object"})
    assert isinstance(a, StructuredOutputsParams) and a.kind == "json" and a.key() == b.key()
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(regex="a").key() != StructuredOutputsParams(grammar="a").key()
