"""Evaluation: answer extraction, normalisation, accuracy with both prompts, greedy decoding."""

import pytest
import torch

from opsd.config import EvalConfig, ModelConfig, PromptConfig
from opsd.data.sample import Sample
from opsd.evaluation import eval_due, evaluate, extract_answer, is_correct, normalise_answer
from opsd.rollout.engine import Completion, EngineCapabilities, SamplingSettings


@pytest.mark.parametrize(
    "text, pattern, expected",
    [
        ("<think>2+2</think><answer> 4 </answer>", r"<answer>(.*?)</answer>", " 4 "),
        ("<answer>3</answer> wait <answer>5</answer>", r"<answer>(.*?)</answer>", "5"),  # the last one
        ("<answer>multi\nline</answer>", r"<answer>(.*?)</answer>", "multi\nline"),
        ("no tags here", r"<answer>(.*?)</answer>", None),
        ("12 + 30 = 42. The answer is 42.", r"-?\d+", "42"),  # no group: the whole match
    ],
)
def test_extract_answer(text, pattern, expected):
    assert extract_answer(text, pattern) == expected


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("Left", "left", True), (" up. ", "up", True), ("1,000", "1000", True), ("12.0", "12", True),
        ("\\boxed{7}", "7", True), ("**right**", "right", True), ("12", "13", False), ("up", "down", False),
        ("3 apples", "3", False), ("Seven.", "7", True), ("seven", "SEVEN", True), ("7", "seven", True),
        ("twenty", "20", True), ("one", "11", False), ("seventy", "70", False), ("the one", "1", False),
    ],
)
def test_normalised_exact_match(a, b, same):
    assert (normalise_answer(a) == normalise_answer(b)) is same


def test_is_correct_needs_an_extracted_answer():
    pattern = EvalConfig().answer_pattern
    assert is_correct("<answer>Right.</answer>", "right", pattern)
    assert not is_correct("right", "right", pattern)  # no <answer> tags: no answer


def test_eval_schedule():
    cfg = EvalConfig(every=10)
    assert [s for s in range(1, 26) if eval_due(s, cfg, 25)] == [10, 20, 25]
    assert not any(eval_due(s, EvalConfig(every=0), 25) for s in range(1, 26))


class ScriptedEngine:
    """Answers by prompt: a teacher prompt (it holds the reference answer) and question q0 answer right."""

    capabilities = EngineCapabilities()

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(sampling)
        out = []
        for i, p in reversed(list(enumerate(prompts))):  # out of order: evaluate must not rely on it
            text = "<answer>4</answer>" if "Reference answer: 4" in p.text or "q0" in p.text else "<answer>5</answer>"
            out.append(Completion(prompt_index=i, token_ids=[1], logprobs=[0.0], text=text))
        return out


def test_evaluate_reports_student_and_teacher_accuracy(tiny_text_dir):
    from opsd.modeling import load_processor

    processor = load_processor(ModelConfig(path=str(tiny_text_dir)))
    samples = [Sample(id=str(i), question=f"q{i}", images=[], privileged_images=[], answer="4") for i in range(4)]
    engine = ScriptedEngine()
    cfg = EvalConfig(every=1, max_new_tokens=7, with_teacher_prompt=True)
    metrics = evaluate(engine, samples, processor, PromptConfig(privileged=["answer"]), cfg)
    assert metrics["eval/accuracy"] == 0.25 and metrics["eval/teacher_accuracy"] == 1.0
    assert metrics["eval/answered"] == 1.0 and metrics["eval/num_samples"] == 4
    # The documented call: greedy, one completion per prompt, whatever the rollout samples.
    assert all(s.temperature == 0 and s.n == 1 and s.top_k == 0 and s.top_p == 1 and s.max_new_tokens == 7 for s in engine.calls)
    assert len(engine.calls) == 1  # student and teacher prompts in one engine call


def test_without_privileged_information_each_prompt_is_generated_once(tiny_text_dir):
    from opsd.modeling import load_processor

    processor = load_processor(ModelConfig(path=str(tiny_text_dir)))
    samples = [Sample(id=str(i), question=f"q{i}", images=[], privileged_images=[], answer="4") for i in range(3)]
    prompted = []
    engine = ScriptedEngine()
    engine.generate = lambda prompts, sampling: prompted.extend(prompts) or ScriptedEngine.generate(engine, prompts, sampling)
    cfg = EvalConfig(every=1, max_new_tokens=7, with_teacher_prompt=True)
    metrics = evaluate(engine, samples, processor, PromptConfig(privileged=[], transition=""), cfg)
    assert len(prompted) == 3 and len({p.text for p in prompted}) == 3  # the teacher's prompt is the student's
    assert metrics["eval/accuracy"] == metrics["eval/teacher_accuracy"] == 1 / 3


def test_temperature_zero_is_greedy_in_the_hf_engine(tiny_text_dir):
    from opsd.modeling import load_model, load_processor
    from opsd.prompts import student_prompt
    from opsd.rollout.hf_engine import HFEngine

    processor = load_processor(ModelConfig(path=str(tiny_text_dir)))
    model = load_model(ModelConfig(path=str(tiny_text_dir)), processor, torch.device("cpu"))
    engine = HFEngine(model, processor)
    prompt = student_prompt(Sample(id="0", question="How many steps?", images=[], privileged_images=[]), processor, PromptConfig())
    runs = [engine.generate([prompt], SamplingSettings(max_new_tokens=6, temperature=0.0, seed=seed))[0] for seed in (0, 1)]
    assert runs[0].token_ids == runs[1].token_ids  # no randomness
    ids = processor(prompt.text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = model(input_ids=ids).logits[0, -1].argmax().item()
    assert runs[0].token_ids[0] == first


class SummingRanks:
    """Rank `rank` of `world_size`; `sum` records this rank's counts and returns them unchanged."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size, self.sent = rank, world_size, None

    def sum(self, values):
        self.sent = list(values)
        return list(values)


def test_ranks_evaluate_disjoint_shares_that_add_up(tiny_text_dir):
    from opsd.modeling import load_processor

    processor = load_processor(ModelConfig(path=str(tiny_text_dir)))
    samples = [Sample(id=str(i), question=f"q{i}", images=[], privileged_images=[], answer="4") for i in range(5)]
    cfg = EvalConfig(every=1, with_teacher_prompt=True)
    prompt_cfg = PromptConfig(privileged=["answer"])
    single = evaluate(ScriptedEngine(), samples, processor, prompt_cfg, cfg)
    ranks = [SummingRanks(r, 2) for r in range(2)]
    for r in ranks:
        evaluate(ScriptedEngine(), samples, processor, prompt_cfg, cfg, r)
    total = [a + b for a, b in zip(ranks[0].sent, ranks[1].sent)]
    assert total[::2] == [single["eval/accuracy"] * 5, single["eval/teacher_accuracy"] * 5]
    assert ranks[0].sent[1] + ranks[1].sent[1] == 5  # every sample answered once, by one rank
