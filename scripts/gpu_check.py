"""GPU check: the CUDA paths of opsd that no CPU test can run, in one script that writes a JSON report.

    python scripts/gpu_check.py [--out gpu_check.json] [--only NAME ...] [--tokens 9216] [--device cuda]

It runs with what it finds and says what it skipped and why:
- `environment`: versions (torch, CUDA, transformers, torchvision, vllm, pydantic), the GPU.
- `fsdp_nccl_ema_sync` (needs pydantic, for opsd.config): a one-rank NCCL process group, FSDP2
  (bfloat16 params, float32 reduce) on the tiny Qwen2.5-VL loaded the torchrun way (rank 0 reads,
  broadcast into meta-initialised shards), an EMA teacher copied from the shards, 2 train steps (the
  teacher checked against the EMA formula shard by shard), and a weight sync into a receiver in
  bfloat16 (bytes gathered vs float32). `--device cpu`: the same on gloo (the tests run it).
- `qwen25vl_7b_shaped`, `qwen3vl_8b_shaped` (transformers only): a Qwen2.5-VL-7B- or
  Qwen3-VL-8B-shaped random model in bfloat16 built from the shipped config (no download),
  activation checkpointing, one teacher forward without grad and one student forward + backward at
  `--tokens` tokens with `--images` images of about 1008 pixels a side (3-D positions; Qwen3-VL's
  DeepStack features on every image token); peak memory and time. The same code runs on the tiny
  models on CPU in the tests (`forward_backward`, `qwen_vl_inputs`).
- `vllm_sleep_sync_parity` (needs vllm and pydantic): the colocated engine on the tiny text model
  with sleep mode: generate, sleep (level 2), weight sync, generate again; logprobs against the
  trainer's (float32) and the engine's memory while asleep.
- `recipe_runs` (needs pydantic and datasets): `python -m opsd.train` on CUDA with the transformers
  engine (what runs without vLLM), one process each, on the tiny models: bfloat16 with an EMA teacher,
  a checkpoint and a resume; another model as the teacher; grpo on a reward; jsd plus a reward term;
  LoRA; the tiny Qwen2.5-VL (3-D positions) in float32. Per run: the steps logged, the loss, the
  sampler-trainer logprob mismatch and the step times (`--device cpu` runs them on the CPU).
Exit status 0 when nothing that ran failed (skips are not failures).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHIPPED_CONFIGS = ROOT / "opsd" / "model_configs"


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - a broken install is reported as missing
        return None


def _need(*modules: str) -> None:
    missing = [m for m in modules if _version(m) is None]
    if missing:
        raise Skip(f"not importable here: {', '.join(missing)}")


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")


def _gb(nbytes: float) -> float:
    return round(nbytes / 1e9, 3)


def check_environment(args) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        **{name: _version(name) for name in ("transformers", "torchvision", "vllm", "pydantic", "flash_attn")},
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gb": _gb(props.total_memory), "bf16": torch.cuda.is_bf16_supported()}
    return info


def _one_rank_group(device: torch.device) -> str:
    """A one-rank process group: nccl on CUDA, gloo on the CPU (`--device cpu`, the tests)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1, device_id=device if backend == "nccl" else None)
    return backend


