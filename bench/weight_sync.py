"""Time of one weight sync (`push_weights` into the in-process vLLM engine) against a plain memory copy.

For Qwen2 models of growing size (built locally with random weights, float32, no downloads), a
child process per size starts a `VLLMEngine` (KV cache bounded), loads the same model in
transformers, and times `opsd.rollout.weight_sync.push_weights(model, engine)`: one weight-update
session, full tensors streamed in buckets of `--bucket-mb`. Beside it, the floor on the same machine:
`torch.Tensor.copy_` of the same tensors into preallocated buffers (the same bytes, no engine).
Syncs and copies alternate, `--repeats` of each after one warm-up of each; `sync_over_copy` is the
median of the pairs' ratios, so that a machine whose load changes during the run slows both alike.
`parts_over_copy` splits the sync: `load_s` (the buckets written into the engine's parameters),
`finish_s` (the engine's post-load step: on CPU, packing linear weights for its GEMM kernels),
`begin_s`; what the parts leave of `sync_over_copy` is the trainer side (casting, bucketing). The `smollm2` size is the real
SmolLM2-135M-Instruct (538 MB in float32, converted into `--smollm2-dir` when missing): its
`sync_over_copy` is issue #19's acceptance figure (<= 2), printed again as the last JSON object's
`smollm2_sync_over_copy`. With `--cpu-kernels` (CPU only), the SmolLM2 row adds `cpu_kernels`: why
`finish_s` is there, side by side in the same engine: vLLM's packed CPU GEMM kernels (the default; each
sync repacks the updated weights) against plain `F.linear` on the weights (a sync is the copy alone),
each kind's sync and the `generate` that follows it, and `unpacked_generate_over_packed`.

With `--lora`, LoRA rows on SmolLM2-135M-Instruct (converted into `--smollm2-dir` when missing):
a child process per sync kind times `opsd.rollout.weight_sync.sync_student` of the same model,
`full` (a full-weight student into a plain engine), `merged` (a LoRA student, W + scale * B @ A
pushed as full tensors into a plain engine) and `adapter` (the adapter alone into an engine with LoRA
enabled, written as a PEFT directory and loaded by the engine), with `adapter_over_full_bytes`.
Beside that, `fsdp_gather`: the same model FSDP2-sharded over 2 gloo ranks (CPU), and the bytes each
rank receives from the all-gathers of one `push_weights` (`SyncStats.gathered_bytes`) into a receiver
holding float32 weights and into one holding bfloat16 weights (the engine's dtype in bfloat16 runs):
the shards are cast before the per-FSDP-unit all-gather, so bfloat16 moves half the bytes.

Run: .venv/bin/python bench/weight_sync.py [--sizes tiny small medium smollm2] [--bucket-mb 256] [--repeats 3] [--cpu-kernels]
     .venv/bin/python bench/weight_sync.py --sizes --lora [--lora-rank 16]   # LoRA rows only
Prints one JSON object to stdout: per size, parameters, bytes, sync seconds and GB/s, copy seconds
and GB/s, and `sync_over_copy` (how many times slower than the memory-copy floor the sync is); per
built size under `fsdp_gather`, gathered bytes and seconds per step in float32 and bfloat16 and their ratio.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# hidden, layers, MLP width, attention heads (head_dim 64 or 32), KV heads, vocabulary
SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    "small": dict(hidden_size=384, num_hidden_layers=6, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2, vocab_size=8192),
    "medium": dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4, vocab_size=16384),
}
SMOLLM2 = "smollm2"
"""The real SmolLM2-135M-Instruct (`--smollm2-dir`), not built: the issue #19 row."""


def build_model(out: Path, shape: dict) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opsd.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        **shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"], max_position_embeddings=512,
        tie_word_embeddings=False, use_sliding_window=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


SYNC_PARTS = {"begin_weight_update": "begin_s", "receive_weights": "load_s", "end_weight_update": "finish_s"}
"""The receiver's calls in one sync, timed apart: `load_s` (the buckets written into the engine) and
`finish_s` (the engine's post-load step: on CPU, packing the linear weights for its kernels)."""


