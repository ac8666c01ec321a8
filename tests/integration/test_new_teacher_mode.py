"""A teacher mode plugs in from outside opsd: a class with the teacher interface in
`opsd.teacher.TEACHERS` and its name in `opsd.config.TEACHER_MODES`, nothing else. The recipe, the
checkpoint and the memory plan ask the class; none of them knows the mode's name."""

import json
import math

import torch

import opsd.config
import opsd.teacher
import opsd.train
from opsd.config import load_config
from opsd.teacher import STUDENT_WEIGHTS, FixedTeacher, frozen_copy
from opsd.trainer.memory_plan import plan_memory
from tests.helpers.runs import read_metrics


class SnapshotTeacher(FixedTeacher):
    """`snapshot`: a frozen copy of the student that takes the student's weights every second step
    (a teacher one to two steps behind, which no built-in mode is). The frozen copy's checkpoint
    share (its tensors in the train state) is `FixedTeacher`'s; the update and the plan row are new."""

    SAVED_WEIGHTS = STUDENT_WEIGHTS  # offline dumps score it with the saved student, at most a step ahead
    built: list["SnapshotTeacher"] = []

    def __init__(self, cfg, student, copy_student=frozen_copy):
        super().__init__(cfg, student, copy_student)
        self.updates = 0
        SnapshotTeacher.built.append(self)

    def update(self, student):
        self.updates += 1
        if self.updates % 2 == 0:
            self.restart_from(student)

    @staticmethod
    def memory_row(memory):
        return memory.copy_bytes, f"a snapshot copy {memory.per}"


def test_a_teacher_mode_written_outside_opsd_trains(tmp_path, tiny_text_dir, monkeypatch):
    monkeypatch.setitem(opsd.teacher.TEACHERS, "snapshot", SnapshotTeacher)
    monkeypatch.setattr(opsd.config, "TEACHER_MODES", (*opsd.config.TEACHER_MODES, "snapshot"))
    monkeypatch.setattr(SnapshotTeacher, "built", [])
    captured = {}
    real_make_teacher = opsd.train.make_teacher

    def capture(cfg, student, *copy_student):
        captured["student"] = student
        return real_make_teacher(cfg, student, *copy_student)

    monkeypatch.setattr(opsd.train, "make_teacher", capture)
    data = f"[{{path: {tmp_path / 'data'}, schema: text, synthetic: {{kind: arithmetic, n_train: 8, n_eval: 0}}}}]"
    cfg = load_config("configs/smoke.yaml", [
        f"model.path={tiny_text_dir}", "data.path=null", "data.synthetic=null", f"data.datasets={data}",
        "prompts.privileged=[text]", f"logging.output_dir={tmp_path / 'run'}", "logging.progress_bar=false",
        "teacher.mode=snapshot", "rollout.engine=hf", "rollout.max_new_tokens=8", "train.max_steps=2",
        "train.prompts_per_micro_step=1", "train.grad_accum_steps=1", "train.max_forward_tokens=512",
        "eval.every=0", "optim.warmup_steps=0",
    ])
    output_dir = opsd.train.train(cfg)

    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["jsd"] > 0 for r in records)
    (teacher,) = SnapshotTeacher.built
    assert teacher.updates == 2  # asked after every step
    student = captured["student"]
    # After step 2 the snapshot holds the student's weights (it lagged a step after step 1).
    assert all(torch.equal(t, s) for t, s in zip(teacher.module.parameters(), student.parameters()))
    manifest = json.loads((output_dir / "checkpoint-2" / "opsd_checkpoint.json").read_text())
    assert manifest["teacher_mode"] == "snapshot" and not (output_dir / "checkpoint-2" / "teacher").exists()

    rows = {item: how for item, _, how in plan_memory(cfg, world_size=1, device_gb=80).rows}
    assert rows["teacher (snapshot)"] == "a snapshot copy (unsharded)"
