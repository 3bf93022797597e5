"""Streaming detokenisation: safe deltas, exact final text, stop strings across token boundaries.

Three in-memory tokenizers cover the decoder families that matter for streaming:
  byte_level   GPT-2 style; CJK and emoji are split over several byte tokens,
  metaspace    SentencePiece style (Metaspace decoder, prepend_scheme "first") with byte fallback,
  llama2       older SentencePiece tokenizer.json layout (Replace/ByteFallback/Fuse/Strip decoders).
"""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from twostep.tokenizer.detokenizer import IncrementalDetokenizer
from twostep.tokenizer.tokenizer import Tokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. Stop here, please.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキストも少しあります。東京は大きい都市です。",
    "Emoji time: 😀 🎉 🚀 👍🏽 ❤️ 🇫🇷 and a robot 🤖!",
    "Accents: café naïve résumé — “quotes” … the end.",
] * 10

SAMPLE = "Hello world! 你好，世界！ Emoji 😀🎉👍🏽🇫🇷 café 東京は大きい。 The  lazy dog 🤖\nnew line"
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def _byte_level() -> Backend:
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=380, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _sentencepiece(style: str) -> Backend:
    tok = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    if style == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([
            decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    # A small alphabet leaves most CJK/emoji to byte fallback (<0xNN> tokens), as in Llama 2.
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=260, special_tokens=SPECIALS, limit_alphabet=60, show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first = max(vocab.values()) + 1
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = first + byte
    tok = Backend.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


KINDS = ["byte_level", "metaspace", "llama2"]


@pytest.fixture(scope="module")
def tokenizers_by_kind() -> dict[str, Tokenizer]:
    cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    return {
        "byte_level": Tokenizer(_byte_level(), {"eos_token": "<|endoftext|>"}),
        "metaspace": Tokenizer(_sentencepiece("metaspace"), cfg),
        "llama2": Tokenizer(_sentencepiece("llama2"), cfg),
    }


@pytest.fixture(params=KINDS)
def tok(request, tokenizers_by_kind) -> Tokenizer:
    return tokenizers_by_kind[request.param]


def stream(tok, ids, *, chunk=1, stop=(), include=False, skip=True):
    """Feed ids `chunk` at a time; returns (detokenizer, deltas incl. flush, stop result)."""
    detok = IncrementalDetokenizer(tok, list(stop), include_stop_str_in_output=include,
                                   skip_special_tokens=skip)
    deltas, hit = [], None
    for i in range(0, len(ids), chunk):
        hit = detok.update(ids[i:i + chunk])
        deltas.append(detok.get_delta())
        if hit is not None:
            break
    deltas.append(detok.flush())
    return detok, deltas, hit


def piece_texts(tok, ids):
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


# ---------------------------------------------------------------- plain streaming


def test_characters_really_are_split(tok):
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    assert any("\ufffd" in piece for piece in piece_texts(tok, ids)), "test text must split a character"


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_stream_joins_to_decode_without_replacement_chars(tok, chunk):
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    detok, deltas, hit = stream(tok, ids, chunk=chunk)
    assert hit is None and detok.stop_reason is None
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == SAMPLE
    assert not any("\ufffd" in d for d in deltas)


def test_stream_with_bos_and_leading_space(tok):
    # The prompt's post-processor BOS in front, and text starting with spaces (Metaspace strips one).
    for text in ["  two leading spaces", " one", "x 😀 y"]:
        ids = tok.encode(text)
        detok, deltas, _ = stream(tok, ids)
        assert "".join(deltas) == detok.output_text == tok.decode(ids)
        detok, deltas, _ = stream(tok, ids, skip=False)
        assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=False)


def test_random_valid_text_fuzz(tok):
    rng = random.Random(1234)
    specials = [tok.token_to_id(t) for t in ("<|im_end|>", "</s>", "<s>")]
    for _ in range(60):
        a = rng.randrange(len(SAMPLE))
        b = min(len(SAMPLE), a + rng.randrange(1, 30))
        ids = tok.encode(SAMPLE[a:b], add_special_tokens=False)
        if rng.random() < 0.5:  # a special token between two pieces of valid text
            ids = ids + [rng.choice(specials)] + tok.encode(SAMPLE[b:b + 10], add_special_tokens=False)
        for skip in (True, False):
            detok, deltas, _ = stream(tok, ids, chunk=rng.choice([1, 2, 3]), skip=skip)
            assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in d for d in deltas)


