"""The out-of-process engine against a real vLLM server that the test starts on loopback."""

import os
import signal
import socket
import subprocess

import pytest
import torch

from opsd.config import ModelConfig, PromptConfig
from opsd.data.synthetic import generate_samples
from opsd.modeling import load_model, load_processor
from opsd.prompts import student_prompt
from opsd.rollout.engine import SamplingSettings
from opsd.rollout.serve import serve_command
from opsd.rollout.server_engine import ServerEngine, ServerError
from opsd.train import train
from tests.helpers.logprobs import engine_logprobs, trainer_logprobs
from tests.helpers.runs import demo_config, read_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """The server and its engine-core process form one process group: end all of it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def served_config(tmp_path, tiny_vlm_dir, grid_data_dir):
    """A run config for `rollout.engine=server`, with its server started (not yet healthy)."""
    cfg = demo_config(
        tmp_path, tiny_vlm_dir, grid_data_dir, "rollout.engine=server", f"rollout.server.url=http://127.0.0.1:{free_port()}",
        "rollout.server.startup_timeout_s=240", "train.max_steps=2", "rollout.max_new_tokens=8",
        "rollout.sync_bucket_mb=0.5",  # several buckets per update: fused layers arrive in parts
        # A real update after step 1, so step 2's mismatch check can fail if the sync does not land.
        "optim.warmup_steps=0", "optim.schedule=constant",
    )
    # One worker process less than vLLM's default on CPU: quicker to start.
    argv, env = serve_command(cfg, str(tiny_vlm_dir), ["--distributed-executor-backend", "uni", "--uvicorn-log-level", "warning"])
    log_path = tmp_path / "vllm-serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield cfg
    finally:
        stop(process)
        print(log_path.read_text()[-3000:])  # shown by pytest when the test fails


@pytest.mark.vllm
@pytest.mark.slow
def test_training_with_a_vllm_server_stays_on_policy(served_config, tiny_vlm_dir):
    cfg = served_config
    records = read_metrics(train(cfg))[1:]  # after the step-0 evaluation
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["logprob_mismatch_max"] < 1e-3 and r["completion_tokens"] > 0
        assert r["weight_sync_bytes"] > 0

    # The server now holds the trained weights: its logprobs left those of the initial model.
    processor = load_processor(cfg.model)
    initial = load_model(ModelConfig(path=str(tiny_vlm_dir)), processor, torch.device("cpu"))
    prompts = [student_prompt(s, processor, PromptConfig()) for s in generate_samples(2, seed=5)]
    allowed = set(range(100, 120))  # banned tokens reach the server: only these may be sampled
    banned = [t for t in range(len(processor.tokenizer)) if t not in allowed]
    engine = ServerEngine(cfg.rollout.server.url, processor)
    try:
        completions = engine.generate(prompts, SamplingSettings(max_new_tokens=6, n=2, seed=0, banned_token_ids=banned))
    finally:
        engine.close()
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
    assert {t for c in completions for t in c.token_ids} <= allowed
    assert (trainer_logprobs(initial, processor, prompts, completions) - engine_logprobs(completions)).abs().max() > 1e-3


def test_missing_server_is_reported_with_the_launch_command(tiny_text_dir):
    processor = load_processor(ModelConfig(path=str(tiny_text_dir)))
    with pytest.raises(ServerError, match="no healthy rollout server .*`python -m opsd.rollout.serve"):
        ServerEngine(f"http://127.0.0.1:{free_port()}", processor, startup_timeout_s=1)


def test_serve_prints_the_server_command_of_the_config(capsys):
    from opsd.rollout.serve import main

    assert main(["--config", "configs/smoke.yaml", "--print", "rollout.server.url=http://127.0.0.1:8123", "--", "--max-num-seqs", "8"]) == 0
    line = capsys.readouterr().out
    for part in (
        "VLLM_SERVER_DEV_MODE=1", "--model artifacts/tiny-vlm", "--host 127.0.0.1 --port 8123", "--dtype float32",
        "--max-model-len 1024", "--worker-extension-cls opsd.rollout.server_worker.WeightSyncExtension",
        "--enable-scale-out", "--kv-cache-memory-bytes 67108864", "--enforce-eager", "--max-num-seqs 8",
    ):
        assert part in line
