"""Per-setting results (Wilson intervals, loops per token, tokens/s) and the `--output-dir`
records that `--resume` continues from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlt_engine.eval.records import RecordsError, RecordWriter, check_output_dir, read_records
from rlt_engine.eval.results import Setting, SettingResult, wilson_interval


def test_wilson_interval() -> None:
    low, high = wilson_interval(0, 20)
    assert low == 0.0 and high == pytest.approx(0.16113, abs=1e-5)
    low, high = wilson_interval(10, 20)
    assert (low, high) == (pytest.approx(0.29929, abs=1e-5), pytest.approx(0.70071, abs=1e-5))
    low, high = wilson_interval(20, 20)
    assert low == pytest.approx(0.83887, abs=1e-5) and high == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def record(index: int, ok: bool, depths: list[int] | None) -> dict:
    return {
        "index": index,
        "prompt": f"p{index}",
        "correct": {"strict-match": ok, "flexible-extract": True},
        "num_tokens": len(depths) if depths else 3,
        "exit_depths": depths,
    }


def test_setting_result_totals() -> None:
    result = SettingResult(Setting(2, 0.7), 3, ["strict-match", "flexible-extract"])
    result.add(record(0, True, [4, 2, 2, 1]), resumed=True)
    result.add(record(1, False, [4, 1]))
    assert result.accuracy("strict-match") == 0.5 and result.accuracy("flexible-extract") == 1.0
    assert result.mean_loops == pytest.approx(14 / 6)
    assert result.output_tokens == 6 and result.run_tokens == 2  # resumed ones do not count
    assert result.tokens_per_second is None  # never started
    summary = result.to_json()
    assert summary["max_loops"] == 2 and summary["exit_threshold"] == 0.7
    assert summary["accuracy"]["strict-match"]["correct"] == 1
    assert Setting(2, 0.7).slug == "loops2-exit0.7" and Setting(None, None).label == (
        "loops=default exit=default"
    )
    no_depths = SettingResult(Setting(None, None), 1, ["strict-match", "flexible-extract"])
    no_depths.add(record(0, True, None))
    assert no_depths.mean_loops is None


def test_records_resume_drops_a_partial_last_line(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    prompts = ["p0", "p1", "p2"]
    writer = RecordWriter(path)
    writer.write(record(0, True, [1]))
    writer.write(record(2, False, [1]))
    writer.close()
    with path.open("a") as f:
        f.write('{"index": 1, "pro')  # killed mid-write
    assert sorted(read_records(path, prompts)) == [0, 2]
    writer = RecordWriter(path)
    writer.write(record(1, True, [1]))
    writer.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 2, 1]
    assert sorted(read_records(path, prompts[:2])) == [0, 1]  # beyond --limit: ignored


def test_records_with_another_prompt_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    RecordWriter(path).write(record(0, True, [1]))
    with pytest.raises(RecordsError, match="another prompt for question 0"):
        read_records(path, ["changed"])


def test_output_dir_refuses_to_mix_runs(tmp_path: Path) -> None:
    manifest = {"task": "gsm8k_cot", "num_fewshot": 3}
    files = [tmp_path / "out" / "a.jsonl"]
    check_output_dir(tmp_path / "out", manifest, files, resume=False)
    with pytest.raises(RecordsError, match=r"already holds run\.json: pass --resume"):
        check_output_dir(tmp_path / "out", manifest, files, resume=False)
    check_output_dir(tmp_path / "out", manifest, files, resume=True)
    with pytest.raises(RecordsError, match="num_fewshot=3, this run has num_fewshot=8"):
        check_output_dir(tmp_path / "out", {**manifest, "num_fewshot": 8}, files, resume=True)
