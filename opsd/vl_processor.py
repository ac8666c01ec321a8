"""Qwen-VL processors on machines without torchvision (images only, no video processor).

transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors hold a video processor that needs
torchvision, which cannot be installed beside a CPU-only torch (see the vLLM-on-CPU notes). The
image processor has a PIL backend that needs nothing more, so an image-only processor is assembled
from the tokenizer and the image processor when `AutoProcessor` fails for want of torchvision.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

PROCESSOR_CONFIG = "processor_config.json"


@cache
def _image_only_class(processor_cls: type) -> type:
    """`processor_cls` that accepts (and saves) a processor without a video processor."""

    class ImageOnly(processor_cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory, **kwargs):
            # The base class saves every attribute, and a missing video processor has nothing to save.
            out = Path(save_directory)
            out.mkdir(parents=True, exist_ok=True)
            self.tokenizer.save_pretrained(out)
            self.image_processor.save_pretrained(out)
            if isinstance(self.chat_template, str):
                (out / "chat_template.jinja").write_text(self.chat_template)
            (out / PROCESSOR_CONFIG).write_text(json.dumps({"processor_class": processor_cls.__name__}, indent=1))
            return [str(out / PROCESSOR_CONFIG)]

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_cls.__name__
    return ImageOnly


def image_only_processor(processor_cls: type, image_processor, tokenizer, chat_template: str | None = None):
    """An instance of `processor_cls` (e.g. `Qwen2_5_VLProcessor`) with no video processor."""
    return _image_only_class(processor_cls)(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
        chat_template=chat_template or tokenizer.chat_template,
    )


def _saved_chat_template(path: str) -> str | None:
    """A processor-level template (`chat_template.jinja` / `.json`), which takes precedence over the tokenizer's."""
    directory = Path(path)
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    if (directory / "chat_template.json").is_file():
        return json.loads((directory / "chat_template.json").read_text()).get("chat_template")
    return None


def load_image_only_processor(path: str, *, trust_remote_code: bool = False):
    """The model's processor, assembled from its tokenizer and image processor (no torchvision)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    model_type = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type
    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ValueError(f"{path}: no processor class known for model type {model_type!r}")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", trust_remote_code=trust_remote_code)
    return image_only_processor(processor_class_from_name(name), image_processor, tokenizer, _saved_chat_template(path))
