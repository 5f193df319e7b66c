"""Accuracy evaluation (`rlt eval`): GSM8K prompts and scoring as lm-evaluation-harness 0.4.x
defines them (`gsm8k`), data loading (`data`), the loops x exit-threshold sweep (`runner`) over
the in-process engine or an OpenAI-compatible server (`backends`), per-question records
(`records`), results with intervals (`results`) and the reports (`report`, `plot`).
docs/eval.md describes the command."""