def test_skip_special_tokens(tok):
    im_end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hi there", add_special_tokens=False) + [im_end] + tok.encode(
        " 你好", add_special_tokens=False)
    detok, deltas, _ = stream(tok, ids, skip=True)
    assert "<|im_end|>" not in detok.output_text and detok.output_text == tok.decode(ids)
    detok, deltas, _ = stream(tok, ids, skip=False)
    assert "<|im_end|>" in detok.output_text
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=False)


def test_partial_character_at_end_is_held_then_flushed(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    full = tok.encode("ab 😀", add_special_tokens=False)
    ids = full[:-1]              # generation cut off in the middle of the emoji
    assert "\ufffd" in tok.decode(ids)
    detok = IncrementalDetokenizer(tok, [])
    detok.update(ids)
    delta = detok.get_delta()
    assert delta in ("ab", "ab ")   # the space may share a token with the emoji bytes
    tail = detok.flush()
    assert delta + tail == detok.output_text == tok.decode(ids)
    assert detok.flush() == "" and detok.update(full[-1:]) is None   # finished: nothing more


@pytest.mark.parametrize("kind", KINDS)
def test_generation_cut_off_anywhere(tokenizers_by_kind, kind):
    """Stop after every possible number of tokens, often mid-character: the streamed deltas are
    always a clean prefix of the text, and flush() returns the decoded rest."""
    tok = tokenizers_by_kind[kind]
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    for k in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tok, [])
        streamed = ""
        for i in ids[:k]:
            detok.update([i])
            streamed += detok.get_delta()
        assert SAMPLE.startswith(streamed)
        tail = detok.flush()
        assert streamed + tail == detok.output_text
        full = tok.decode(ids[:k])
        if kind == "byte_level" or "\ufffd" not in full:
            assert detok.output_text == full
        else:
            # ByteFallback replaces a whole invalid run of <0xNN> tokens, including complete
            # characters before the cut that were already streamed; those stay as streamed.
            assert tail and set(tail) <= {"\ufffd"}


def test_invalid_byte_fallback_sequence_does_not_break_streaming(tokenizers_by_kind):
    # A valid byte, then a lone lead byte, then text: ByteFallback rewrites the whole byte run as
    # U+FFFD, which makes tokenizers' DecodeStream raise; the stream must carry on.
    tok = tokenizers_by_kind["metaspace"]
    ids = tok.encode("Hi", add_special_tokens=False) + [
        tok.token_to_id("<0x41>"), tok.token_to_id("<0xF3>")] + tok.encode(" dog", add_special_tokens=False)
    detok, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == detok.output_text
    assert detok.output_text.startswith("Hi") and detok.output_text.endswith(" dog")


# ---------------------------------------------------------------- stop strings


def spans_tokens(tok, ids, stop):
    """True if no single token's text contains the stop string (so it is split over tokens)."""
    return not any(stop in piece for piece in piece_texts(tok, ids))


# Word and character orders absent from CORPUS, so no trained merge can swallow a whole region.
STOP_TEXT = "Hello world! The quiet brown zebra 好世，界你！ 😀🎉🚀 ok. Stop there, thanks. More text after."


def split_stop(tok, ids, region: str, length: int) -> str:
    """A stop string of `length` chars taken from `region` of STOP_TEXT that no single token
    contains. Trained vocabularies vary from run to run, so the split is found, not assumed."""
    base = STOP_TEXT.index(region)
    for i in range(base, base + len(region) - length + 1):
        candidate = STOP_TEXT[i:i + length]
        if STOP_TEXT.count(candidate) == 1 and spans_tokens(tok, ids, candidate):
            return candidate
    raise AssertionError(f"no split stop string of length {length} in {region!r}")


