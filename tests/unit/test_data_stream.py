"""The sample stream: weighted mixture, per-epoch shuffles, rank shards, exact resume, bad rows."""

import json

import pytest

from opsd.data.errors import BadSample, BadSampleError
from opsd.data.sample import Sample
from opsd.data.stream import SampleStream


class ListSource:
    """A dataset of `n` rows; rows in `bad` raise BadSample like a corrupt row would."""

    def __init__(self, name, n, bad=()):
        self.name, self.n, self.bad, self.loads = name, n, set(bad), 0

    def __len__(self):
        return self.n

    def sample(self, index):
        self.loads += 1
        if index in self.bad:
            raise BadSample("corrupt_image", "planted")
        return Sample(id=f"{self.name}/{index}", question="q", images=[], privileged_images=[], answer="a")

    def where(self, index):
        return f"file {self.name}.parquet, row {index}"


def ids(samples):
    return [s.id for s in samples]


def test_weighted_mixture_draws_in_proportion():
    stream = SampleStream([ListSource("a", 50), ListSource("b", 30), ListSource("c", 20)], weights=[6, 3, 1], seed=3)
    draws = ids(stream.take(6000))
    shares = [sum(d.startswith(f"{name}/") for d in draws) / len(draws) for name in "abc"]
    # Binomial standard deviations are at most 0.0065 here; 0.03 is more than 4.5 of them.
    for share, expected in zip(shares, [0.6, 0.3, 0.1]):
        assert abs(share - expected) < 0.03, shares


def test_every_row_once_per_epoch_and_a_new_order_each_epoch():
    source = ListSource("a", 40)
    stream = SampleStream([source], seed=1)
    first, second = ids(stream.take(40)), ids(stream.take(40))
    assert sorted(first) == sorted(second) == sorted(f"a/{i}" for i in range(40))
    assert first != second
    assert ids(SampleStream([ListSource("a", 40)], seed=1).take(40)) == first  # a function of the seed
    assert ids(SampleStream([ListSource("a", 40)], seed=1, shuffle=False).take(3)) == ["a/0", "a/1", "a/2"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_samples_and_keep_the_same_state(world_size):
    def make():
        return SampleStream([ListSource("a", 31, bad={4}), ListSource("b", 17)], weights=[2, 1], seed=5)

    streams = [make() for _ in range(world_size)]
    per_rank = [[] for _ in range(world_size)]
    for _ in range(3):  # three steps of 4 prompts per rank
        for r, stream in enumerate(streams):
            per_rank[r] += ids(stream.take(4, rank=r, world_size=world_size))
    seen = [set(batch) for batch in per_rank]
    assert all(len(s) == 12 for s in seen)
    for r in range(world_size):
        for q in range(r + 1, world_size):
            assert seen[r].isdisjoint(seen[q])
    # Together the ranks read exactly what one process taking 4 x world_size per step reads.
    single = make()
    together = [i for _ in range(3) for i in ids(single.take(4 * world_size))]
    assert sorted(together) == sorted(i for batch in per_rank for i in batch)
    # Every rank holds the same position and counts: one saved state resumes them all.
    assert all(s.state_dict() == single.state_dict() for s in streams)


def test_saved_state_resumes_with_the_identical_next_samples():
    def make():
        return SampleStream([ListSource("a", 13, bad={2, 7}), ListSource("b", 9, bad={4})], weights=[1, 2], seed=11)

    original = make()
    original.take(17)  # across an epoch boundary of b, with skips
    state = json.loads(json.dumps(original.state_dict()))  # plain JSON: any checkpoint format can hold it
    expected = ids(original.take(25))

    resumed = make()
    resumed.load_state_dict(state)
    assert ids(resumed.take(25)) == expected
    assert resumed.metrics() == original.metrics()


def test_state_of_another_dataset_is_refused():
    state = SampleStream([ListSource("a", 10)], seed=0).state_dict()
    with pytest.raises(ValueError, match="sizes"):
        SampleStream([ListSource("a", 11)], seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        SampleStream([ListSource("a", 10)], seed=1).load_state_dict(state)


def test_bad_rows_are_counted_once_and_not_decoded_again():
    source = ListSource("a", 10, bad={3, 5})
    stream = SampleStream([source], seed=0)
    stream.take(8 * 5)  # five epochs
    assert stream.metrics() == {"data/skipped_corrupt_image": 2}
    assert source.loads == 8 * 5 + 2  # each bad row was decoded once, in the first epoch


def test_error_mode_names_dataset_file_and_row():
    stream = SampleStream([ListSource("tm", 4, bad={2})], shuffle=False, on_bad_sample="error")
    with pytest.raises(BadSampleError, match=r"dataset tm, file tm\.parquet, row 2: corrupt image: planted"):
        stream.take(4)


def test_a_dataset_without_one_usable_row_stops_the_run():
    stream = SampleStream([ListSource("good", 5), ListSource("broken", 4, bad=range(4))], seed=0)
    with pytest.raises(BadSampleError, match="broken: no usable row"):
        stream.take(50)
