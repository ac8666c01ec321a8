"""`teacher.mode: model`: another model with the student's tokenizer scores the teacher prompts.

Its config, the compatibility check that runs before any weights load (one `error:` line naming
what differs), a teacher whose LM head has padding rows the student lacks (scored over the
student's rows, and trained with), and a checkpoint that records the teacher's path and
fingerprint instead of its weights (a resume with another teacher is refused)."""

import json
import time

import pytest
import torch
from transformers import AutoConfig

import opsd.train
from opsd.config import ConfigError, JsdLossConfig, ModelConfig, OptimConfig, TeacherConfig, load_config
from opsd.loss_kinds import build_loss
from opsd.modeling import load_processor
from opsd.scoring import Scoring
from opsd.teacher import ModelTeacher, VocabView, check_compatible, compatibility_difference, make_teacher
from opsd.tiny_models import build_tiny_text_model, build_tokenizer
from opsd.trainer.checkpoint import CheckpointError, TrainingParts, load_checkpoint, save_checkpoint
from opsd.trainer.optim import build_optimizer, build_scheduler
from opsd.trainer.step import TrainStep
from tests.helpers.examples import text_examples, text_model


def demo(*overrides):
    return load_config("configs/demo.yaml", list(overrides))


def test_the_model_mode_needs_a_path_and_its_fields_belong_to_it():
    cfg = demo("teacher={mode: model, path: some/teacher}")
    assert (cfg.teacher.mode, cfg.teacher.path, cfg.teacher.dtype) == ("model", "some/teacher", "float32")
    with pytest.raises(ConfigError, match="teacher.mode=model needs teacher.path"):
        demo("teacher.mode=model")
    with pytest.raises(ConfigError, match="teacher.path is a setting of teacher.mode=model, not of ema"):
        demo("teacher={mode: ema, path: some/teacher}")
    with pytest.raises(ConfigError, match="teacher.dtype=bfloat16 needs model.dtype=bfloat16"):
        demo("teacher={mode: model, path: t, dtype: bfloat16}")
    assert demo("teacher={mode: model, path: t, dtype: bfloat16}", "model.dtype=bfloat16").teacher.dtype == "bfloat16"


def processor_and_config(path):
    return load_processor(ModelConfig(path=str(path))), AutoConfig.from_pretrained(path)


def difference(student_dir, teacher_dir):
    """What `compatibility_difference` finds between two model directories (None: nothing)."""
    return compatibility_difference(*processor_and_config(student_dir)[:1], *processor_and_config(teacher_dir)[:1],
                                    AutoConfig.from_pretrained(student_dir), AutoConfig.from_pretrained(teacher_dir))


def test_a_larger_model_with_the_same_tokenizer_and_processor_is_compatible(tiny_vlm_dir, tiny_vlm_large_dir,
                                                                             tiny_text_dir, padded_text_dir):
    assert difference(tiny_vlm_dir, tiny_vlm_large_dir) is None
    assert difference(tiny_text_dir, padded_text_dir) is None  # more rows: scored over the student's
    # The other way round the student could sample ids the teacher has no row for.
    assert "fewer than the student's" in difference(padded_text_dir, tiny_text_dir)


def tiny_text_with(tmp_path, name, **tokenizer):
    """The tiny text model with another tokenizer (`build_tokenizer`'s settings)."""
    out = build_tiny_text_model(tmp_path / name)
    build_tokenizer(**tokenizer).save_pretrained(out)
    return out


def test_what_differs_is_named(tmp_path, tiny_text_dir, tiny_vlm_dir):
    student, config = processor_and_config(tiny_text_dir)
    other_vocab = processor_and_config(tiny_text_with(tmp_path, "vocab", vocab_size=600))[0]
    assert compatibility_difference(student, other_vocab, config, config).startswith("token ")
    other_template = processor_and_config(tiny_text_with(tmp_path, "template", template="{{ messages[0]['content'] }}"))[0]
    assert compatibility_difference(student, other_template, config, config).startswith("chat template (first at character 1: ")
    vlm = processor_and_config(tiny_vlm_dir)
    kinds = "the teacher is a vision-language model, the student a text model"
    assert compatibility_difference(student, vlm[0], config, vlm[1]) == kinds
    # A VLM teacher that cuts images into other inputs: the processor setting is named.
    bigger = load_processor(ModelConfig(path=str(tiny_vlm_dir)))
    bigger.image_processor.size = {"longest_edge": 112}
    assert compatibility_difference(vlm[0], bigger, vlm[1], vlm[1]).startswith("processor setting['image_processor']['size']")


