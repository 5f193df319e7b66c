"""Scoring as lm-evaluation-harness 0.4.x does it (gsm8k_cot and gsm8k task configs, version 3.0):
the strict-match and flexible-extract filters ([regex, take_first]) and exact_match with
ignore_case and regexes_to_ignore [",", "\\$", "(?s).*#### ", "\\.$"].

The expected answers follow lm-eval's RegexFilter: `re.findall`, the match at group_select
(strict: the first, flexible: the last), the first non-empty group of a tuple, `.strip()`, and
"[invalid]" when nothing matches. They include lm-eval's own quirks, kept on purpose: the
strict-match pattern ends in an unescaped `.`, so "The answer is 18" at the very end of the text
extracts "1"; the pattern is case-sensitive; a lone ".." counts as a flexible match.
"""

from __future__ import annotations

import pytest

from rlt_engine.eval.data import Doc
from rlt_engine.eval.gsm8k import GSM8K, GSM8K_COT, after_reasoning
from rlt_engine.eval.scoring import FALLBACK, ExactMatch, RegexFilter

INVALID = FALLBACK

# (model output, reference number, strict-match answer, strict ok, flexible answer, flexible ok)
COT_CASES = [
    ("There are 3 + 15 = 18. The answer is 18.", "18", "18", True, "18.", True),
    ("The answer is 18.\n\nQ:", "18", "18", True, "18.", True),
    ("The answer is $18.", "18", INVALID, False, "$18.", True),
    ("The answer is 1,018.", "1018", "1,018", True, "1,018.", True),
    ("The answer is -3.", "-3", "-3", True, "-3.", True),
    ("The answer is -$5.", "-5", INVALID, False, "-$5.", True),
    ("The answer is 18", "18", "1", False, "18", True),  # lm-eval's trailing `.` eats the 8
    ("The answer is 18 apples.", "18", "18", True, "18", True),
    ("The answer is 18, I think", "18", "18,", True, "18,", True),
    ("The answer is 18.5.", "18.5", "18.5", True, "18.5.", True),
    ("the answer is 18.", "18", INVALID, False, "18.", True),  # the regex is case-sensitive
    ("The answer is 5. The answer is 18.", "18", "5.", False, "18.", True),  # first vs last
    ("12 + 6 = 18 fruits, 3 dozen. The answer is 18.", "18", "18", True, "18.", True),
    ("The answer is 18. That is 3 dozen.", "18", "18.", True, "3", False),
    ("She pays $1,234 in total.", "1234", INVALID, False, "$1,234", True),
    ("So she makes 9 * 2 = 18 dollars\n#### 18", "18", INVALID, False, "18", True),
    ("It costs $5", "5", INVALID, False, "$5", True),
    ("Hmm... no idea", "18", INVALID, False, "...", False),
    ("I do not know.", "18", INVALID, False, INVALID, False),
    ("", "18", INVALID, False, INVALID, False),
]

GSM8K_CASES = [
    ("She makes 9 * 2 = $18 every day.\n#### 18", "18", "18", True, "18", True),
    ("#### 1,018", "1018", "1,018", True, "1,018", True),
    ("#### -3", "-3", "-3", True, "-3", True),
    ("#### $18", "18", INVALID, False, "$18", True),
    ("#### 18.", "18", "18.", True, "18.", True),
    ("#### 18 eggs a day", "18", "18", True, "18", True),
    ("####18", "18", INVALID, False, "18", True),
    ("#### 5\n#### 18", "18", "5", False, "18", True),
    ("The answer is 18.", "18", INVALID, False, "18.", True),
    ("#### 18\nThat is 2 dozen", "18", "18", True, "2", False),
    ("no idea", "18", INVALID, False, INVALID, False),
]


def cot_doc(number: str) -> Doc:
    return Doc("q", f"Some work <<1+1=2>>.\n#### {number}")


CASE_FIELDS = ("output", "number", "strict", "strict_ok", "flex", "flex_ok")


@pytest.mark.parametrize(CASE_FIELDS, COT_CASES)
def test_gsm8k_cot_filters_and_exact_match(
    output: str, number: str, strict: str, strict_ok: bool, flex: str, flex_ok: bool
) -> None:
    scores = GSM8K_COT.score(output, cot_doc(number))
    assert scores == {"strict-match": (strict, strict_ok), "flexible-extract": (flex, flex_ok)}


@pytest.mark.parametrize(CASE_FIELDS, GSM8K_CASES)
def test_gsm8k_filters_and_exact_match(
    output: str, number: str, strict: str, strict_ok: bool, flex: str, flex_ok: bool
) -> None:
    scores = GSM8K.score(output, cot_doc(number))
    assert scores == {"strict-match": (strict, strict_ok), "flexible-extract": (flex, flex_ok)}


def test_references_as_lm_eval_renders_them() -> None:
    doc = Doc("q", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72")
    assert GSM8K_COT.reference(doc) == "72"  # answer.split('####')[-1].strip()
    assert GSM8K.reference(doc) == doc.answer  # {{answer}}; the metric keeps what follows ####
    assert GSM8K.metric("72", GSM8K.reference(doc))
    assert GSM8K.metric("$72.", "#### 72")


def test_exact_match_normalisation_order_and_flags() -> None:
    metric = GSM8K_COT.metric
    assert metric.regexes_to_ignore == (",", r"\$", r"(?s).*#### ", r"\.$")
    assert metric.ignore_case and not metric.ignore_punctuation
    assert metric.normalise("$1,000.") == "1000"
    assert metric.normalise("work\nmore\n#### 1,000") == "1000"  # (?s): across lines
    assert metric.normalise("18..") == "18."  # \.$ removes one trailing period
    assert metric("[INVALID]", "[invalid]")  # ignore_case
    assert not metric("18", "18 ")  # no stripping beyond the regexes
    plain = ExactMatch()
    assert not plain("ABC", "abc")
    assert ExactMatch(ignore_punctuation=True)("a.b,c!", "abc")
    assert ExactMatch(ignore_numbers=True)("a1b2", "ab")


def test_regex_filter_group_select_and_take_first() -> None:
    last = RegexFilter("x", r"(a)|(b)", group_select=-1)
    assert last.extract("a b") == "b"  # the last match's non-empty group
    assert RegexFilter("x", r"(a)|(b)").extract("a b") == "a"
    assert RegexFilter("x", r"n=(\d+)")(["n=1", "n=2"]) == "1"  # take_first over responses
    assert RegexFilter("x", r"n=( \d+ )").extract("n= 7 ") == "7"  # stripped
    assert RegexFilter("x", r"z", fallback="none").extract("a") == "none"


def test_chat_answers_are_read_after_the_reasoning() -> None:
    text = "<think>The answer is 5.</think>So the total is 18. The answer is 18."
    assert after_reasoning(text) == "So the total is 18. The answer is 18."
    assert after_reasoning("no reasoning, The answer is 3.") == "no reasoning, The answer is 3."
    assert GSM8K_COT.score(after_reasoning(text), cot_doc("18"))["strict-match"] == ("18", True)
