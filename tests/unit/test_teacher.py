"""The teacher: the live student, a frozen copy, or an EMA that moves by (1 - decay) each step."""

import torch

from opsd.config import TeacherConfig
from opsd.teacher import make_teacher, update_teacher


def student():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def move(model, by=1.0):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def test_self_teacher_is_the_student():
    s = student()
    assert make_teacher(TeacherConfig(mode="self"), s) is s


def test_fixed_teacher_is_a_frozen_copy_that_stays():
    s = student()
    teacher = make_teacher(TeacherConfig(mode="fixed"), s)
    before = [p.clone() for p in teacher.parameters()]
    move(s)
    update_teacher(TeacherConfig(mode="fixed"), teacher, s)
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters()))
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training


def test_ema_teacher_moves_toward_the_student_by_one_minus_decay():
    cfg = TeacherConfig(mode="ema", ema_decay=0.9)
    s = student()
    teacher = make_teacher(cfg, s)
    before = [p.clone() for p in teacher.parameters()]
    move(s, by=1.0)
    update_teacher(cfg, teacher, s)
    for old, new, current in zip(before, teacher.parameters(), s.parameters()):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * current.detach())