def time_parts(engine) -> dict[str, list[float]]:
    """Wrap the engine's weight-update calls so that each sync adds its seconds per part to the lists."""
    seconds: dict[str, list[float]] = {part: [] for part in SYNC_PARTS.values()}

    def timed(method, part):
        def call(*args):
            start = time.perf_counter()
            method(*args)
            seconds[part][-1] += time.perf_counter() - start

        return call

    for name, part in SYNC_PARTS.items():
        setattr(engine, name, timed(getattr(engine, name), part))
    return seconds


def measure(size: str, bucket_mb: float, repeats: int, smollm2_dir: str, cpu_kernels_row: bool = False) -> dict:
    """Runs in the child process. Syncs and copies alternate (one of each per repeat, after a warm-up of
    each), so that a machine whose load changes slows both alike; the ratio is the median of the pairs'."""
    from transformers import AutoModelForCausalLM

    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine
    from opsd.rollout.weight_sync import push_weights

    with tempfile.TemporaryDirectory(prefix="opsd-bench-") as tmp:
        model_dir = smollm2_dir if size == SMOLLM2 else tmp
        if size != SMOLLM2:
            build_model(Path(tmp), SIZES[size])
        engine = VLLMEngine(VLLMOptions(model_dir, dtype="float32", max_model_len=512, kv_cache_memory_mb=64, enforce_eager=True))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        parts = time_parts(engine)
        params = [p.detach() for p in model.parameters()]
        buffers = [torch.empty_like(p) for p in params]

        def copy():
            for dst, src in zip(buffers, params):
                dst.copy_(src)

        def sync():
            for times in parts.values():
                times.append(0.0)
            return push_weights(model, engine, bucket_mb=bucket_mb)

        syncs, copies = [], []
        for i in range(repeats + 1):  # the first pair warms up
            stats = sync()
            start = time.perf_counter()
            copy()
            if i:
                syncs.append(stats.seconds)
                copies.append(time.perf_counter() - start)
        sync_s, copy_s = statistics.median(syncs), statistics.median(copies)
        nbytes = stats.bytes
        result = {
            "size": size,
            "parameters": sum(p.numel() for p in params),
            "bytes": nbytes,
            "buckets": stats.buckets,
            "tensors": stats.tensors,
            "sync_s": round(sync_s, 4),
            "sync_gb_s": round(nbytes / sync_s / 1e9, 3),
            "copy_s": round(copy_s, 5),
            "copy_gb_s": round(nbytes / copy_s / 1e9, 3),
            "sync_over_copy": round(statistics.median(s / c for s, c in zip(syncs, copies)), 2),
            "parts_over_copy": {part: round(statistics.median(t / c for t, c in zip(times[1:], copies)), 2)
                                for part, times in parts.items()},
        }
        if cpu_kernels_row:
            result["cpu_kernels"] = cpu_kernels(engine, sync, copy, parts, repeats)
        engine.close()
    return result


def _flag_linear_layers(worker, unpacked: bool) -> None:
    """vLLM's own plain path for a CPU linear layer (`_cpu_skip_gemm_dispatch`: `F.linear` on the weight,
    no packed copy) on every layer from the next update on, or its default packed kernels again."""
    for module in worker.model_runner.get_model().modules():
        if getattr(module, "quant_method", None) is not None:
            module._cpu_skip_gemm_dispatch = unpacked


