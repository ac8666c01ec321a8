"""Student and teacher sequences: identical completion ids at the end, privileged images only in the teacher's."""

import pytest
import torch

from opsd.config import ModelConfig, PromptConfig
from opsd.data.sample import Sample
from opsd.data.synthetic import generate_samples
from opsd.modeling import load_processor
from opsd.prompts import noise_like, student_prompt, teacher_prompt
from opsd.sequences import build_examples, collate, encode_prompt
from opsd.rollout.engine import Completion


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(ModelConfig(path=str(tiny_vlm_dir)))


@pytest.fixture(scope="module")
def sample():
    return generate_samples(1, seed=3)[0]


def test_student_prompt_holds_problem_images_only(processor, sample):
    prompt = student_prompt(sample, processor, PromptConfig())
    assert prompt.images == sample.images
    assert sample.question in prompt.text
    assert PromptConfig().reference_intro not in prompt.text
    assert prompt.text.endswith("<|im_start|>assistant\n")


def test_teacher_prompt_adds_privileged_images_in_order(processor, sample):
    cfg = PromptConfig()
    prompt = teacher_prompt(sample, processor, cfg)
    assert prompt.images == sample.images + sample.privileged_images
    text = prompt.text
    assert text.index(sample.question) < text.index(cfg.reference_intro) < text.index(cfg.transition)
    assert text.count("<image>") == len(prompt.images)
    # The reference privileged channel is visual only.
    assert sample.privileged_text not in text and sample.answer not in text


def test_privileged_text_and_answer_channels(processor, sample):
    cfg = PromptConfig(privileged=["text", "answer"])
    prompt = teacher_prompt(sample, processor, cfg)
    assert prompt.images == sample.images
    assert sample.privileged_text in prompt.text and f"Reference answer: {sample.answer}" in prompt.text


def test_images_after_text_lets_a_picture_end_the_privileged_sentence(processor, sample):
    cfg = PromptConfig(privileged=["text", "images"], privileged_text_intro="Fact:", reference_intro="", transition="",
                       images_after_text=True)
    prompt = teacher_prompt(sample, processor, cfg)
    n = len(sample.privileged_images)
    assert prompt.parts[-n - 1:] == [f"Fact:\n{sample.privileged_text}", *sample.privileged_images]
    assert prompt.images[-n:] == sample.privileged_images
    # The default order is unchanged: the intro and images, then the text.
    default = teacher_prompt(sample, processor, PromptConfig(privileged=["text", "images"]))
    assert default.text.index("<image>", default.text.index(PromptConfig().reference_intro)) < default.text.index(
        PromptConfig().privileged_text_intro)


def test_privileged_before_question_puts_the_question_last(processor, sample):
    cfg = PromptConfig(privileged=["images", "text"], reference_intro="", transition="", privileged_before_question=True)
    prompt = teacher_prompt(sample, processor, cfg)
    n = len(sample.images)
    assert prompt.parts == [*sample.images, *sample.privileged_images,
                            f"{cfg.privileged_text_intro}\n{sample.privileged_text}", sample.question]
    assert prompt.images == sample.images + sample.privileged_images  # the privileged images stay the last ones
    assert prompt.text.index(cfg.privileged_text_intro) < prompt.text.index(sample.question)
    # Noise still lands on the privileged pictures, not the problem's.
    noisy = teacher_prompt(sample, processor, PromptConfig(privileged_before_question=True, noise="normal"))
    assert noisy.noise_last_images == len(sample.privileged_images) and noisy.images[:n] == sample.images
    # With the intro and transition set, both keep their places around the privileged part and the question.
    full = teacher_prompt(sample, processor, PromptConfig(privileged_before_question=True))
    text = full.text
    assert text.index(PromptConfig().reference_intro) < text.index(sample.question) < text.index(PromptConfig().transition)
    # The default still asks the question first.
    assert teacher_prompt(sample, processor, PromptConfig()).parts[n] == sample.question


def test_an_empty_reference_intro_adds_no_text_part(processor, sample):
    prompt = teacher_prompt(sample, processor, PromptConfig(reference_intro="", transition=""))
    assert "" not in [p for p in prompt.parts if isinstance(p, str)]
    assert prompt.parts == [*sample.images, sample.question, *sample.privileged_images]


def test_pixel_noise_ablation_keeps_shape_and_changes_pixels(processor, sample):
    prompt = teacher_prompt(sample, processor, PromptConfig(noise="pixel"))
    noisy = prompt.images[len(sample.images):]
    assert len(noisy) == len(sample.privileged_images) and prompt.noise_last_images == 0
    for real, fake in zip(sample.privileged_images, noisy):
        assert fake.size == real.size and fake.mode == real.mode and fake.tobytes() != real.tobytes()
    assert noise_like(sample.images[0], seed="a").tobytes() == noise_like(sample.images[0], seed="a").tobytes()


