"""Examples (student and teacher prompts around one completion) of the tiny text model, without an engine."""

import torch
from PIL import Image

from opsd.config import ModelConfig, PromptConfig
from opsd.data.sample import Sample
from opsd.modeling import load_model, load_processor
from opsd.prompts import student_prompt, teacher_prompt
from opsd.sequences import Example, encode_prompt


def text_model(model_dir):
    """(model, processor) of a tiny text model in float32 on the CPU."""
    cfg = ModelConfig(path=str(model_dir))
    processor = load_processor(cfg)
    return load_model(cfg, processor, torch.device("cpu")), processor


def text_examples(processor, lengths: list[int], seed: int = 0, pictures: bool = False) -> list[Example]:
    """One example per completion length: question i, a worked solution for the teacher only, and
    random completion ids (with made-up engine logprobs). `pictures`: the student's prompt also holds
    a picture and the teacher's a second, privileged one (for a vision-language model)."""
    generator = torch.Generator().manual_seed(seed)
    cfg = PromptConfig(privileged=["text", "images"] if pictures else ["text"])
    examples = []
    for i, length in enumerate(lengths):
        images = [Image.new("RGB", (32, 32), (40 * i, 90, 200))] if pictures else []
        privileged = [Image.new("RGB", (32, 32), (200, 40 * i, 20))] if pictures else []
        sample = Sample(id=f"s{i}", question=f"What is {i} + {2 * i}?", images=images, privileged_images=privileged,
                        privileged_text=f"{i} + {2 * i} = {3 * i}.", answer=str(3 * i))
        student = encode_prompt(processor, student_prompt(sample, processor, cfg))
        teacher = encode_prompt(processor, teacher_prompt(sample, processor, cfg))
        ids = torch.randint(10, 200, (length,), generator=generator).tolist()
        logprobs = (-torch.rand(length, generator=generator)).tolist()
        examples.append(Example(sample.id, student, teacher, ids, logprobs))
    return examples