def _plain_lm_head(worker) -> None:
    """The tied LM head as `F.linear` on the embedding (its packed copy is otherwise made at first use)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in worker.model_runner.get_model().modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            module.cpu_linear = torch.nn.functional.linear


def cpu_kernels(engine, sync, copy, parts: dict[str, list[float]], repeats: int) -> dict:
    """The CPU design choice behind `finish_s`, side by side: vLLM's packed GEMM kernels (the default:
    every sync repacks) against `F.linear` on the plain weights (a sync is the copy alone). Per round,
    for each kernel kind in turn: a sync (its parts timed as above) and a copy, one `generate` of 4
    prompts x 4 samples x 64 tokens (it pays the tied LM head's pack, made at its first use after a
    sync), and the same `generate` again."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(range(100 + 7 * i, 164 + 7 * i))) for i in range(4)]
    sampling = SamplingParams(n=4, max_tokens=64, min_tokens=64, temperature=1.0, seed=0)

    def generate() -> float:
        engine.llm.reset_prefix_cache()
        start = time.perf_counter()
        engine.llm.generate(prompts, sampling, use_tqdm=False)
        return time.perf_counter() - start

    rows = {kind: {"sync_s": [], "copy_s": [], "generate_s": [], "generate_again_s": [], **{part: [] for part in parts}}
            for kind in ("packed", "unpacked")}
    for round_ in range(repeats + 1):  # the first round warms up
        for kind, row in rows.items():
            engine.llm.collective_rpc(_flag_linear_layers, args=(kind == "unpacked",))
            start = time.perf_counter()
            sync()
            if kind == "unpacked":
                engine.llm.collective_rpc(_plain_lm_head)
            synced = time.perf_counter() - start
            start = time.perf_counter()
            copy()
            copied = time.perf_counter() - start
            first, again = generate(), generate()
            if round_:
                for name, value in (("sync_s", synced), ("copy_s", copied), ("generate_s", first), ("generate_again_s", again)):
                    row[name].append(value)
                for part, times in parts.items():
                    row[part].append(times[-1])
    engine.llm.collective_rpc(_flag_linear_layers, args=(False,))
    out = {}
    for kind, row in rows.items():
        out[kind] = {name: round(statistics.median(row[name]), 4) for name in ("sync_s", "copy_s", "generate_s", "generate_again_s")}
        out[kind]["sync_over_copy"] = round(statistics.median(s / c for s, c in zip(row["sync_s"], row["copy_s"])), 2)
        out[kind]["parts_over_copy"] = {part: round(statistics.median(t / c for t, c in zip(row[part], row["copy_s"])), 2) for part in parts}
    packed, unpacked = out["packed"], out["unpacked"]
    return {
        **out,
        "tokens_generated": 4 * 4 * 64,
        "unpacked_generate_over_packed": round(unpacked["generate_s"] / packed["generate_s"], 2),
        "unpacked_sync_and_generate_over_packed": round(
            (unpacked["sync_s"] + unpacked["generate_s"]) / (packed["sync_s"] + packed["generate_s"]), 2),
    }


def measure_lora(sync: str, model_dir: str, rank: int, bucket_mb: float, repeats: int) -> dict:
    """Runs in the child process: one sync kind on SmolLM2 (`full`, `merged` or `adapter`)."""
    from transformers import AutoModelForCausalLM

    from opsd import lora
    from opsd.config import LoraConfig
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine
    from opsd.rollout.weight_sync import sync_student

    engine = VLLMEngine(VLLMOptions(model_dir, dtype="float32", max_model_len=512, kv_cache_memory_mb=64, enforce_eager=True,
                                    max_lora_rank=rank if sync == "adapter" else None))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if sync != "full":
        model = lora.add_lora(model, LoraConfig(rank=rank, alpha=2 * rank))
        with torch.no_grad():  # B starts at zero; a trained adapter is not
            for param in lora.adapter_parameters(model).values():
                param.normal_(0, 0.01)
    stats = []
    sync_s = median_seconds(lambda: stats.append(sync_student(model, engine, bucket_mb=bucket_mb, lora_sync=sync)), repeats)
    engine.close()
    return {"sync": sync, "bytes": stats[-1].bytes, "tensors": stats[-1].tensors, "sync_s": round(sync_s, 4)}


class CountingReceiver:
    """Takes the weights and drops them: only the gather is measured."""

    def begin_weight_update(self) -> None:
        pass

    def receive_weights(self, bucket) -> None:
        pass

    def end_weight_update(self) -> None:
        pass