def _end_process_group() -> None:
    """Tear down the checks' one-rank group before exit, as the recipe's end_run does, rather than
    leave it to the interpreter's exit (a `make test` run once saw the CPU check abort in C++ after
    it had passed: "terminate called without an active exception", status -6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_fsdp_nccl_ema_sync(args) -> dict:
    if args.device == "cuda":
        _need_cuda()
    _need("pydantic")
    from opsd.config import DistributedConfig, JsdLossConfig, ModelConfig, TeacherConfig
    from opsd.loss_kinds import build_loss
    from opsd.modeling import empty_model, enable_activation_checkpointing, load_model, load_processor
    from opsd.rollout.weight_sync import push_weights
    from opsd.scoring import Scoring, pad_token_id
    from opsd.sequences import EncodedPrompt, Example
    from opsd.teacher import make_teacher
    from opsd.tiny_models import build_tiny_qwen25_vl
    from opsd.trainer.distributed import Ranks, build_mesh
    from opsd.trainer.fsdp import copy_of_shards, load_sharded
    from opsd.trainer.step import TrainStep

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    backend = _one_rank_group(device)
    dist_cfg = DistributedConfig(param_dtype="bfloat16", reduce_dtype="float32", activation_checkpointing=True)
    ranks = Ranks(0, 1, 0, device, build_mesh(dist_cfg, device, 1))
    decay = 0.5
    with tempfile.TemporaryDirectory() as tmp:
        model_cfg = ModelConfig(path=str(build_tiny_qwen25_vl(Path(tmp) / "tiny")), dtype="bfloat16")
        processor = load_processor(model_cfg)
        student = empty_model(model_cfg, processor)
        enable_activation_checkpointing(student)
        student = load_sharded(student, lambda: load_model(model_cfg, processor, torch.device("cpu")).state_dict(),
                               ranks, dist_cfg, trainable=True)
        teacher = make_teacher(TeacherConfig(mode="ema", ema_decay=decay), student,
                               lambda s: copy_of_shards(empty_model(model_cfg, processor), s, ranks, dist_cfg))
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    vocab = processor.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    examples = [
        Example(f"s{i}", EncodedPrompt(torch.randint(10, vocab, (12,), generator=gen).tolist()),
                EncodedPrompt(torch.randint(10, vocab, (20,), generator=gen).tolist()),
                torch.randint(10, vocab, (8,), generator=gen).tolist(), [0.0] * 8)
        for i in range(4)
    ]

    def shards(model):
        return [p.detach().to_local().float().clone() for p in model.parameters()]

    def largest_difference(xs, ys):
        return max((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True))

    teacher_at_start = shards(teacher.module)
    scoring = Scoring(build_loss(JsdLossConfig(top_k=16)), "bfloat16", pad_token_id(processor), micro_batch_size=2)
    train = TrainStep(student, teacher.scorer, optimizer, scoring, max_grad_norm=1.0, ranks=ranks)
    losses = []
    for _ in range(2):
        metrics = train(examples)
        teacher_before = shards(teacher.module)
        teacher.update(student)
        losses.append(metrics["loss"])
    # The last update, shard by shard: teacher = decay * teacher + (1 - decay) * student (the text
    # examples carry no image, so the vision tower's shards stay where they started).
    expected = [decay * t + (1 - decay) * s for t, s in zip(teacher_before, shards(student), strict=True)]
    ema_error = largest_difference(shards(teacher.module), expected)
    moved = largest_difference(shards(teacher.module), teacher_at_start)

    class Receiver:
        def begin_weight_update(self):
            pass

        def receive_weights(self, bucket):
            pass

        def end_weight_update(self):
            pass

    sync16 = push_weights(student, Receiver(), dtype=torch.bfloat16)
    sync32 = push_weights(student, Receiver(), dtype=torch.float32)
    finite = all(math.isfinite(x) and abs(x) < 1e6 for x in losses)
    ok = finite and moved > 0 and ema_error < 1e-6 and sync16.gathered_bytes * 2 == sync32.gathered_bytes
    return {
        "ok": ok, "backend": backend, "losses": losses, "ema_teacher_moved": moved, "ema_update_error": ema_error,
        "sync_gathered_bytes_bf16": sync16.gathered_bytes, "sync_gathered_bytes_fp32": sync32.gathered_bytes,
        "sync_seconds_bf16": round(sync16.seconds, 4),
        **({"peak_memory_gb": _gb(torch.cuda.max_memory_allocated())} if device.type == "cuda" else {}),
    }


def _shaped_model(config_file: str, device) -> tuple[torch.nn.Module, str]:
    from transformers import AutoConfig, AutoModelForImageTextToText

    raw = json.loads((SHIPPED_CONFIGS / config_file).read_text())
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    attn = "flash_attention_2" if _version("flash_attn") else "sdpa"
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    return model, attn


def qwen_vl_inputs(config, tokens: int, images: int, device, side_pixels: int = 1008) -> dict:
    """`images` square images of about `side_pixels` (a multiple of patch x merge: 1008 for Qwen2.5-VL,
    992 for Qwen3-VL) and text up to `tokens` ids in all, as the processor lays them out."""
    vision = config.vision_config
    unit = vision.patch_size * vision.spatial_merge_size
    side = (side_pixels // unit) * unit // vision.patch_size  # patches per side
    per_image = (side // vision.spatial_merge_size) ** 2
    ids, types = [], []
    for _ in range(images):
        ids += [config.vision_start_token_id] + [config.image_token_id] * per_image + [config.vision_end_token_id]
        types += [0] + [1] * per_image + [0]
    text = tokens - len(ids)
    if text <= 0:
        raise ValueError(f"--tokens {tokens} leaves no room for text after {images} images")
    vocab = config.get_text_config().vocab_size
    specials = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    words = [t for t in torch.randint(min(1000, vocab // 4), vocab, (2 * text,)).tolist() if t not in specials]
    ids += words[:text]
    types += [0] * text
    patch_dim = 3 * vision.temporal_patch_size * vision.patch_size**2
    return {
        "input_ids": torch.tensor([ids], device=device),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long, device=device),
        "mm_token_type_ids": torch.tensor([types], device=device),
        "pixel_values": torch.randn(images * side * side, patch_dim, dtype=torch.bfloat16, device=device),  # the model casts
        "image_grid_thw": torch.tensor([[1, side, side]] * images, device=device),
    }


def forward_backward(model, inputs: dict, completion: int) -> dict:
    """A teacher forward without grad and a student forward + backward on the last `completion`
    positions, the way scoring runs them (inner model, LM head on the completion only)."""
    head = model.get_output_embeddings()
    cuda = inputs["input_ids"].is_cuda

    def completion_logits():
        hidden = model.model(**inputs, use_cache=False).last_hidden_state
        return head(hidden[0, -completion - 1 : -1])

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    model.eval()
    synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        teacher_logits = completion_logits()
    synchronize()
    teacher_s = time.perf_counter() - t0
    model.train()
    t0 = time.perf_counter()
    student_logits = completion_logits()
    loss = torch.nn.functional.kl_div(
        student_logits.float().log_softmax(-1), teacher_logits.float().log_softmax(-1), log_target=True, reduction="batchmean"
    )
    loss.backward()
    synchronize()
    student_s = time.perf_counter() - t0
    grads = all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return {
        "ok": bool(torch.isfinite(loss).item()) and grads, "tokens": inputs["input_ids"].shape[1],
        "completion_positions": completion, "teacher_forward_s": round(teacher_s, 3),
        "student_forward_backward_s": round(student_s, 3), "all_parameters_have_grads": grads,
    }


def _check_shaped(config_file: str, args) -> dict:
    _need_cuda()
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model, attn = _shaped_model(config_file, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    build_s = time.perf_counter() - start
    weights = torch.cuda.memory_allocated()
    inputs = qwen_vl_inputs(model.config, args.tokens, args.images, device)
    result = {
        "attn_implementation": attn, "parameters": sum(p.numel() for p in model.parameters()), "images": args.images,
        "deepstack_layers": len(getattr(model.config.vision_config, "deepstack_visual_indexes", ())),
        "build_s": round(build_s, 2), "weights_gb": _gb(weights),
        **forward_backward(model, inputs, completion=min(1024, args.tokens // 4)),
        "peak_memory_gb": _gb(torch.cuda.max_memory_allocated()),
    }
    del model, inputs
    torch.cuda.empty_cache()
    return result


def check_qwen25vl_7b_shaped(args) -> dict:
    return _check_shaped("Qwen--Qwen2.5-VL-7B-Instruct.json", args)


def check_qwen3vl_8b_shaped(args) -> dict:
    return _check_shaped("Qwen--Qwen3-VL-8B-Instruct.json", args)


def check_vllm_sleep_sync_parity(args) -> dict:
    _need_cuda()
    _need("vllm", "pydantic")
    from opsd.config import ModelConfig
    from opsd.modeling import load_model, load_processor
    from opsd.prompts import Prompt
    from opsd.rollout.engine import SamplingSettings
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine
    from opsd.rollout.weight_sync import push_weights
    from opsd.loss import token_logprobs
    from opsd.scoring import completion_logits
    from opsd.sequences import collate, encode_prompt
    from opsd.tiny_models import build_tiny_text_model

    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_text_model(Path(tmp) / "tiny"))
        cfg = ModelConfig(path=path)
        processor = load_processor(cfg)
        model = load_model(cfg, processor, torch.device("cuda", 0))
        engine = VLLMEngine(VLLMOptions(path, dtype="float32", kv_cache_memory_mb=256, gpu_memory_utilization=0.2, sleep_mode=True))
        prompt = Prompt(processor.apply_chat_template([{"role": "user", "content": "Count the cells."}],
                                                      add_generation_prompt=True, tokenize=False), [])
        sampling = SamplingSettings(max_new_tokens=16, seed=1)
        first = engine.generate([prompt], sampling)[0]
        awake = torch.cuda.mem_get_info()[0]
        engine.release_memory()
        asleep = torch.cuda.mem_get_info()[0]
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)  # the trainer's step changed the weights
        sync = push_weights(model, engine, dtype=engine.capabilities.weight_dtype)
        second = engine.generate([prompt], sampling)[0]
        batch = collate([encode_prompt(processor, prompt)], [second.token_ids], processor.pad_token_id)
        with torch.no_grad():
            logprobs = token_logprobs(completion_logits(model, batch), batch.completion_ids.cuda())
        mismatch = (logprobs.cpu() - torch.tensor(second.logprobs)).abs().max().item()
        engine.close()
    return {
        "ok": mismatch < 1e-3, "logprob_mismatch_max_after_sync": mismatch, "tokens": len(second.token_ids),
        "freed_by_sleep_gb": _gb(asleep - awake), "sync_seconds": round(sync.seconds, 4),
        "first_completion_tokens": len(first.token_ids),
    }


# Each run: a name and the overrides of configs/smoke.yaml beside the common ones (`_recipe_overrides`);
# `resume_to`: run again to this step, resuming from the run's last checkpoint.
RECIPE_RUNS = [
    {"name": "tiny_vlm_bf16_ema_resume", "resume_to": 3,
     "overrides": ["model.dtype=bfloat16", "train.max_steps=2", "checkpoint.save_every=1", "eval.every=2"]},
    {"name": "model_teacher_bf16", "overrides": [
        "model.dtype=bfloat16", "teacher={mode: model, path: {tmp}/tiny-vlm-large, build: tiny-vlm-large}"]},
    {"name": "grpo_reward", "overrides": [
        "loss={kind: grpo, clip_eps: 0.2}", "reward={functions: [{name: 'tests.helpers.rewards:even_tokens'}]}"]},
    {"name": "jsd_plus_reward", "overrides": [
        "loss={kind: jsd, top_k: 64, reward_weight: 0.5}", "reward={functions: [{name: 'tests.helpers.rewards:even_tokens'}]}"]},
    {"name": "lora_merged_sync", "overrides": [
        "model.lora={rank: 8, alpha: 16}", "teacher.mode=ema", "rollout.lora_sync=merged"]},
    {"name": "tiny_qwen25vl_fp32", "overrides": [
        "model.path={tmp}/tiny-qwen2.5-vl", "model.build=tiny-qwen2.5-vl", "data.path={tmp}/grid-paths-qwen"]},
]


def _recipe_overrides(run: dict, tmp: Path, device: str) -> list[str]:
    common = [
        f"model.path={tmp}/tiny-vlm", f"data.path={tmp}/grid-paths", f"logging.output_dir={tmp}/{run['name']}",
        "logging.progress_bar=false", "rollout.engine=hf", f"train.device={device}", "train.max_steps=2",
        "rollout.max_new_tokens=16", "eval.every=0", "checkpoint.save_every=0",
    ]
    return common + [o.replace("{tmp}", str(tmp)) for o in run["overrides"]]  # later overrides win


def _train(overrides: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opsd.train", "--config", "configs/smoke.yaml", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _recipe_run(run: dict, tmp: Path, device: str, timeout_s: float) -> dict:
    overrides = _recipe_overrides(run, tmp, device)
    start = time.perf_counter()
    procs = [_train(overrides, timeout_s)]
    if run.get("resume_to") and procs[0].returncode == 0:
        procs.append(_train(overrides + [f"train.max_steps={run['resume_to']}"], timeout_s))
    seconds = round(time.perf_counter() - start, 2)
    failed = next((p for p in procs if p.returncode != 0), None)
    if failed:
        return {"ok": False, "returncode": failed.returncode, "seconds": seconds,
                "output_tail": (failed.stdout + failed.stderr)[-3000:]}
    from opsd.trainer.summary import read_records

    output_dir = tmp / run["name"]
    records = read_records(output_dir / "metrics.jsonl")
    trained = [r for r in records if "loss" in r]
    steps = [r["step"] for r in trained]
    expected = list(range(1, (run.get("resume_to") or 2) + 1))
    ok = steps == expected and all(math.isfinite(r["loss"]) for r in trained) and trained[-1]["grad_norm"] > 0
    if run.get("resume_to"):
        resumed = "resumed from" in procs[-1].stdout + procs[-1].stderr
        ok = ok and resumed and (output_dir / f"checkpoint-{run['resume_to']}").is_dir()
    return {
        "ok": ok, "seconds": seconds, "steps": steps, "expected_steps": expected,
        "loss": [round(r["loss"], 5) for r in trained], "grad_norm": [round(r["grad_norm"], 5) for r in trained],
        "logprob_mismatch_max": max(r["logprob_mismatch_max"] for r in trained),
        "time_rollout_s": [round(r["time_rollout_s"], 3) for r in trained],
        "time_train_s": [round(r["time_train_s"], 3) for r in trained],
        "eval_accuracy": [r["eval/accuracy"] for r in records if "eval/accuracy" in r],
        **({"reward_mean": [r["reward/mean"] for r in trained]} if "reward/mean" in trained[0] else {}),
    }


def check_recipe_runs(args) -> dict:
    if args.device == "cuda":
        _need_cuda()
    _need("pydantic", "datasets")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in RECIPE_RUNS:
            if args.recipe_only and run["name"] not in args.recipe_only:
                continue
            try:
                runs[run["name"]] = _recipe_run(run, Path(tmp), args.device, args.recipe_timeout_s)
            except subprocess.TimeoutExpired as err:
                runs[run["name"]] = {"ok": False, "error": f"timed out after {err.timeout} s"}
            print(f"  recipe {run['name']}: {'ok' if runs[run['name']]['ok'] else 'FAILED'}", flush=True)
    return {"ok": all(r["ok"] for r in runs.values()), "device": args.device, "runs": runs}


CHECKS = {
    "environment": check_environment,
    "fsdp_nccl_ema_sync": check_fsdp_nccl_ema_sync,
    "qwen25vl_7b_shaped": check_qwen25vl_7b_shaped,
    "qwen3vl_8b_shaped": check_qwen3vl_8b_shaped,
    "vllm_sleep_sync_parity": check_vllm_sleep_sync_parity,
    "recipe_runs": check_recipe_runs,
}


def run_checks(names, args, out: Path | None = None) -> dict:
    """The checks in the order given; the report is rewritten to `out` after each (a run cut short keeps what ran)."""
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": {}}
    for name in names:
        start = time.perf_counter()
        try:
            result = {"status": "ran", **CHECKS[name](args)}
            if result.get("ok") is False:
                result["status"] = "failed"
        except Skip as why:
            result = {"status": "skipped", "reason": str(why)}
        except Exception as err:  # noqa: BLE001 - every failure goes into the report
            result = {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        report["checks"][name] = result
        print(f"{name}: {result['status']}" + (f" ({result.get('reason') or result.get('error')})" if result["status"] != "ran" else ""),
              flush=True)
        if out:
            out.write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="JSON report path")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks, in this order")
    parser.add_argument("--tokens", type=int, default=9216, help="the *_shaped checks: sequence length")
    parser.add_argument("--images", type=int, default=4, help="the *_shaped checks: ~1008x1008 images in the sequence")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="fsdp_nccl_ema_sync (gloo on cpu) and recipe_runs: where they run")
    parser.add_argument("--recipe-only", nargs="+", choices=[r["name"] for r in RECIPE_RUNS], help="recipe_runs: only these")
    parser.add_argument("--recipe-timeout-s", type=float, default=240, help="recipe_runs: limit per training process")
    args = parser.parse_args(argv)
    report = run_checks(args.only or list(CHECKS), args, Path(args.out))
    _end_process_group()
    print(f"report: {args.out}")
    return 1 if any(c["status"] == "failed" for c in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
