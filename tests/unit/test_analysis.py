"""Analysis of rollout dumps on hand-made dump files: the numbers it prints are the right ones."""

import pytest

from opsd.dumps.analysis import format_report, load_rollouts, paired_difference, position_bins, summarize, write_plots
from opsd.dumps.record import dump_path, write_rollouts


def row(step, index, ids, divergence, *, answer=None, predicted=None, sample_id=None):
    n = len(ids)
    return {
        "step": step, "rank": 0, "index": index, "sample_id": sample_id or f"s{index}", "prompt": "p",
        "teacher_prompt": "tp", "images": [], "teacher_images": [], "answer": answer, "predicted_answer": predicted,
        "correct": None if answer is None else predicted == answer,
        "completion_ids": ids, "completion_tokens": [chr(ord("a") + i - 1) for i in ids],
        "completion_text": "", "num_tokens": n, "engine_logprobs": [-1.0] * n, "student_logprobs": [-1.0] * n,
        "teacher_logprobs": [-2.0] * n, "divergence": divergence,
    }


@pytest.fixture
def dump_dir(tmp_path):
    write_rollouts(dump_path(tmp_path / "a", 1, 0), [
        row(1, 0, [1, 2, 3], [0.1, 0.2, 0.3], answer="4", predicted="4"),
        row(1, 1, [1, 4], [0.5, 0.1], answer="4"),
    ])
    write_rollouts(dump_path(tmp_path / "a", 2, 0), [row(2, 0, [2], [1.0])])
    return tmp_path / "a"


def test_position_bins_double():
    assert position_bins(9) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16)]


def test_summary_numbers(dump_dir):
    s = summarize(load_rollouts(dump_dir), top=3)
    assert (s["steps"], s["completions"], s["tokens"]) == ([1, 2], 3, 6)
    assert s["divergence"]["mean"] == pytest.approx(2.2 / 6) and s["divergence"]["max"] == pytest.approx(1.0)
    assert s["accuracy"] == {"with_answer": 2, "answered": 1, "correct": 1, "accuracy": 0.5}
    assert [(b["lo"], b["tokens"]) for b in s["by_position"]] == [(0, 3), (1, 2), (2, 1)]
    assert [b["divergence"] for b in s["by_position"]] == pytest.approx([1.6 / 3, 0.15, 0.3])
    assert s["top_tokens"][0]["token"] == "b" and s["top_tokens"][0]["share"] == pytest.approx(1.2 / 2.2)
    top = s["top_contexts"][0]
    assert (top["step"], top["position"], top["token"], top["context"]) == (2, 0, "b", "")
    third = s["top_contexts"][2]  # 0.3 at position 2 of [a b c]
    assert (third["context"], third["token"], third["divergence"]) == ("ab", "c", pytest.approx(0.3))
    assert s["logprob_gap"]["mean"] == pytest.approx(-1.0) and s["engine_mismatch"]["max"] == 0
    assert [(p["step"], p["tokens"]) for p in s["per_step"]] == [(1, 5), (2, 1)]
    assert s["per_step"][0]["divergence"] == pytest.approx(1.2 / 5) and s["per_step"][1]["accuracy"] is None


def test_run_directory_with_rollouts_subdir_is_found(tmp_path, dump_dir):
    (tmp_path / "run").mkdir()
    dump_dir.rename(tmp_path / "run" / "rollouts")
    assert load_rollouts(tmp_path / "run").rows.num_rows == 3
    with pytest.raises(FileNotFoundError, match="no step_"):
        load_rollouts(tmp_path)


def test_paired_difference_uses_identical_completions_only(tmp_path, dump_dir):
    write_rollouts(dump_path(tmp_path / "b", 1, 0), [
        row(1, 0, [1, 2, 3], [0.2, 0.3, 0.4]),
        row(1, 1, [1, 4], [0.6, 0.2]),
    ])
    write_rollouts(dump_path(tmp_path / "b", 2, 0), [row(2, 0, [3], [0.0])])  # another completion
    a, b = load_rollouts(dump_dir), load_rollouts(tmp_path / "b")
    paired = paired_difference(a, b)
    assert (paired["completions"], paired["tokens"]) == (2, 5)
    assert paired["divergence_diff_mean"] == pytest.approx(0.1) and paired["b_higher_fraction"] == 1.0
    report = format_report([summarize(a), summarize(b)], paired)
    assert "paired tokens (b - a" in report and "divergence mean" in report and "positions" in report


def test_plots_are_written(tmp_path, dump_dir):
    r = load_rollouts(dump_dir)
    paths = write_plots([r], [summarize(r)], tmp_path / "plots")
    assert [p.name for p in paths] == ["divergence_by_position.png", "divergence_histogram.png", "divergence_over_steps.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_rollouts(dump_path(tmp_path / "one", 5, 0), [row(5, 0, [1, 2], [0.1, 0.2])])
    one = load_rollouts(tmp_path / "one")
    assert len(write_plots([one], [summarize(one)], tmp_path / "one-plots")) == 2  # no trend from one step
