"""The grammar compiler on a small trained tokenizer: constraints compile (cached by their text),
bad ones fail with a message naming the construct, and a grammar's masks and drafts behave."""
from __future__ import annotations

import pytest
import torch

from conftest import build_tokenizer
from twostep.sample.constraints import unpack_bitmask
from twostep.sampling_params import StructuredOutputsParams as S
from twostep.structured_output.compiler import GrammarCompiler
from twostep.tokenizer.tokenizer import Tokenizer

EOS = 2   # "</s>" in conftest's tokenizer


@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer(build_tokenizer(), {"eos_token": "</s>"})
    return GrammarCompiler(tok, tok.vocab_size + 6, {EOS})    # a padded vocabulary, as models have


def _allowed_text(compiler, grammar) -> set[str]:
    allowed = unpack_bitmask(grammar.bitmask()[0], compiler.vocab_size).nonzero().flatten().tolist()
    return {compiler.tokenizer.decode([t], skip_special_tokens=False) for t in allowed}


@pytest.mark.parametrize("params,message", [
    (S(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (S(json={"$ref": "#/$defs/nope"}), "nope"),
    (S(regex="(?<=a)b"), "look-around"),
    (S(regex="(a"), "regex"),
    (S(grammar='start: foo'), "foo"),
    (S(json={"type": "string", "pattern": "(a)\\1"}), "backreference"),
])
def test_bad_constraints_fail_naming_the_construct(compiler, params, message):
    with pytest.raises(ValueError, match=message) as e:
        compiler.grammar(params)
    assert f"structured_outputs.{params.kind}" in str(e.value)


def test_compile_is_cached_by_constraint(compiler):
    before = compiler.stats.num_compiled, compiler.stats.num_cache_hits
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    g1 = compiler.grammar(S(json=schema))
    g2 = compiler.grammar(S(json=dict(reversed(list(schema.items())))))   # same schema, other key order
    assert compiler.stats.num_compiled == before[0] + 1
    assert compiler.stats.num_cache_hits == before[1] + 1
    assert g1.matcher is not g2.matcher     # each request its own state


def test_choice_masks_advance_and_terminate(compiler):
    g = compiler.grammar(S(choice=["Paris", "London"]))
    first = _allowed_text(compiler, g)
    assert first and all("Paris".startswith(t) or "London".startswith(t) for t in first)
    assert EOS not in unpack_bitmask(g.bitmask()[0], compiler.vocab_size).nonzero().flatten().tolist()
    for t in compiler.tokenizer.encode("Paris", add_special_tokens=False):
        assert g.accept(t)
    assert g.is_terminated     # nothing can follow a complete choice


def test_eos_only_where_the_grammar_can_end(compiler):
    g = compiler.grammar(S(regex="ab+"))
    allowed = lambda: unpack_bitmask(g.bitmask()[0], compiler.vocab_size)   # noqa: E731
    assert not allowed()[EOS]
    a, b = (compiler.tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    assert g.accept(a) and not allowed()[EOS]
    assert g.accept(b) and allowed()[EOS]
    assert not allowed()[compiler.vocab_size - 1]   # padding rows past the tokenizer: never


def test_drafts_get_one_mask_per_position_and_the_state_comes_back(compiler):
    g = compiler.grammar(S(regex="(ab)+"))
    a, b = (compiler.tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    assert g.valid_prefix([a, b, a, a, b]) == 3
    assert g.valid_prefix([a, b, EOS]) == 2       # drafts stop before an EOS
    masks = g.bitmask([a, b, a])
    rows = unpack_bitmask(masks, compiler.vocab_size)
    assert rows.shape == (4, compiler.vocab_size)
    assert rows[0, a] and not rows[0, b]
    assert rows[1, b] and not rows[1, a]
    assert rows[2, a] and rows[2, EOS]
    assert rows[3, b] and not rows[3, EOS]
    assert torch.equal(g.bitmask()[0], masks[0])   # rolled back to where it was
    assert g.drafts_to_verify([a, b, a, a, b]) == 4   # the valid three and the first refused one
    assert g.drafts_to_verify([a, b, EOS, a]) == 3    # up to and with the first EOS
    past = unpack_bitmask(g.bitmask([a, a, b]), compiler.vocab_size)
    assert past[1, b] and not past[1, a]            # the row that scores the refused draft bans it
    assert past[2].all() and past[3].all()          # after it: never used, everything allowed
    assert torch.equal(g.bitmask()[0], masks[0])
    assert g.accept(a) and not g.accept(a)         # the real state: after "a" comes "b"
