"""Examples (student and teacher prompts around one completion) of the tiny text model, without an engine."""

import torch

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


def text_examples(processor, lengths: list[int], seed: int = 0) -> list[Example]:
    """One example per completion length: question i, a worked solution for the teacher only, and
    random completion ids (with made-up engine logprobs)."""
    generator = torch.Generator().manual_seed(seed)
    cfg = PromptConfig(privileged=["text"])
    examples = []
    for i, length in enumerate(lengths):
        sample = Sample(id=f"s{i}", question=f"What is {i} + {2 * i}?", images=[], privileged_images=[],
                        privileged_text=f"{i} + {2 * i} = {3 * i}.", answer=str(3 * i))
        student = encode_prompt(processor, student_prompt(sample, processor, cfg))
        teacher = encode_prompt(processor, teacher_prompt(sample, processor, cfg))
        ids = torch.randint(10, 200, (length,), generator=generator).tolist()
        logprobs = (-torch.rand(length, generator=generator)).tolist()
        examples.append(Example(sample.id, student, teacher, ids, logprobs))
    return examples
