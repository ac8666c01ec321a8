"""Rollout throughput: the in-process vLLM engine against transformers `generate`.

For each tiny random model (Idefics3 VLM with the synthetic grid images; Qwen2 text model with the
same questions, no images) it times the same prompts and sampling on `VLLMEngine` (in-process),
`HFEngine` with one batch of all prompts, and `HFEngine` with batch size 1. EOS is banned
everywhere so every completion runs to --max-new-tokens (vLLM: `banned_token_ids`; transformers
silently drops EOS from `bad_words_ids`, so there `min_new_tokens`). Tokens/s = tokens returned
(sum of len(token_ids)) / wall time of one call; best of --repeats calls (the CPUs may be shared),
all listed, after an untimed warm-up call per engine. vLLM's prefix/encoder/mm caches are cleared
before each call, so repeats reuse no prompt work. Each model runs in a child process: the
in-process engine pins threads, which would leak into the next model's transformers timings.

Run: .venv/bin/python bench/rollout_throughput.py [--model vlm text] [--prompts 8]
     [--max-new-tokens 64] [--repeats 2] [--dtype float32] > out.json
Prints one JSON object to stdout; logs go to stderr.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # no inductor compile on the first request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from opsd import tiny_models  # noqa: E402
from opsd.config import ModelConfig, PromptConfig  # noqa: E402
from opsd.data.sample import Sample  # noqa: E402
from opsd.data.synthetic import generate_samples  # noqa: E402
from opsd.modeling import load_model, load_processor  # noqa: E402
from opsd.prompts import placeholder_token_ids, student_prompt, tokenizer_of  # noqa: E402
from opsd.rollout.engine import SamplingSettings  # noqa: E402
from opsd.rollout.hf_engine import HFEngine  # noqa: E402
from opsd.rollout.vllm_args import VLLMOptions  # noqa: E402
from opsd.rollout.vllm_engine import VLLMEngine  # noqa: E402


def timed(engine, prompts, sampling, repeats, before_call=lambda: None) -> dict:
    engine.generate(prompts, sampling)  # warm-up, not counted
    rates, tokens = [], []
    for r in range(repeats):
        before_call()
        start = time.perf_counter()
        completions = engine.generate(prompts, SamplingSettings(**{**vars(sampling), "seed": r + 1}))
        seconds = time.perf_counter() - start
        tokens.append(sum(len(c.token_ids) for c in completions))
        rates.append(round(tokens[-1] / seconds, 1))
    return {"tokens_per_s": max(rates), "tokens_per_s_runs": rates, "tokens_per_call": tokens}


def bench_model(kind: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="opsd-bench-") as tmp:
        build = tiny_models.build_tiny_vlm if kind == "vlm" else tiny_models.build_tiny_text_model
        path = str(build(Path(tmp) / kind))
        processor = load_processor(ModelConfig(path=path))
        samples = generate_samples(args.prompts, seed=0)
        if kind == "text":
            samples = [Sample(s.id, s.question, images=[], privileged_images=[]) for s in samples]
        prompts = [student_prompt(s, processor, PromptConfig()) for s in samples]
        eos = tokenizer_of(processor).eos_token_id
        banned = [*placeholder_token_ids(processor), eos]
        sampling = SamplingSettings(max_new_tokens=args.max_new_tokens, banned_token_ids=banned)

        # transformers first, before vLLM touches this process's threads.
        model = load_model(ModelConfig(path=path), processor, torch.device("cpu"))
        model = model.to(getattr(torch, args.dtype))
        model.generation_config.min_new_tokens = args.max_new_tokens  # the EOS ban, for HF
        res = {}
        for name, batch_size in (("hf_batched", len(prompts)), ("hf_bs1", 1)):
            res[name] = timed(HFEngine(model, processor, batch_size=batch_size), prompts, sampling, args.repeats)
        del model

        engine = VLLMEngine(VLLMOptions(path, dtype=args.dtype, max_model_len=1024, kv_cache_memory_mb=64, enforce_eager=True))
        llm = engine.llm

        def clear_caches():
            llm.reset_prefix_cache()
            llm.reset_mm_cache()
            llm.llm_engine.reset_encoder_cache()

        res = {"vllm": timed(engine, prompts, sampling, args.repeats, clear_caches), **res}
        engine.close()
    rate = {name: r["tokens_per_s"] for name, r in res.items()}
    ratios = [("vllm", "hf_batched"), ("vllm", "hf_bs1"), ("hf_batched", "hf_bs1")]
    res["ratios"] = {f"{a}/{b}": round(rate[a] / rate[b], 2) for a, b in ratios}
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=["vlm", "text"], default=["vlm", "text"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    load = round(os.getloadavg()[0], 2)
    common = [f"--prompts={args.prompts}", f"--max-new-tokens={args.max_new_tokens}",
              f"--repeats={args.repeats}", f"--dtype={args.dtype}"]  # fmt: skip
    results = {}
    if len(args.model) > 1:  # one fresh child process per model
        for kind in args.model:
            child = subprocess.run([sys.executable, __file__, "--model", kind, *common],
                                   stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
            results.update(json.loads(child.stdout)["models"])
    else:
        stdout = os.dup(1)
        os.dup2(2, 1)  # anything printed meanwhile (vLLM, C++ extensions) lands on stderr
        try:
            results[args.model[0]] = bench_model(args.model[0], args)
        finally:
            sys.stdout.flush()
            os.dup2(stdout, 1)
    config = {k: v for k, v in vars(args).items() if k != "model"}
    # Timings are only meaningful on otherwise idle CPUs: a busy machine shows in the start load.
    config.update(cpus=os.cpu_count(), torch_threads=torch.get_num_threads(), load_avg_1min_at_start=load)
    print(json.dumps({"config": config, "models": results}, indent=2))


if __name__ == "__main__":
    main()