def test_a_teacher_with_another_tokenizer_stops_the_run_in_seconds_with_one_line(tmp_path, tiny_text_dir, capsys):
    other = tiny_text_with(tmp_path, "other", vocab_size=600)  # the same model, another vocabulary
    capsys.readouterr()
    started = time.perf_counter()
    status = opsd.train.main(["--config", "configs/demo.yaml", f"model.path={tiny_text_dir}", "data.path=nowhere",
                              f"logging.output_dir={tmp_path / 'run'}", f"teacher={{mode: model, path: {other}}}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and time.perf_counter() - started < 30
    assert len(err) == 1 and err[0].startswith(f"error: teacher.path {other} does not share the student's tokenizer")
    assert "token " in err[0] and err[0].endswith("cross-tokenizer distillation is not supported")
    with pytest.raises(ConfigError, match="cross-tokenizer"):  # the same check, called directly
        check_compatible(load_processor(ModelConfig(path=str(tiny_text_dir))), ModelConfig(path=str(tiny_text_dir)),
                         TeacherConfig(mode="model", path=str(other)))


def test_a_padded_lm_head_is_scored_over_the_students_vocabulary_and_trains(tiny_text_dir, padded_text_dir):
    student, processor = text_model(tiny_text_dir)
    teacher = make_teacher(TeacherConfig(mode="model", path=str(padded_text_dir)), student)
    assert isinstance(teacher, ModelTeacher) and isinstance(teacher.scorer, VocabView)
    rows = student.get_output_embeddings().weight.shape[0]
    assert teacher.module.get_output_embeddings().weight.shape[0] == rows + 64
    assert not teacher.module.training and not any(p.requires_grad for p in teacher.module.parameters())
    before = {n: p.clone() for n, p in teacher.module.named_parameters()}

    scoring = Scoring(build_loss(JsdLossConfig(top_k=0)), micro_batch_size=2, pad_id=processor.pad_token_id)
    examples = text_examples(processor, [5, 7])
    scored = scoring.micro_batch(student, teacher.scorer, examples)
    assert scored.teacher_logits.shape == scored.student_logits.shape == (12, rows)
    optimizer = build_optimizer(OptimConfig(lr=1e-2), student)
    metrics = TrainStep(student, teacher.scorer, optimizer, scoring, 1.0)(examples)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["loss"] > 0
    assert all(torch.equal(p, before[n]) for n, p in teacher.module.named_parameters())  # frozen
    assert all(id(p) not in {id(q) for q in teacher.module.parameters()} for g in optimizer.param_groups for p in g["params"])


def model_teacher_parts(student_dir, teacher_dir):
    student, processor = text_model(student_dir)
    teacher = make_teacher(TeacherConfig(mode="model", path=str(teacher_dir)), student)
    optimizer = build_optimizer(OptimConfig(), student)
    return TrainingParts(student, teacher, optimizer, build_scheduler(OptimConfig(), optimizer, 10), processor)


def test_a_checkpoint_records_the_teacher_and_a_resume_with_another_is_refused(tmp_path, tiny_text_dir, padded_text_dir):
    parts = model_teacher_parts(tiny_text_dir, padded_text_dir)
    path = save_checkpoint(tmp_path / "run", 1, parts, {"step": 1})
    manifest = json.loads((path / "opsd_checkpoint.json").read_text())
    assert manifest["teacher"] == {"path": str(padded_text_dir), "fingerprint": parts.teacher.fingerprint}
    assert not (path / "teacher").exists()  # no copy of its weights
    assert load_checkpoint(path, model_teacher_parts(tiny_text_dir, padded_text_dir))["step"] == 1

    other = build_tiny_text_model(tmp_path / "other-teacher", seed=2, large=True, extra_vocab_rows=64)  # other weights
    refused = rf"teacher.path={padded_text_dir} \(fingerprint .* resume with the run's own teacher"
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint(path, model_teacher_parts(tiny_text_dir, other))