def _gather_rank(rank: int, port: int, size: str, repeats: int, out: str) -> None:
    """One of 2 gloo ranks: shard the model, time `push_weights` per receiver dtype."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from opsd.config import DistributedConfig
    from opsd.rollout.weight_sync import push_weights
    from opsd.trainer.distributed import Ranks, build_mesh
    from opsd.trainer.fsdp import shard_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg, cpu = DistributedConfig(), torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="opsd-bench-") as tmp:
        if rank == 0:
            build_model(Path(tmp), SIZES[size])
        path = [tmp]
        dist.broadcast_object_list(path)  # rank 0's directory (same host)
        dist.barrier()
        model = AutoModelForCausalLM.from_pretrained(path[0], dtype=torch.float32)
        dist.barrier()
    shard_model(model, Ranks(rank, 2, rank, cpu, build_mesh(cfg, cpu, 2)), cfg, trainable=True)
    result = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        stats = []
        seconds = median_seconds(lambda: stats.append(push_weights(model, CountingReceiver(), dtype=dtype)), repeats)
        result[name] = {"gathered_bytes": stats[-1].gathered_bytes, "pushed_bytes": stats[-1].bytes, "seconds": round(seconds, 4)}
    if rank == 0:
        result["bfloat16_over_float32_bytes"] = result["bfloat16"]["gathered_bytes"] / result["float32"]["gathered_bytes"]
        result["size"] = size
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure_fsdp_gather(size: str, repeats: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="opsd-bench-") as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(_gather_rank, args=(port, size, repeats, out), nprocs=2, start_method="spawn")
        return json.loads(Path(out).read_text())


def _run_child(*args) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(list(args))],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        return {"child": args[0], "error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_smollm2(model_dir: Path) -> None:
    if not (model_dir / "config.json").exists():
        from opsd.convert_smollm2 import convert

        convert(model_dir)


def lora_rows(model_dir: Path, rank: int, bucket_mb: float, repeats: int) -> dict:
    ensure_smollm2(model_dir)
    rows = [_run_child(sync, str(model_dir), rank, bucket_mb, repeats) for sync in ("full", "merged", "adapter")]
    by_sync = {r.get("sync"): r for r in rows}
    ratio = by_sync["adapter"]["bytes"] / by_sync["full"]["bytes"] if {"adapter", "full"} <= by_sync.keys() else None
    return {"model": "SmolLM2-135M-Instruct", "rank": rank, "alpha": 2 * rank, "rows": rows,
            "adapter_over_full_bytes": ratio and round(ratio, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", choices=[*SIZES, SMOLLM2], default=[*SIZES, SMOLLM2])
    parser.add_argument("--lora", action="store_true", help="add the LoRA rows (SmolLM2: full vs merged vs adapter sync)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--cpu-kernels", action="store_true",
                        help="SmolLM2 on CPU: also sync and generate with plain F.linear kernels against the packed ones")
    parser.add_argument("--smollm2-dir", type=Path, default=Path("artifacts/smollm2-135m-instruct"))
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = json.loads(args.child)
        print(json.dumps(measure_lora(*child) if child[0] in ("full", "merged", "adapter") else measure(*child)))
        return
    if SMOLLM2 in args.sizes:
        ensure_smollm2(args.smollm2_dir)
    cpu_row = args.cpu_kernels and not torch.cuda.is_available()
    results = [_run_child(size, args.bucket_mb, args.repeats, str(args.smollm2_dir), cpu_row and size == SMOLLM2)
               for size in args.sizes]
    print(json.dumps({
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "dtype": "float32",
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "results": results,
        "fsdp_gather": [measure_fsdp_gather(size, args.repeats) for size in args.sizes if size in SIZES],
        **({"lora": lora_rows(args.smollm2_dir, args.lora_rank, args.bucket_mb, args.repeats)} if args.lora else {}),
        # the issue #19 figure: SmolLM2's sync over a memcpy of its bytes (None: not measured)
        "smollm2_sync_over_copy": next((r.get("sync_over_copy") for r in results if r.get("size") == SMOLLM2), None),
    }, indent=1))


if __name__ == "__main__":
    main()
