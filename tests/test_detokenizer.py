"""Incremental detokenization with the real Ouro tokenizer: multi-byte characters are never
split, stop strings are found even when they straddle tokens, text is cut at the stop."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlt_engine.detokenizer import IncrementalDetokenizer
from rlt_engine.models.tokenizer import load_tokenizer

MULTILINGUAL = (
    "Hello 🙂 世界 naïve — ok 👍🏽 日本語テキスト, 한국어 and Ελληνικά; 🇫🇷 flags & café ☕."
)


@pytest.fixture(scope="module")
def tokenizer(tiny_ouro_dir: Path):
    return load_tokenizer(tiny_ouro_dir)


def _push_all(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], int | None]:
    """Push tokens until a stop hits; returns the emitted pieces and the index of the stop."""
    pieces = []
    for i, t in enumerate(ids):
        hit = detok.push(t)
        pieces.append(detok.take_new(final=hit))
        if hit:
            return pieces, i
    pieces.append(detok.take_new(final=True))  # the request finished: flush what was held
    return pieces, None


def test_the_sample_text_really_splits_characters_across_tokens(tokenizer):
    ids = tokenizer.encode(MULTILINGUAL)
    assert tokenizer.decode(ids) == MULTILINGUAL
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize(
    "text",
    [
        MULTILINGUAL,
        "🙂🙂🙂👍🏽👍🏽",
        "日本語テキスト" * 3,
        "a" + "👨‍👩‍👧‍👦" * 2 + "z",
        (MULTILINGUAL + " ") * 6,
    ],
)
def test_multibyte_characters_are_never_split(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces, stop = _push_all(detok, ids)
    assert stop is None
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    *per_token, flush = pieces
    assert flush == ""  # no stop strings: nothing is held once the last character is complete
    # After every token the text handed out so far is exactly the decoded prefix, except that a
    # token ending inside a character emits nothing and leaves that character for later.
    held = 0
    for i, piece in enumerate(per_token):
        prefix = tokenizer.decode(ids[: i + 1])
        emitted = "".join(per_token[: i + 1])
        if prefix.endswith("\ufffd"):
            held += 1
            assert piece == "" and prefix.startswith(emitted), (i, piece, prefix)
        else:
            assert emitted == prefix, (i, emitted, prefix)
    assert held > 0  # the sample really ends some tokens mid-character


def test_special_tokens_emit_no_text(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("one two"), im_end, *tokenizer.encode(" three 🙂")]
    detok = IncrementalDetokenizer(tokenizer)
    pieces, _ = _push_all(detok, ids)
    assert "".join(pieces) == detok.text == "one two three 🙂"


def _boundaries(tokenizer, ids: list[int]) -> list[int]:
    """Character offset of the text after each token (for tokens ending on a character)."""
    return [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]


def test_stop_string_straddling_two_tokens(tokenizer):
    text = "The loop exits early when the gate is confident enough."
    ids = tokenizer.encode(text)
    ends = _boundaries(tokenizer, ids)
    # the stop spans the end of token 3 and the start of token 4
    cut = ends[3]
    stop = text[cut - 2 : cut + 3]
    assert text.find(stop) == cut - 2
    detok = IncrementalDetokenizer(tokenizer, stop=(stop,))
    _pieces, hit_at = _push_all(detok, ids)
    assert hit_at == 4  # found on the token that completes it, not later
    assert detok.text == text[: cut - 2]


def test_stop_string_inside_one_token_and_earliest_of_several(tokenizer):
    text = "alpha beta gamma delta epsilon"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=("delta", "amm"))
    _, hit_at = _push_all(detok, ids)
    assert hit_at is not None and detok.text == "alpha beta g"
    # a stop string made of a multi-byte character, completed by its last byte token
    text = "tea 日本語 coffee"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=("本",))
    pieces, hit_at = _push_all(detok, ids)
    assert detok.text == "tea 日"
    assert all("\ufffd" not in p for p in pieces)


def test_no_stop_when_absent(tokenizer):
    ids = tokenizer.encode(MULTILINGUAL)
    detok = IncrementalDetokenizer(tokenizer, stop=("zzz", "🙃"))
    _pieces, hit_at = _push_all(detok, ids)
    assert hit_at is None and detok.text == MULTILINGUAL


def test_streamed_pieces_never_include_part_of_a_stop_string(tokenizer):
    text = "The loop exits early when the gate is confident enough."
    ids = tokenizer.encode(text)
    cut = _boundaries(tokenizer, ids)[3]
    stop = text[cut - 2 : cut + 3]
    detok = IncrementalDetokenizer(tokenizer, stop=(stop,))
    pieces, _ = _push_all(detok, ids)
    assert "".join(pieces) == detok.text


def test_min_tokens_skips_stop_strings_in_the_first_tokens(tokenizer):
    """As vLLM: a stop string is looked for once the output is longer than min_tokens, in
    the newest token's text (with what it may straddle): one that ended inside the first
    min_tokens tokens is passed over, the next one found."""
    text = "one. two three four. five"
    ids = tokenizer.encode(text)
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    first_stop = next(i for i, e in enumerate(ends) if e > text.index("."))
    _, at = _push_all(IncrementalDetokenizer(tokenizer, (".",)), ids)
    assert at == first_stop
    detok = IncrementalDetokenizer(tokenizer, (".",), min_tokens=first_stop + 1)
    pieces, at = _push_all(detok, ids)
    assert at == next(i for i, e in enumerate(ends) if e > text.rindex("."))
    assert "".join(pieces) == detok.text == "one. two three four"
    # min_tokens past every stop string: none ends it
    detok = IncrementalDetokenizer(tokenizer, (".",), min_tokens=len(ids))
    assert _push_all(detok, ids)[1] is None and detok.text == text


def test_include_stop_keeps_the_stop_string_and_special_tokens_can_stay(tokenizer):
    ids = tokenizer.encode("one. two. three")
    detok = IncrementalDetokenizer(tokenizer, (". t", "."), include_stop=True)
    pieces, _ = _push_all(detok, ids)
    assert "".join(pieces) == detok.text == "one."  # the first stop to start, the shortest
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = IncrementalDetokenizer(tokenizer)
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    for t in [*ids, special]:
        plain.push(t)
        kept.push(t)
    assert plain.text == "one. two. three" and kept.text == "one. two. three<|im_end|>"