def test_normal_noise_ablation_is_fresh_standard_normal_on_model_inputs(processor, sample):
    """The reference ablation: randn on the processor's normalised pixel tensor, new at every use."""
    real = encode_prompt(processor, teacher_prompt(sample, processor, PromptConfig()))
    prompt = teacher_prompt(sample, processor, PromptConfig(noise="normal"))
    assert prompt.noise_last_images == len(sample.privileged_images) > 0
    torch.manual_seed(0)
    first, second = (encode_prompt(processor, prompt).vision["pixel_values"] for _ in range(2))
    n_problem = len(sample.images)  # the tiny VLM makes one [C, H, W] entry per image
    assert first.shape == real.vision["pixel_values"].shape
    assert torch.equal(first[:, :n_problem], real.vision["pixel_values"][:, :n_problem])  # problem images untouched
    noise = first[:, n_problem:]
    assert noise.numel() > 10_000
    assert abs(noise.mean().item()) < 0.02 and abs(noise.std().item() - 1) < 0.02
    assert not torch.equal(noise, second[:, n_problem:])  # fresh at every use
    torch.manual_seed(0)
    assert torch.equal(encode_prompt(processor, prompt).vision["pixel_values"], first)  # from the torch RNG
    # The real privileged images normalise to a quite different spread: the noise is not theirs.
    assert abs(real.vision["pixel_values"][:, n_problem:].std().item() - 1) > 0.1


def test_completion_ids_align_at_the_end_of_both_sequences(processor, sample):
    cfg = PromptConfig()
    student = encode_prompt(processor, student_prompt(sample, processor, cfg))
    teacher = encode_prompt(processor, teacher_prompt(sample, processor, cfg))
    tokenizer = processor.tokenizer
    completion = tokenizer("<think>right, down</think><answer>4</answer>", add_special_tokens=False)["input_ids"]
    completion.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    examples, counts = build_examples([student], [teacher], [sample.id], [Completion(0, completion, [0.0] * len(completion))], 4096)
    assert counts == {"empty_completions": 0, "truncated_completions": 0, "prompt_too_long": 0}

    s_batch = collate([examples[0].student], [completion], tokenizer.pad_token_id)
    t_batch = collate([examples[0].teacher], [completion], tokenizer.pad_token_id)
    for batch, prompt in ((s_batch, student), (t_batch, teacher)):
        ids = batch.inputs["input_ids"][0].tolist()
        assert ids[-len(completion):] == completion and ids[: len(prompt.input_ids)] == prompt.input_ids
        # The positions marked as predicting the completion are exactly the ones before each token.
        predicted = [ids[i + 1] for i in batch.completion_positions.tolist()]
        assert predicted == completion
    assert s_batch.completion_ids.tolist() == t_batch.completion_ids.tolist() == completion
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    assert t_batch.inputs["pixel_values"].shape[1] == 1 + len(sample.privileged_images)
    assert s_batch.inputs["pixel_values"].shape[1] == 1
    assert t_batch.inputs["input_ids"].eq(image_token).sum() > s_batch.inputs["input_ids"].eq(image_token).sum()


def test_truncation_keeps_the_teacher_within_budget(processor, sample):
    cfg = PromptConfig()
    student = encode_prompt(processor, student_prompt(sample, processor, cfg))
    teacher = encode_prompt(processor, teacher_prompt(sample, processor, cfg))
    budget = len(teacher.input_ids) + 5
    long = Completion(0, list(range(10, 30)), [0.0] * 20)
    empty = Completion(0, [], [])
    examples, counts = build_examples([student], [teacher], ["x"], [long, empty], budget)
    assert [len(e.completion_ids) for e in examples] == [5]
    assert counts == {"empty_completions": 1, "truncated_completions": 1, "prompt_too_long": 0}
    examples, counts = build_examples([student], [teacher], ["x"], [long], len(teacher.input_ids))
    assert examples == [] and counts["prompt_too_long"] == 1


def test_batches_pad_images_and_ids(processor):
    samples = generate_samples(3, seed=5)
    cfg = PromptConfig()
    prompts = [encode_prompt(processor, teacher_prompt(s, processor, cfg)) for s in samples]
    batch = collate(prompts, [[5, 6], [7], [8, 9, 10]], processor.tokenizer.pad_token_id)
    counts = [1 + len(s.privileged_images) for s in samples]
    assert batch.inputs["pixel_values"].shape[:2] == (3, max(counts))
    for row, n in enumerate(counts):  # padding images are all zero, so the model drops them
        assert batch.inputs["pixel_values"][row, n:].abs().sum() == 0
    assert batch.completion_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.inputs["attention_mask"].sum(1).tolist() == [len(p.input_ids) + k for p, k in zip(prompts, (2, 1, 3))]


def test_text_model_prompts(tiny_text_dir):
    processor = load_processor(ModelConfig(path=str(tiny_text_dir)))
    sample = Sample(id="t0", question="What is 2 + 3?", images=[], privileged_images=[],
                    privileged_text="2 + 3 = 5", answer="5")
    cfg = PromptConfig(privileged=["text"])
    s, t = student_prompt(sample, processor, cfg), teacher_prompt(sample, processor, cfg)
    assert "2 + 3 = 5" in t.text and "2 + 3 = 5" not in s.text
    assert encode_prompt(processor, s).vision == {}
    with pytest.raises(ValueError, match="no image processor"):
        student_prompt(generate_samples(1)[0], processor, cfg)
