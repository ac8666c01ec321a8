"""The teacher modes: the live student, a frozen copy, or an EMA that moves by (1 - decay) each step;
each its own component, asked (never switched on) by the recipe, checkpoints and the memory plan."""

import torch

from opsd.config import TeacherConfig
from opsd.teacher import EmaTeacher, FixedTeacher, SelfTeacher, make_teacher


def student():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def move(model, by=1.0):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def test_self_teacher_is_the_student():
    s = student()
    teacher = make_teacher(TeacherConfig(mode="self"), s)
    assert isinstance(teacher, SelfTeacher) and teacher.scorer is s and teacher.module is None
    assert teacher.train_state() is None and teacher.model_dir(s) is None


def test_fixed_teacher_is_a_frozen_copy_that_stays():
    s = student()
    teacher = make_teacher(TeacherConfig(mode="fixed"), s)
    before = [p.clone() for p in teacher.scorer.parameters()]
    move(s)
    teacher.update(s)
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.scorer.parameters()))
    assert not any(p.requires_grad for p in teacher.module.parameters()) and not teacher.module.training
    assert teacher.model_dir(s) is None and set(teacher.train_state()) == set(s.state_dict())


def test_ema_teacher_moves_toward_the_student_by_one_minus_decay():
    cfg = TeacherConfig(mode="ema", ema_decay=0.9)
    s = student()
    teacher = make_teacher(cfg, s)
    before = [p.clone() for p in teacher.scorer.parameters()]
    move(s, by=1.0)
    teacher.update(s)
    for old, new, current in zip(before, teacher.scorer.parameters(), s.parameters()):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * current.detach())
    assert teacher.model_dir(s) == (teacher.module, "default")  # saved as the checkpoint's teacher/


def test_without_lora_base_means_fixed_and_keeps_its_name():
    teacher = make_teacher(TeacherConfig(mode="base"), student())
    assert type(teacher) is FixedTeacher and teacher.mode == "base"  # the checkpoint manifest's name
    assert type(make_teacher(TeacherConfig(mode="ema"), student())) is EmaTeacher


def test_a_weights_only_start_restarts_a_copy_from_the_student():
    s = student()
    teacher = make_teacher(TeacherConfig(mode="fixed"), s)
    move(s, by=2.0)
    teacher.restart_from(s)
    assert all(torch.equal(a, b) for a, b in zip(teacher.module.parameters(), s.parameters()))
