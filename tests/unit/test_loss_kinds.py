"""The loss kinds as objects: each says what it uses, what it logs and how it weighs its parts; the
step, the plan line and the run summary ask it and never compare `loss.kind`."""

import pytest
import torch

from opsd.config import JsdLossConfig, SftLossConfig, TinkerLossConfig, load_config
from opsd.loss import GuardrailSums
from opsd.loss_kinds import DISTILL_METRICS, build_loss
from opsd.train import describe_plan
from opsd.trainer.summary import what_it_showed


def test_each_kind_declares_what_it_needs_and_logs():
    jsd, tinker, sft = build_loss(JsdLossConfig()), build_loss(TinkerLossConfig()), build_loss(SftLossConfig())
    assert (jsd.metric, tinker.metric, sft.metric) == ("jsd", "tinker_loss", None)  # sft logs no `distill` key
    assert jsd.needs_teacher and tinker.needs_teacher and not sft.needs_teacher
    assert jsd.on_policy and tinker.on_policy and not sft.on_policy
    # Teacher top-k mass and clip share mean something only for the kind that truncates and clips.
    assert jsd.guardrail_names == ("teacher_topk_mass", "clip_fraction", "student_entropy")
    assert tinker.guardrail_names == sft.guardrail_names == ("student_entropy",)
    assert sft.weights == (0.0, 1.0) and tinker.weights == (1.0, 0.0)
    assert DISTILL_METRICS == {"jsd": False, "tinker_loss": True, "grpo_loss": True}


def test_sft_scores_no_distillation_term_and_no_teacher_guardrails():
    sft = build_loss(SftLossConfig())
    logits = torch.randn(5, 11)
    assert torch.equal(sft.distill(logits, logits, torch.arange(5), torch.zeros(5)), torch.zeros(5))
    sums = GuardrailSums()
    sft.distill(logits, logits, torch.arange(5), torch.zeros(5), guardrails=sums)
    assert sums.clip_candidates == 0 and sums.teacher_topk_mass == 0  # no teacher, no clip: nothing of its own


@pytest.mark.parametrize("override, line", [
    ([], "loss jsd: jsd x1.0 + ce x0.0, beta=0.5, T=1.0, top_k=64, clip=0.05 (entry)"),
    (["loss={kind: tinker, temperature: 2.0}"], "loss tinker: tinker x1.0 + ce x0.0, T=2.0"),
    (["loss={kind: sft}", "prompts.privileged=[text]"], "loss sft: ce x1.0 on the privileged text (no sampling, no teacher)"),
])
def test_the_plan_line_prints_only_the_settings_the_kind_uses(override, line):
    plan = describe_plan(load_config("configs/smoke.yaml", override)).splitlines()
    assert f"  {line}" in plan


def test_a_loss_that_can_be_negative_is_summarised_by_its_change_not_a_percentage():
    line = what_it_showed({"tinker_loss": {"first": -3.32, "first_step": 1, "last": -2.88, "last_step": 20}})
    assert line == "tinker_loss went -3.32 -> -2.88 (+0.44) from step 1 to 20"
    assert "%" not in line and "rose" not in line
