"""Answer extraction and exact match as lm-evaluation-harness 0.4.x scores `generate_until` tasks.

Our own implementation of the behaviour of lm-eval 0.4.x's `regex` filter
(lm_eval/filters/extraction.py), `take_first` (lm_eval/filters/selection.py) and the
`exact_match` metric (lm_eval/api/metrics.py, `exact_match_hf_evaluate`):

- regex: `re.findall(pattern, response)`; no match -> the fallback "[invalid]". Otherwise the
  match at `group_select` (0 = the first, -1 = the last); a pattern with several groups gives a
  tuple per match, of which the first non-empty group is taken; the result is `.strip()`-ed.
- take_first: of the responses of one document (lm-eval's `repeats`), the first.
- exact_match: both prediction and reference go through `re.sub(r, "", text)` for each of
  `regexes_to_ignore` in order, then lower-casing (ignore_case), then deletion of
  `string.punctuation` (ignore_punctuation) and of digits (ignore_numbers); then `==`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

FALLBACK = "[invalid]"


@dataclass(frozen=True)
class RegexFilter:
    """One lm-eval filter pipeline of the form [regex, take_first], under its lm-eval name."""

    name: str
    pattern: str
    group_select: int = 0
    fallback: str = FALLBACK

    def extract(self, response: str) -> str:
        matches = re.findall(self.pattern, response)
        if not matches:
            return self.fallback
        match = matches[self.group_select]
        if isinstance(match, tuple):  # several groups: the first that matched something
            groups = [group for group in match if group]
            if not groups:
                return self.fallback
            match = groups[0]
        return match.strip()

    def __call__(self, responses: Sequence[str]) -> str:
        """The filtered answer of one document: regex on every response, then take_first."""
        filtered = [self.extract(r) for r in responses]
        return filtered[0]


@dataclass(frozen=True)
class ExactMatch:
    """lm-eval's exact_match with its keyword arguments (the defaults are lm-eval's)."""

    regexes_to_ignore: tuple[str, ...] = ()
    ignore_case: bool = False
    ignore_punctuation: bool = False
    ignore_numbers: bool = False

    def normalise(self, text: str) -> str:
        for pattern in self.regexes_to_ignore:
            text = re.sub(pattern, "", text)
        if self.ignore_case:
            text = text.lower()
        if self.ignore_punctuation:
            text = text.translate(str.maketrans("", "", string.punctuation))
        if self.ignore_numbers:
            text = text.translate(str.maketrans("", "", string.digits))
        return text

    def __call__(self, prediction: str, reference: str) -> bool:
        return self.normalise(prediction) == self.normalise(reference)
