"""GSM8K as lm-evaluation-harness 0.4.x defines it: the tasks `gsm8k_cot` and `gsm8k`.

Written from lm-eval 0.4.x's task configs `lm_eval/tasks/gsm8k/gsm8k-cot.yaml` (task version 3.0)
and `gsm8k.yaml` (task version 3.0), its few-shot samplers (`lm_eval/api/samplers.py`) and
context building (`lm_eval/api/task.py`), with lm-eval's defaults where a config says nothing:

- A prompt is the few-shot examples, each `doc_to_text + " " + target + "\\n\\n"` (lm-eval's
  target_delimiter and fewshot_delimiter), then the test question's `doc_to_text`; no description.
- `gsm8k_cot`: `doc_to_text` = "Q: {question}\\nA:", few-shot examples = the 8 chain-of-thought
  exemplars of the config taken in order (`sampler: first_n`), so `--num-fewshot n` is the first n
  (lm-eval's default is all 8; ours is 3, as Ouro reports GSM8K). Reference = the text after
  "####", stripped. Stops "Q:", "</s>", "<|im_end|>".
- `gsm8k`: `doc_to_text` = "Question: {question}\\nAnswer:", 5 examples drawn from the train split
  by lm-eval's default sampler: one `random.Random(1234)` (the default `--fewshot_random_seed`)
  shared by all test documents in order, each drawing `rnd.sample(train_docs, k)`. This is
  reproduced exactly (Python's `random` is deterministic across versions and platforms) when the
  train split is the full `openai/gsm8k` train split in its order (7,473 problems) and the
  evaluation starts at test document 0, as lm-eval does (`--limit` keeps the first N). The
  example target is the whole worked answer; the reference is the whole answer too (the metric's
  `(?s).*#### ` drops all but the number). Stops "Question:", "</s>", "<|im_end|>".
- Both: greedy, at most 256 new tokens (lm-eval's `max_gen_toks` default; neither config sets
  it); filters strict-match and flexible-extract (each [regex, take_first]); exact_match with
  ignore_case, without ignore_punctuation, ignoring `,`, `\\$`, `(?s).*#### ` and `\\.$`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from rlt_engine.eval.data import Doc
from rlt_engine.eval.scoring import ExactMatch, RegexFilter

LM_EVAL_VERSION = "lm-evaluation-harness 0.4.x (gsm8k_cot and gsm8k task configs, version 3.0)"
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
MAX_GEN_TOKS = 256
FEWSHOT_SEED = 1234

# The chain-of-thought exemplars of gsm8k_cot (Wei et al. 2022), in the config's order.
COT_EXEMPLARS: tuple[tuple[str, str], ...] = (
    (
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. "
        "After they are done, there will be 21 trees. How many trees did the grove workers plant "
        "today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. "
        "So there must have been 21 - 15 = 6. The answer is 6.",
    ),
    (
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the "
        "parking lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.",
    ),
    (
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they "
        "have left in total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. "
        "After eating 35, they had 74 - 35 = 39. The answer is 39.",
    ),
    (
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How "
        "many lollipops did Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave "
        "Denny 20 - 12 = 8. The answer is 8.",
    ),
    (
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many "
        "toys does he have now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 "
        "more toys. 5 + 4 = 9. The answer is 9.",
    ),
    (
        "There were nine computers in the server room. Five more computers were installed each "
        "day, from monday to thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. So "
        "5 * 4 = 20 computers were added. 9 + 20 is 29. The answer is 29.",
    ),
    (
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 "
        "more. How many golf balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. "
        "After losing 2 more, he had 35 - 2 = 33 golf balls. The answer is 33.",
    ),
    (
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she "
        "has 23 - 15 dollars left. 23 - 15 is 8. The answer is 8.",
    ),
)

FLEXIBLE_EXTRACT = RegexFilter("flexible-extract", r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
EXACT_MATCH = ExactMatch(
    regexes_to_ignore=(",", r"\$", r"(?s).*#### ", r"\.$"),
    ignore_case=True,
    ignore_punctuation=False,
)

Shot = tuple[str, str]  # (question, target) of one few-shot example


@dataclass(frozen=True)
class Task:
    """One lm-eval GSM8K task: prompts, stops and scoring."""

    name: str
    question_template: str  # doc_to_text, with {question}
    stop: tuple[str, ...]
    filters: tuple[RegexFilter, ...]
    default_num_fewshot: int
    uses_train_split: bool  # few-shot examples drawn from the train split (else fixed exemplars)
    metric: ExactMatch = EXACT_MATCH
    max_gen_toks: int = MAX_GEN_TOKS

    @property
    def filter_names(self) -> list[str]:
        return [f.name for f in self.filters]

    def doc_to_text(self, question: str) -> str:
        return self.question_template.format(question=question)

    def reference(self, doc: Doc) -> str:
        if self.uses_train_split:
            return doc.answer
        return doc.answer.split("####")[-1].strip()

    def render(self, shots: Sequence[Shot], question: str) -> str:
        examples = "".join(
            self.doc_to_text(q) + TARGET_DELIMITER + target + FEWSHOT_DELIMITER
            for q, target in shots
        )
        return examples + self.doc_to_text(question)

    def check_num_fewshot(self, num_fewshot: int, train_size: int | None) -> None:
        limit = train_size if self.uses_train_split else len(COT_EXEMPLARS)
        if num_fewshot < 0 or (limit is not None and num_fewshot > limit):
            where = "train problems" if self.uses_train_split else "exemplars"
            raise ValueError(
                f"num_fewshot must lie in [0, {limit}] for {self.name} ({limit} {where}), "
                f"got {num_fewshot}"
            )

    def prompts(
        self,
        docs: Sequence[Doc],
        num_fewshot: int,
        train: Sequence[Doc] | None = None,
        fewshot_seed: int = FEWSHOT_SEED,
    ) -> list[str]:
        """The prompt of every document, in order (the seeded sampler draws in this order)."""
        if not self.uses_train_split:
            self.check_num_fewshot(num_fewshot, None)
            shots = list(COT_EXEMPLARS[:num_fewshot])  # sampler first_n
            return [self.render(shots, doc.question) for doc in docs]
        if num_fewshot and not train:
            raise ValueError(f"{self.name} draws its few-shot examples from the train split")
        self.check_num_fewshot(num_fewshot, len(train) if train is not None else 0)
        sampler = SeededSampler(train or [], fewshot_seed)
        return [self.render(sampler.shots(doc, num_fewshot), doc.question) for doc in docs]

    def score(self, response: str, doc: Doc) -> dict[str, tuple[str, bool]]:
        """Every filter's extracted answer and whether exact_match counts it correct."""
        reference = self.reference(doc)
        scores = {}
        for f in self.filters:
            answer = f([response])
            scores[f.name] = (answer, self.metric(answer, reference))
        return scores


