"""Weight-sync buckets: bounded size, every parameter exactly once, in order."""

import torch

from opsd.rollout.engine import EngineCapabilities
from opsd.rollout.weight_sync import buckets, push_weights, sync_student


class Recorder:
    def __init__(self, capabilities=EngineCapabilities()):
        self.events = []
        self.capabilities = capabilities  # for `sync_student`, which asks an engine

    def begin_weight_update(self):
        self.events.append("begin")

    def receive_weights(self, bucket):
        self.events.append([(name, t.clone()) for name, t in bucket])

    def end_weight_update(self):
        self.events.append("end")


def test_buckets_respect_the_size_bound():
    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    groups = list(buckets(tensors, bucket_bytes=4 * 25))
    assert [[name for name, _ in g] for g in groups] == [["w0", "w1"], ["w2"], ["w3"], ["w4"], ["w5"]]
    for g in groups:  # over the bound only when a single tensor is larger than it
        assert len(g) == 1 or sum(t.numel() * 4 for _, t in g) <= 100


def test_push_weights_sends_every_parameter_once_in_one_session():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    receiver = Recorder()
    stats = push_weights(model, receiver, bucket_mb=4 * 8 * 16 / 2**20)
    assert receiver.events[0] == "begin" and receiver.events[-1] == "end"
    sent = [pair for event in receiver.events[1:-1] for pair in event]
    expected = dict(model.named_parameters())
    assert [name for name, _ in sent] == list(expected)
    assert all(torch.equal(t, expected[name]) for name, t in sent)
    assert stats.tensors == 4 and stats.buckets == len(receiver.events) - 2 >= 2
    assert stats.bytes == sum(p.numel() * 4 for p in model.parameters())


def test_engines_that_load_checkpoint_names_get_the_names_save_pretrained_writes(tiny_paddleocr_vl_dir, tiny_vlm_dir):
    """transformers 5 renames PaddleOCR-VL's weights on load (`mlp_AR.*` -> `model.projector.*`, ...)
    and back on save; vLLM loads the on-disk names, the hf engine and custom receivers the model's."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from opsd.config import LoraConfig
    from opsd.lora import add_lora

    model = AutoModelForImageTextToText.from_pretrained(tiny_paddleocr_vl_dir, dtype=torch.float32)
    with safe_open(tiny_paddleocr_vl_dir / "model.safetensors", "pt") as f:
        on_disk = set(f.keys())
    assert not on_disk & {n for n, _ in model.named_parameters()} - {"lm_head.weight"}  # every other name differs

    plain, checkpoint = Recorder(), Recorder(EngineCapabilities(checkpoint_names=True))
    sync_student(model, plain)
    sync_student(model, checkpoint)
    assert [n for e in plain.events[1:-1] for n, _ in e] == [n for n, _ in model.named_parameters()]
    sent = {n: t for e in checkpoint.events[1:-1] for n, t in e}
    assert set(sent) == on_disk
    assert torch.equal(sent["mlp_AR.linear_1.weight"], model.model.projector.linear_1.weight)

    # Merged LoRA weights travel under the same names (the adapter's layers lose `base_layer`).
    student = add_lora(model, LoraConfig(rank=4, target_modules=["q_proj"]))
    merged = Recorder(EngineCapabilities(checkpoint_names=True))
    sync_student(student, merged, lora_sync="merged")
    assert {n for e in merged.events[1:-1] for n, _ in e} == on_disk

    # A model transformers saves as it holds it (Idefics3) is sent unchanged.
    idefics = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32)
    same = Recorder(EngineCapabilities(checkpoint_names=True))
    sync_student(idefics, same)
    assert [n for e in same.events[1:-1] for n, _ in e] == [n for n, _ in idefics.named_parameters()]
