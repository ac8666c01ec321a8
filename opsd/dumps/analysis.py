"""Summaries and plots of rollout dumps: where along the completion, on which tokens and over which
steps the teacher disagrees with the student.

`load_rollouts(dir)` reads every `step_*_rank_*.parquet` of a dump directory (or of a run's
`rollouts/`); `summarize` turns it into a plain dict; `format_report` prints one run or two side by
side; `write_plots` draws PNGs with matplotlib (object API, Agg canvas: no display needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from opsd.dumps.record import DUMP_FILE, ROLLOUTS_SUBDIR, parse_dump_name

CONTEXT_TOKENS = 8
"""Tokens of completion shown before a high-divergence token."""


def rollout_files(path: str | Path) -> list[Path]:
    """Dump files of a directory (or of its `rollouts/`), ordered by step then rank."""
    path = Path(path)
    pattern = DUMP_FILE.format(step="*", rank="*")
    for folder in (path, path / ROLLOUTS_SUBDIR):
        files = [f for f in folder.glob(pattern) if parse_dump_name(f.name)]
        if files:
            return sorted(files, key=lambda f: parse_dump_name(f.name))
    raise FileNotFoundError(f"no {pattern} files in {path} or {path / ROLLOUTS_SUBDIR}")


@dataclass
class Rollouts:
    """One dump directory: a row per completion, plus the tokens flattened across completions."""

    label: str
    rows: pa.Table
    divergence: np.ndarray  # [T] float64, all tokens of all completions
    student_logprobs: np.ndarray
    teacher_logprobs: np.ndarray
    engine_logprobs: np.ndarray
    token_ids: np.ndarray  # [T]
    row: np.ndarray  # [T] index of the token's completion in `rows`
    position: np.ndarray  # [T] index of the token in its completion

    @property
    def steps(self) -> list[int]:
        return sorted(set(self.rows["step"].to_pylist()))


def _flat(table: pa.Table, name: str, dtype=np.float64) -> np.ndarray:
    return pc.list_flatten(table[name]).to_numpy().astype(dtype)


def load_rollouts(path: str | Path, label: str | None = None) -> Rollouts:
    files = rollout_files(path)
    rows = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
    if rows.num_rows == 0:
        raise ValueError(f"{path}: the dump files hold no completions")
    lengths = rows["num_tokens"].to_numpy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    total = int(lengths.sum())
    return Rollouts(
        label=label or Path(path).name,
        rows=rows,
        divergence=_flat(rows, "divergence"),
        student_logprobs=_flat(rows, "student_logprobs"),
        teacher_logprobs=_flat(rows, "teacher_logprobs"),
        engine_logprobs=_flat(rows, "engine_logprobs"),
        token_ids=_flat(rows, "completion_ids", np.int64),
        row=np.repeat(np.arange(rows.num_rows), lengths),
        position=np.arange(total) - np.repeat(starts, lengths),
    )


def _quantiles(x: np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(x.max())}


def position_bins(max_len: int) -> list[tuple[int, int]]:
    """[lo, hi) bins doubling in width (0, 1, 2-3, 4-7, ...): early positions get the detail."""
    bins, lo = [], 0
    while lo < max_len:
        hi = max(1, 2 * lo)
        bins.append((lo, hi))
        lo = hi
    return bins


def _accuracy(rows: pa.Table) -> dict:
    correct = rows["correct"].to_pylist()
    known = [c for c in correct if c is not None]
    answered = sum(p is not None for p in rows["predicted_answer"].to_pylist())
    return {
        "with_answer": len(known), "answered": answered, "correct": sum(known),
        "accuracy": sum(known) / len(known) if known else None,
    }


def _token_texts(r: Rollouts) -> dict[int, str]:
    ids = pc.list_flatten(r.rows["completion_ids"]).to_pylist()
    texts = pc.list_flatten(r.rows["completion_tokens"]).to_pylist()
    return dict(zip(ids, texts))


def _top_tokens(r: Rollouts, top: int) -> list[dict]:
    """Token ids carrying the largest share of the summed divergence."""
    texts = _token_texts(r)
    ids, inverse = np.unique(r.token_ids, return_inverse=True)
    sums = np.bincount(inverse, weights=r.divergence)
    counts = np.bincount(inverse)
    order = np.argsort(-sums)[:top]
    total = r.divergence.sum() or 1.0
    return [
        {"token": texts[int(ids[i])], "count": int(counts[i]), "mean_divergence": float(sums[i] / counts[i]),
         "share": float(sums[i] / total)}
        for i in order
    ]


def _top_contexts(r: Rollouts, top: int) -> list[dict]:
    """The single token positions with the largest divergence, with the completion text before them."""
    tokens = r.rows["completion_tokens"]
    has_top = "teacher_top_tokens" in r.rows.column_names
    out = []
    for t in np.argsort(-r.divergence)[:top]:
        row, pos = int(r.row[t]), int(r.position[t])
        completion = tokens[row].as_py()
        teacher_top = r.rows["teacher_top_tokens"][row].as_py() if has_top else None
        out.append({
            "step": r.rows["step"][row].as_py(), "sample_id": r.rows["sample_id"][row].as_py(), "position": pos,
            "context": "".join(completion[max(0, pos - CONTEXT_TOKENS) : pos]), "token": completion[pos],
            "divergence": float(r.divergence[t]),
            "student_logprob": float(r.student_logprobs[t]), "teacher_logprob": float(r.teacher_logprobs[t]),
            "teacher_top1": teacher_top[pos][0] if teacher_top and teacher_top[pos] else None,
        })
    return out


def _per_step(r: Rollouts) -> list[dict]:
    steps = r.rows["step"].to_numpy()
    token_steps = steps[r.row]
    out = []
    for step in r.steps:
        rows = r.rows.filter(pc.equal(r.rows["step"], step))
        div = r.divergence[token_steps == step]
        out.append({
            "step": step, "completions": rows.num_rows, "tokens": int(div.size),
            "divergence": float(div.mean()), "completion_len": float(np.mean(rows["num_tokens"].to_numpy())),
            "accuracy": _accuracy(rows)["accuracy"],
        })
    return out


def summarize(r: Rollouts, *, top: int = 10) -> dict:
    """Plain-dict summary of one dump directory (see `format_report` for the printed form)."""
    lengths = r.rows["num_tokens"].to_numpy()
    gap = r.teacher_logprobs - r.student_logprobs
    mismatch = np.abs(r.student_logprobs - r.engine_logprobs)
    by_position = []
    for lo, hi in position_bins(int(lengths.max())):
        in_bin = (r.position >= lo) & (r.position < hi)
        by_position.append({"lo": lo, "hi": hi, "tokens": int(in_bin.sum()), "divergence": float(r.divergence[in_bin].mean())})
    return {
        "label": r.label,
        "steps": r.steps,
        "completions": r.rows.num_rows,
        "tokens": int(lengths.sum()),
        "completion_len": {k: v for k, v in _quantiles(lengths.astype(np.float64)).items() if k != "p99"},
        "accuracy": _accuracy(r.rows),
        "divergence": _quantiles(r.divergence),
        "logprob_gap": {"mean": float(gap.mean()), "mean_abs": float(np.abs(gap).mean())},
        "engine_mismatch": {"mean": float(mismatch.mean()), "max": float(mismatch.max())},
        "by_position": by_position,
        "top_tokens": _top_tokens(r, top),
        "top_contexts": _top_contexts(r, top),
        "per_step": _per_step(r),
    }


def paired_difference(a: Rollouts, b: Rollouts) -> dict:
    """Per-token differences (b - a) over the completions both dumps hold with identical ids.

    Two dumps sampled with the same weights and seeds (e.g. real vs noise privileged images) have
    the same completions; only the teacher's side then differs, token for token.
    """
    def keyed(r: Rollouts) -> dict:
        keys = zip(r.rows["step"].to_pylist(), r.rows["sample_id"].to_pylist(), r.rows["index"].to_pylist())
        return {k: i for i, k in enumerate(keys)}

    ka, kb = keyed(a), keyed(b)
    ids_a, ids_b = a.rows["completion_ids"], b.rows["completion_ids"]
    pairs = [(ka[k], kb[k]) for k in ka if k in kb and ids_a[ka[k]].as_py() == ids_b[kb[k]].as_py()]
    if not pairs:
        return {"completions": 0, "tokens": 0}
    # a's tokens in a's row order; b's tokens gathered in the same order of pairs.
    mask_a = np.isin(a.row, [i for i, _ in pairs])
    order_b = np.concatenate([np.flatnonzero(b.row == j) for _, j in sorted(pairs)])
    d_div = b.divergence[order_b] - a.divergence[mask_a]
    d_teacher = b.teacher_logprobs[order_b] - a.teacher_logprobs[mask_a]
    return {
        "completions": len(pairs), "tokens": int(order_b.size),
        "divergence_diff_mean": float(d_div.mean()), "divergence_diff_mean_abs": float(np.abs(d_div).mean()),
        "teacher_logprob_diff_mean_abs": float(np.abs(d_teacher).mean()),
        "b_higher_fraction": float((d_div > 0).mean()),
    }


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def _scalar_rows(s: dict) -> list[tuple[str, object]]:
    acc = s["accuracy"]
    return [
        ("steps", ",".join(map(str, s["steps"])) if len(s["steps"]) <= 6 else f"{s['steps'][0]}..{s['steps'][-1]} ({len(s['steps'])})"),
        ("completions", s["completions"]),
        ("tokens", s["tokens"]),
        *[(f"completion_len {k}", v) for k, v in s["completion_len"].items()],
        ("accuracy", f"{acc['correct']}/{acc['with_answer']} ({acc['answered']} answered)" if acc["with_answer"] else None),
        *[(f"divergence {k}", v) for k, v in s["divergence"].items()],
        ("teacher-student logprob mean", s["logprob_gap"]["mean"]),
        ("|teacher-student logprob| mean", s["logprob_gap"]["mean_abs"]),
        ("|engine-student logprob| max", s["engine_mismatch"]["max"]),
    ]


def format_report(summaries: list[dict], paired: dict | None = None) -> str:
    """The printed summary: one column per run for the numbers, then each run's tokens and contexts."""
    labels = [s["label"] for s in summaries]
    lines = ["== summary"]
    scalars = [_scalar_rows(s) for s in summaries]
    lines += _table(["", *labels], [[name, *(col[i][1] for col in scalars)] for i, (name, _) in enumerate(scalars[0])])

    lines += ["", "== mean divergence by completion position"]
    bins = max((s["by_position"] for s in summaries), key=len)
    lookup = [{(b["lo"], b["hi"]): b for b in s["by_position"]} for s in summaries]
    lines += _table(
        ["positions", *(f"{lab} (tokens)" for lab in labels)],
        [[f"{b['lo']}-{b['hi'] - 1}" if b["hi"] - b["lo"] > 1 else str(b["lo"]), *(
            f"{_fmt(lk[(b['lo'], b['hi'])]['divergence'])} ({lk[(b['lo'], b['hi'])]['tokens']})" if (b["lo"], b["hi"]) in lk else "-"
            for lk in lookup)] for b in bins],
    )
    for s in summaries:
        if len(s["per_step"]) > 1:
            lines += ["", f"== {s['label']}: over steps"]
            lines += _table(["step", "completions", "tokens", "divergence", "completion_len", "accuracy"],
                            [[p["step"], p["completions"], p["tokens"], p["divergence"], p["completion_len"], p["accuracy"]]
                             for p in s["per_step"]])
    for s in summaries:
        lines += ["", f"== {s['label']}: tokens with the largest share of the divergence"]
        lines += _table(["token", "count", "mean divergence", "share"],
                        [[repr(t["token"]), t["count"], t["mean_divergence"], t["share"]] for t in s["top_tokens"]])
        lines += ["", f"== {s['label']}: positions with the largest divergence (context ... [token])"]
        lines += _table(["step", "sample", "pos", "divergence", "student lp", "teacher lp", "teacher top-1", "context ... [token]"],
                        [[c["step"], c["sample_id"], c["position"], c["divergence"], c["student_logprob"], c["teacher_logprob"],
                          repr(c["teacher_top1"]) if c["teacher_top1"] is not None else None,
                          f"{c['context']!r} [{c['token']!r}]"] for c in s["top_contexts"]])
    if paired is not None:
        lines += ["", f"== paired tokens ({labels[1]} - {labels[0]}, identical completions)"]
        if paired["completions"]:
            lines += _table(["", "value"], [[k, v] for k, v in paired.items()])
        else:
            lines.append("no completion is identical in both dumps (different weights or sampling seeds)")
    return "\n".join(lines)


