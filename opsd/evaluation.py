"""Evaluation: greedy answers from the rollout engine, scored by normalised exact match.

Every `eval.every` steps (and after the last) the engine, which holds the current student weights,
answers the fixed evaluation set greedily: one `generate` call with `SamplingSettings.greedy`
(temperature 0, one completion per prompt), whatever the rollout settings. The answer is the last match of `eval.answer_pattern`
in the completion (`<answer>...</answer>` by default); it is right when it equals the reference
answer after normalisation. With `eval.with_teacher_prompt` the same set is also answered from
the teacher's prompt: the gap between the two accuracies is what the privileged information is
worth, i.e. what distillation can hope to move into the student.

Every evaluation also writes what was answered, `<output_dir>/eval/step_{N}.jsonl` (`eval_file`):
one record per item and prompt role, with the completion, the answer extracted from it, the
reference and whether they matched, so an accuracy of 0 can be read item by item.
`python -m opsd.evaluate` (opsd/evaluate.py) runs this same evaluation on a checkpoint or a model.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from opsd.config import EvalConfig, PromptConfig
from opsd.data.sample import Sample
from opsd.device import process_rank
from opsd.prompts import Prompt, placeholder_token_ids, student_prompt, teacher_prompt
from opsd.rollout.engine import SamplingSettings

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")

EVAL_SUBDIR = "eval"
"""Where a run's evaluation records go, under its output directory."""
EVAL_FILE = "step_{step}.jsonl"
"""One evaluation's records (rank R > 0 under torchrun: its share in `step_{step}_rank_{R}.jsonl`)."""
ROLES = {"": "student", "teacher_": "teacher"}
"""Metric prefix -> the `role` of a record."""


def eval_file(output_dir: str | Path, step: int, rank: int = 0) -> Path:
    """`<output_dir>/eval/step_{step}.jsonl`, the records of one evaluation (of this rank's share)."""
    name = EVAL_FILE.format(step=step)
    if rank:
        name = name.replace(".jsonl", f"_rank_{rank}.jsonl")
    return Path(output_dir) / EVAL_SUBDIR / name


