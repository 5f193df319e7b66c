"""Prompts byte for byte as lm-evaluation-harness 0.4.x renders them (gsm8k_cot and gsm8k task
configs, version 3.0; lm_eval/api/samplers.py, lm_eval/api/task.py).

The expected texts in tests/fixtures/gsm8k/ were rendered from lm-eval's task definitions
(the YAML's doc_to_text / doc_to_target Jinja templates, target_delimiter " ", fewshot_delimiter
"\\n\\n"), not from our code; they end without a newline, as the prompts do.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rlt_engine.eval.data import Doc, read_jsonl
from rlt_engine.eval.gsm8k import COT_EXEMPLARS, GSM8K, GSM8K_COT, SeededSampler

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k"
TEST = read_jsonl(FIXTURES / "test.jsonl")
TRAIN = read_jsonl(FIXTURES / "train.jsonl")

# What lm-eval's default sampler draws from the full openai/gsm8k train split (7,473 problems)
# for test documents 0, 1 and 2: random.Random(1234).sample(train, 5), one generator for all.
LM_EVAL_TRAIN_DRAWS = [
    [6374, 3610, 957, 61, 742],
    [7462, 6610, 4769, 286, 5501],
    [5677, 687, 806, 6279, 2905],
]


def test_first_test_question_gsm8k_cot_3_shot_byte_for_byte() -> None:
    expected = (FIXTURES / "gsm8k_cot-3shot-test0.txt").read_bytes()
    prompt = GSM8K_COT.prompts(TEST[:1], 3)[0]
    assert prompt.encode("utf-8") == expected


def test_gsm8k_cot_few_shot_is_the_first_n_exemplars() -> None:
    assert len(COT_EXEMPLARS) == 8 and GSM8K_COT.default_num_fewshot == 3
    doc = TEST[0]
    assert GSM8K_COT.prompts([doc], 0) == [f"Q: {doc.question}\nA:"]
    eight = GSM8K_COT.prompts([doc], 8)[0]
    assert eight.count("\n\nQ: ") == 8 and eight.endswith(f"Q: {doc.question}\nA:")
    assert eight.startswith(GSM8K_COT.prompts([doc], 3)[0].rsplit("Q: ", 1)[0])
    assert "Olivia has $23." in eight and "Olivia has" not in GSM8K_COT.prompts([doc], 7)[0]
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        GSM8K_COT.prompts([doc], 9)


def test_gsm8k_5_shot_seeded_draws_byte_for_byte() -> None:
    """Test document 1 gets the second draw of the shared generator (here over the fixture's
    10 train problems; lm-eval's draws over the full split are LM_EVAL_TRAIN_DRAWS)."""
    expected = (FIXTURES / "gsm8k-5shot-test1-fixture-train.txt").read_bytes()
    prompts = GSM8K.prompts(TEST[:2], 5, TRAIN)
    assert prompts[1].encode("utf-8") == expected
    assert prompts[0].startswith(f"Question: {TRAIN[7].question}\nAnswer: {TRAIN[7].answer}\n\n")


def test_sampler_reproduces_lm_eval_draws_over_the_full_train_split() -> None:
    train = [Doc(f"q{i}", f"#### {i}") for i in range(7473)]
    sampler = SeededSampler(train, 1234)
    for expected in LM_EVAL_TRAIN_DRAWS:
        shots = sampler.shots(Doc("test", "#### 0"), 5)
        assert [int(q[1:]) for q, _ in shots] == expected
    rnd = random.Random(1234)  # the draws are random.sample's, whatever the population holds
    assert [rnd.sample(range(7473), 5) for _ in range(3)] == LM_EVAL_TRAIN_DRAWS


def test_sampler_drops_the_test_document_if_drawn() -> None:
    sampler = SeededSampler(TRAIN, 1234)
    shots = sampler.shots(TRAIN[7], 5)  # the first draw is [7, 1, 0, 9, 4]
    assert [q for q, _ in shots] == [TRAIN[i].question for i in (1, 0, 9, 4)]


def test_gsm8k_needs_train_problems() -> None:
    with pytest.raises(ValueError, match="train split"):
        GSM8K.prompts(TEST[:1], 5, None)
    assert GSM8K.prompts(TEST[:1], 0, None) == [f"Question: {TEST[0].question}\nAnswer:"]
    with pytest.raises(ValueError, match=r"\[0, 10\]"):
        GSM8K.prompts(TEST[:1], 11, TRAIN)


def test_stops_and_length_are_lm_eval_s() -> None:
    assert GSM8K_COT.stop == ("Q:", "</s>", "<|im_end|>")
    assert GSM8K.stop == ("Question:", "</s>", "<|im_end|>")
    assert GSM8K_COT.max_gen_toks == GSM8K.max_gen_toks == 256
    assert [f.name for f in GSM8K_COT.filters] == ["strict-match", "flexible-extract"]
    assert GSM8K_COT.filters[0].pattern == r"The answer is (\-?[0-9\.\,]+)."
    assert GSM8K.filters[0].pattern == r"#### (\-?[0-9\.\,]+)"
    assert GSM8K.filters[1] == GSM8K_COT.filters[1]
    assert (GSM8K_COT.filters[1].pattern, GSM8K_COT.filters[1].group_select) == (
        r"(-?[$0-9.,]{2,})|(-?[0-9]+)",
        -1,
    )
