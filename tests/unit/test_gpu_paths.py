"""GPU-path risks checked on CPU: engine sleep level 2, tensor-parallel evaluation with fewer samples
than ranks, text-only rows for a sharded VLM, the teacher forward without a KV cache."""

from types import SimpleNamespace

import pytest
import torch

from opsd.config import EvalConfig, ModelConfig, PromptConfig, load_config
from opsd.data.errors import DataConfigError
from opsd.data.sample import Sample
from opsd.evaluation import evaluate
from opsd.rollout import EngineCapabilities
from opsd.rollout.vllm_engine import VLLMEngine


class FakeLLM:
    """Records what the engine asks of vLLM's `LLM` (sleep, wake, reload RPCs, cache resets)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method.__name__))

    def reset_prefix_cache(self):
        pass

    def reset_mm_cache(self):
        pass

    llm_engine = type("E", (), {"reset_encoder_cache": lambda self: None, "add_lora": lambda self, request: None})()


def sleeping_engine() -> VLLMEngine:
    engine = object.__new__(VLLMEngine)  # no real vLLM: only the sleep bookkeeping is under test
    engine.llm, engine.sleep_mode, engine._asleep, engine._weights_discarded = FakeLLM(), True, set(), False
    engine.tensor_parallel_size, engine.weight_dtype = 1, torch.float32
    engine._adapter_root, engine._lora_request = None, None
    engine.frozen_vision, engine.weight_updates = False, 0
    return engine


def test_engine_sleeps_at_level_2_and_needs_a_weight_update_before_sampling():
    engine = sleeping_engine()
    engine.release_memory()
    assert engine.llm.calls == [("sleep", 2)]
    with pytest.raises(RuntimeError, match="push weights before sampling"):
        engine.generate([], None)
    engine.begin_weight_update()
    engine.receive_weights([])
    engine.end_weight_update()
    assert engine.llm.calls[1:] == [
        ("wake_up", ("weights",)), ("rpc", "begin_reload"), ("rpc", "load_bucket"), ("rpc", "finish_reload"),
        ("wake_up", ("kv_cache",)),
    ]
    assert engine.generate([], None) == []  # awake with the new weights
    assert engine.capabilities.discards_weights  # level 2: a frozen vision tower must come with every update
    engine.release_memory()
    engine.release_memory()  # asleep already: one sleep
    assert engine.llm.calls.count(("sleep", 2)) == 2


def test_engine_with_adapters_sleeps_at_level_1_and_keeps_its_base_weights(tmp_path, monkeypatch):
    engine = sleeping_engine()
    engine._adapter_root = tmp_path  # adapter sync: the base weights are never pushed again
    assert not engine.capabilities.discards_weights
    engine.release_memory()
    assert engine.llm.calls == [("sleep", 1)]
    assert not engine._weights_discarded
    # The adapter update is the step's weight sync: it wakes the engine before the next rollouts.
    monkeypatch.setattr("opsd.lora.write_adapter_dir", lambda path, tensors, config: None)
    engine.receive_adapter(SimpleNamespace(tensors={}, config=None))
    assert engine.llm.calls[1:] == [("wake_up", ("weights", "kv_cache"))]
    assert not engine._asleep


class GroupEngine:
    """A tensor-parallel engine: every rank of its group must call generate."""

    capabilities = EngineCapabilities(generate_is_collective=True)

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, sampling):
        self.calls += 1
        return []


class Rank:
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def sum(self, values):
        return list(values)


def test_a_rank_without_eval_samples_still_joins_its_tensor_parallel_engine(tiny_text_dir):
    from opsd.modeling import load_processor

    processor = load_processor(ModelConfig(path=str(tiny_text_dir)))
    samples = [Sample(id="0", question="q0", images=[], privileged_images=[], answer="4")]
    cfg = EvalConfig(every=1, with_teacher_prompt=True)
    engine = GroupEngine()
    metrics = evaluate(engine, samples, processor, PromptConfig(privileged=["answer"]), cfg, Rank(1, 2))
    # An evaluation is one engine call (student and teacher prompts together): the rank took part.
    assert engine.calls == 1
    assert metrics["eval/num_samples"] == 1


def test_text_only_rows_are_refused_for_a_sharded_vlm(tmp_path):
    from opsd.data.dataset import train_stream
    from tests.helpers.datafiles import write_text_jsonl, write_thinkmorph

    text = write_text_jsonl(tmp_path / "text.jsonl", n_good=4, defects=[])
    images = write_thinkmorph(tmp_path / "tm.parquet", n_good=4, defects=[])
    cfg = load_config("configs/smoke.yaml", [
        "model.path=unused", "data.path=null", "data.synthetic=null", "prompts.privileged=[text]",
        f"data.datasets=[{{path: {images}, schema: thinkmorph}}, {{path: {text}, schema: text}}]",
    ])
    train_stream(cfg, multimodal=True)  # one process: a text row skips the vision tower harmlessly
    with pytest.raises(DataConfigError, match="needs an image in every training row"):
        train_stream(cfg, multimodal=True, sharded=True)


def test_scoring_forwards_run_without_a_kv_cache(tiny_qwen_vl_dir):
    from opsd.modeling import load_model, load_processor
    from opsd.scoring import completion_logits
    from opsd.sequences import EncodedPrompt, collate

    cfg = ModelConfig(path=str(tiny_qwen_vl_dir))
    model = load_model(cfg, load_processor(cfg), torch.device("cpu"))
    seen = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("use_cache")), with_kwargs=True)
    with torch.no_grad():
        completion_logits(model, collate([EncodedPrompt([10, 11, 12])], [[13, 14]], pad_id=0))
    assert seen == [False]