@pytest.mark.parametrize("region,length", [
    ("quiet brown zebra", 2), ("quiet brown zebra", 6), ("好世，界你！", 2), ("好世，界你！", 4),
    ("😀🎉🚀", 2), ("Stop there, thanks.", 9),
])
def test_stop_string_split_across_tokens(tok, region, length):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    stop = split_stop(tok, ids, region, length)
    before = STOP_TEXT[:STOP_TEXT.index(stop)]
    for chunk in (1, 3):
        detok, deltas, hit = stream(tok, ids, chunk=chunk, stop=[stop, "never appears"])
        assert hit == stop == detok.stop_reason
        assert detok.output_text == before
        assert "".join(deltas) == before
        detok, deltas, hit = stream(tok, ids, chunk=chunk, stop=["never appears", stop], include=True)
        assert hit == stop
        assert detok.output_text == "".join(deltas) == before + stop


def test_stop_never_partially_streamed(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    stop = "STOP!"
    text = "a STO b STOP! c"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [stop])
    sent = ""
    for i in ids:
        hit = detok.update([i])
        sent += detok.get_delta()
        # whatever has gone out could never need to be taken back
        assert stop not in sent and text.startswith(sent)
        if hit:
            break
    assert hit == stop
    sent += detok.flush()
    assert sent == detok.output_text == "a STO b "


def test_held_back_text_flushed_at_end(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    text = "The lazy dog sleeps"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, ["<<END>>", "xyz"])  # longest stop has 7 chars -> hold 6
    assert detok.update(ids) is None
    assert detok.get_delta() == text[:-6]
    assert detok.get_delta() == ""
    assert detok.flush() == text[-6:]
    assert detok.output_text == text and detok.stop_reason is None
    # without stop strings nothing is held back
    detok = IncrementalDetokenizer(tok, [])
    detok.update(ids)
    assert detok.get_delta() == text and detok.flush() == ""


def test_text_after_stop_in_same_token_is_dropped(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    ids = tok.encode("Hello world! The end", add_special_tokens=False)
    detok, deltas, hit = stream(tok, ids, stop=["wor"])
    assert hit == "wor" and detok.output_text == "Hello " == "".join(deltas)
    detok, deltas, hit = stream(tok, ids, stop=["wor"], include=True)
    assert detok.output_text == "Hello wor" == "".join(deltas)


def test_earliest_ending_stop_wins_regardless_of_chunking(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    ids = tok.encode("xx quick brown fox", add_special_tokens=False)
    for chunk in (1, len(ids)):
        detok, _, hit = stream(tok, ids, chunk=chunk, stop=["quick brown fox", "brown"])
        assert hit == "brown" and detok.output_text == "xx quick "
        detok, _, hit = stream(tok, ids, chunk=chunk, stop=["own", "brown"], include=True)
        assert hit == "brown" and detok.output_text == "xx quick brown"


def test_stop_on_special_token_text(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    ids = tok.encode("answer<|im_end|>junk", add_special_tokens=False)
    detok, deltas, hit = stream(tok, ids, stop=["<|im_end|>"], skip=False)
    assert hit == "<|im_end|>" and detok.output_text == "answer" == "".join(deltas)
    detok, deltas, hit = stream(tok, ids, stop=["<|im_end|>"], skip=True)
    assert hit is None and detok.output_text == "answerjunk"


def test_updates_after_stop_are_ignored(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    detok = IncrementalDetokenizer(tok, ["dog"])
    assert detok.update(tok.encode("lazy dog", add_special_tokens=False)) == "dog"
    assert detok.finished
    assert detok.update(tok.encode(" more", add_special_tokens=False)) is None
    assert detok.get_delta() + detok.flush() == "lazy " == detok.output_text


def test_check_stop_false_lets_text_through(tokenizers_by_kind):
    # Before min_tokens the engine must not stop on a stop string; the text simply continues.
    tok = tokenizers_by_kind["byte_level"]
    detok = IncrementalDetokenizer(tok, ["dog"])
    assert detok.update(tok.encode("lazy dog", add_special_tokens=False), check_stop=False) is None
    assert detok.update(tok.encode(" and a dog", add_special_tokens=False)) == "dog"
    assert detok.get_delta() + detok.flush() == "lazy dog and a " == detok.output_text