class SeededSampler:
    """lm-eval's default few-shot sampler: one seeded `random.Random` shared by all documents,
    each drawing k train documents with `rnd.sample`, less the document itself if drawn."""

    def __init__(self, train: Sequence[Doc], seed: int = FEWSHOT_SEED) -> None:
        self.train = list(train)
        self.rnd = random.Random(seed)

    def shots(self, doc: Doc, k: int) -> list[Shot]:
        if k == 0:
            return []  # lm-eval draws nothing without few-shot examples
        drawn = [d for d in self.rnd.sample(self.train, k) if d != doc][:k]
        return [(d.question, d.answer) for d in drawn]


GSM8K_COT = Task(
    name="gsm8k_cot",
    question_template="Q: {question}\nA:",
    stop=("Q:", "</s>", "<|im_end|>"),
    filters=(RegexFilter("strict-match", r"The answer is (\-?[0-9\.\,]+)."), FLEXIBLE_EXTRACT),
    default_num_fewshot=3,
    uses_train_split=False,
)
GSM8K = Task(
    name="gsm8k",
    question_template="Question: {question}\nAnswer:",
    stop=("Question:", "</s>", "<|im_end|>"),
    filters=(RegexFilter("strict-match", r"#### (\-?[0-9\.\,]+)"), FLEXIBLE_EXTRACT),
    default_num_fewshot=5,
    uses_train_split=True,
)
TASKS: dict[str, Task] = {task.name: task for task in (GSM8K_COT, GSM8K)}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r} (choose from {', '.join(TASKS)})") from None


def after_reasoning(text: str) -> str:
    """The answer part of a Thinking model's output: what follows the last `</think>`."""
    return text.rsplit("</think>", 1)[-1]