def write_records(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def extract_answer(text: str, pattern: str) -> str | None:
    """The last match of `pattern` in `text` (its first group when it has one), or None."""
    matches = list(re.finditer(pattern, text, flags=re.DOTALL))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if last.re.groups else last.group(0)


def normalise_answer(answer: str) -> str:
    """Case, surrounding spaces/markup and final punctuation do not count; numbers compare by
    value ("1,000" = "1000", "12.0" = "12")."""
    text = " ".join(answer.strip().casefold().split())
    text = text.strip("*$`\"' ").rstrip(".!").strip()
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", text)
    if boxed:
        text = boxed.group(1).strip()
    number = text.replace(",", "")
    if _NUMBER.fullmatch(number):
        value = float(number)
        return str(int(value)) if value.is_integer() else str(value)
    return text


def is_correct(completion: str, reference: str, pattern: str) -> bool:
    answer = extract_answer(completion, pattern)
    return answer is not None and normalise_answer(answer) == normalise_answer(reference)


def eval_due(step: int, cfg: EvalConfig, max_steps: int) -> bool:
    return cfg.every > 0 and (step % cfg.every == 0 or step == max_steps)


def generate_once(prompt_lists: list[list[Prompt]], engine, settings: SamplingSettings) -> list[list[str]]:
    """Completions of several prompt lists from one engine call (one batch keeps the engine busy),
    each distinct prompt generated once (without privileged information the teacher's prompt is the
    student's); the texts come back in the lists' shape."""
    def key(prompt: Prompt) -> tuple:
        return (prompt.text, *map(id, prompt.images))

    distinct = {key(p): p for prompts in prompt_lists for p in prompts}
    keys = list(distinct)
    # A tensor-parallel engine samples as a group: every rank of it calls, even with nothing to ask.
    collective = engine.capabilities.generate_is_collective
    completions = engine.generate(list(distinct.values()), settings) if distinct or collective else []
    text_of = {keys[c.prompt_index]: c.text for c in completions}
    return [[text_of[key(p)] for p in prompts] for prompts in prompt_lists]


def evaluate(engine, samples: list[Sample], processor, prompt_cfg: PromptConfig, cfg: EvalConfig, ranks=None,
             records: list[dict] | None = None) -> dict:
    """`eval/accuracy` and `eval/answered` (share of completions with an extractable answer), and the
    same with the teacher's prompt (`eval/teacher_*`) when configured.

    With data-parallel `ranks` (opsd.trainer.distributed.Ranks), each rank answers every
    world_size-th sample with its own engine and the counts are summed: all ranks return the same.
    `records`: one dict per item (this rank's) and role is appended to it: `id`, `role` (student,
    teacher), `completion`, `answer` (extracted, None without a match), `reference`, `correct`.
    """
    t0 = time.perf_counter()
    mine = samples[ranks.rank :: ranks.world_size] if ranks is not None else samples
    settings = SamplingSettings.greedy(cfg.max_new_tokens, placeholder_token_ids(processor))
    roles = [("", student_prompt)] + ([("teacher_", teacher_prompt)] if cfg.with_teacher_prompt else [])
    texts_of_role = generate_once([[render(s, processor, prompt_cfg) for s in mine] for _, render in roles], engine, settings)
    counts = []
    for (prefix, _), texts in zip(roles, texts_of_role):
        judged = [judge(s, t, cfg.answer_pattern, ROLES[prefix]) for s, t in zip(mine, texts, strict=True)]
        counts.append(sum(r["correct"] for r in judged))
        counts.append(sum(r["answer"] is not None for r in judged))
        if records is not None:
            records.extend(judged)
    if ranks is not None:
        counts = ranks.sum(counts)
    metrics = {}
    for (prefix, _), correct, answered in zip(roles, counts[::2], counts[1::2]):
        metrics[f"eval/{prefix}accuracy"] = correct / len(samples)
        metrics[f"eval/{prefix}answered"] = answered / len(samples)
    metrics["eval/num_samples"] = len(samples)
    metrics["time_eval_s"] = time.perf_counter() - t0
    return metrics


def judge(sample: Sample, completion: str, pattern: str, role: str) -> dict:
    """One evaluation record: what was answered for `sample` from the `role`'s prompt, and whether it is right."""
    answer = extract_answer(completion, pattern)
    correct = answer is not None and normalise_answer(answer) == normalise_answer(sample.answer or "")
    return {"id": sample.id, "role": role, "completion": completion, "answer": answer, "reference": sample.answer,
            "correct": correct}


class Evaluator:
    """The run's evaluation set and settings, and its retention probes (`eval.retention`);
    `run_if_due(step, engine, ranks, student)` -> metrics or {}; each evaluation's records go to
    `eval_file(output_dir, step)` (default: `logging.output_dir`)."""

    def __init__(self, cfg, processor, *, check=None, multimodal: bool = True, output_dir: str | Path | None = None):
        from opsd.data.dataset import split_samples
        from opsd.retention import RetentionProbe

        self.samples, counts = split_samples(cfg, cfg.eval.num_samples, split="eval", check=check, multimodal=multimodal)
        self.data_counts = {f"data/eval_{key}": n for key, n in sorted(counts.items())}
        self.processor, self.prompt_cfg, self.cfg, self.max_steps = processor, cfg.prompts, cfg.eval, cfg.train.max_steps
        self.output_dir = Path(output_dir if output_dir is not None else cfg.logging.output_dir)
        self.last_file: Path | None = None
        """The records of the last evaluation (this rank's)."""
        retention = cfg.eval.retention
        self.retention = RetentionProbe.build(retention, processor, cfg.model.dtype) if retention else None

    def run_if_due(self, step: int, engine, ranks=None, student=None) -> dict:
        """With retention probes, `student` is the trainer's model (the text probe scores with it);
        `time_eval_s` covers both, `time_retention_s` the probes alone."""
        if not eval_due(step, self.cfg, self.max_steps):
            return {}
        return self.run(step, engine, ranks, student)

    def run(self, step: int, engine, ranks=None, student=None) -> dict:
        """Evaluate now (due or not), write the records of `step`, return the metrics."""
        records = []
        metrics = {**evaluate(engine, self.samples, self.processor, self.prompt_cfg, self.cfg, ranks, records),
                   **self.data_counts}
        rank = ranks.rank if ranks is not None else process_rank()
        self.last_file = write_records(eval_file(self.output_dir, step, rank), records)
        if self.retention is not None:
            t0 = time.perf_counter()
            metrics.update(self.retention.measure(student, engine, ranks))
            metrics["time_retention_s"] = time.perf_counter() - t0
            metrics["time_eval_s"] += metrics["time_retention_s"]
        return metrics