def _figure(n_axes: int = 1, width: float = 6.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * n_axes, 3.6), layout="constrained")
    return fig, fig.subplots(1, n_axes, squeeze=False)[0]


def _position_series(runs: list[Rollouts]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(label, positions, divergences): one per run, or one per step for a single run of several steps."""
    if len(runs) == 1 and len(runs[0].steps) > 1:
        r = runs[0]
        token_steps = r.rows["step"].to_numpy()[r.row]
        return [(f"step {s}", r.position[token_steps == s], r.divergence[token_steps == s]) for s in r.steps]
    return [(r.label, r.position, r.divergence) for r in runs]


def plot_divergence_by_position(runs: list[Rollouts], path: Path, max_points: int = 64) -> Path:
    fig, (ax,) = _figure()
    for label, position, divergence in _position_series(runs):
        width = max(1, -(-int(position.max() + 1) // max_points))
        bins = position // width
        sums, counts = np.bincount(bins, weights=divergence), np.bincount(bins)
        keep = counts > 0
        centres = np.flatnonzero(keep) * width + (width - 1) / 2
        ax.plot(centres, sums[keep] / counts[keep], marker=".", label=label)
    ax.set(xlabel="position in completion (tokens)", ylabel="mean per-token divergence", title="Divergence by position")
    ax.legend()
    fig.savefig(path, dpi=80)
    return path


def plot_divergence_histogram(runs: list[Rollouts], path: Path) -> Path:
    fig, (ax,) = _figure()
    edges = np.linspace(0.0, max(float(r.divergence.max()) for r in runs) or 1.0, 51)
    for r in runs:
        ax.hist(r.divergence, bins=edges, alpha=0.5, label=r.label)
    ax.set(xlabel="per-token divergence", ylabel="tokens", yscale="log", title="Per-token divergence")
    ax.legend()
    fig.savefig(path, dpi=80)
    return path


def plot_trends(summaries: list[dict], path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    keys = [("divergence", "mean divergence"), ("completion_len", "mean completion length"), ("accuracy", "accuracy")]
    fig, axes = _figure(len(keys), width=4.0)
    for ax, (key, title) in zip(axes, keys):
        for s in summaries:
            points = [(p["step"], p[key]) for p in s["per_step"] if p[key] is not None]
            if points:
                ax.plot(*zip(*points), marker=".", label=s["label"])
        ax.set(xlabel="step", title=title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].set_ylim(-0.05, 1.05)
    axes[0].legend()
    fig.savefig(path, dpi=80)
    return path


def write_plots(runs: list[Rollouts], summaries: list[dict], out_dir: str | Path) -> list[Path]:
    """divergence_by_position.png, divergence_histogram.png, and divergence_over_steps.png when a
    run holds several steps."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_divergence_by_position(runs, out_dir / "divergence_by_position.png"),
        plot_divergence_histogram(runs, out_dir / "divergence_histogram.png"),
    ]
    if any(len(s["per_step"]) > 1 for s in summaries):
        paths.append(plot_trends(summaries, out_dir / "divergence_over_steps.png"))
    return paths
