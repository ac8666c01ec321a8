"""Weight-sync buckets: bounded size, every parameter exactly once, in order."""

import torch

from opsd.rollout.weight_sync import buckets, push_weights


class Recorder:
    def __init__(self):
        self.events = []

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
