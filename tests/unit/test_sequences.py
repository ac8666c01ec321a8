"""Sequences: prompt ids followed by the completion ids, the completion budget, batching, the length check."""

import pytest
import torch

from opsd.config import PromptConfig, config_from_dict
from opsd.data.errors import BadSample
from opsd.data.sample import Sample
from opsd.prompts import student_prompt, teacher_prompt
from opsd.rollout.engine import Completion
from opsd.sequences import (
    EncodedPrompt, balanced_rows, build_examples, cheapest_rows, collate, completion_budget, encode_prompt,
    padding_example, prompt_length_check, shared_prefix_length,
)
from tests.helpers.examples import text_model


@pytest.fixture(scope="module")
def processor(tiny_text_dir):
    return text_model(tiny_text_dir)[1]


def sample(i=0, privileged_text="a worked solution"):
    return Sample(id=f"s{i}", question=f"What is {i} + 1?", images=[], privileged_images=[], privileged_text=privileged_text)


def test_encoding_adds_no_special_tokens(processor):
    prompt = student_prompt(sample(), processor, PromptConfig())
    assert encode_prompt(processor, prompt).input_ids == processor(prompt.text, add_special_tokens=False)["input_ids"]


def test_collate_marks_the_positions_that_predict_each_completion_token():
    prompts = [EncodedPrompt([1, 2, 3]), EncodedPrompt([4])]
    batch = collate(prompts, [[7, 8], [9, 10, 11]], pad_id=0)
    assert batch.inputs["input_ids"].tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0]]
    assert batch.inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.completion_ids.tolist() == [7, 8, 9, 10, 11]
    # The token after each marked position is the completion token it predicts, in order.
    assert batch.inputs["input_ids"].flatten()[batch.completion_positions + 1].tolist() == batch.completion_ids.tolist()
    assert batch.num_tokens == 5


def test_shared_prompts_pack_each_prompt_once_with_its_completions_after_it():
    first, second = EncodedPrompt([1, 2, 3]), EncodedPrompt([4])
    prompts, completions = [first, second, first], [[7, 8], [9, 10, 11], [12]]
    batch = collate(prompts, completions, pad_id=0, packed_row_tokens=6)
    assert batch.inputs["input_ids"].tolist() == [[1, 2, 3, 7, 8, 12], [4, 9, 10, 11, 0, 0]]
    # Each completion sits where it would after its prompt alone.
    assert batch.inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 0, 0]]
    mask = batch.inputs["attention_mask"][:, 0]
    assert mask[0, 5].tolist() == [True, True, True, False, False, True]  # prompt and itself, not [7, 8]
    assert mask[0, 4].tolist() == [True, True, True, True, True, False]
    assert mask[1, 5].tolist() == [False, False, False, False, False, True]  # padding: itself only
    # Completion ids in the examples' order; a prompt's last position predicts both its first tokens.
    assert batch.completion_ids.tolist() == [7, 8, 9, 10, 11, 12]
    assert batch.completion_positions.tolist() == [2, 3, 6, 7, 8, 2]
    assert collate(prompts[:2], completions[:2], 0, packed_row_tokens=6).inputs["attention_mask"].dim() == 2  # nothing shared
    # A completion that would make the row longer than the budget starts a row of its own.
    split = collate(prompts, completions, pad_id=0, packed_row_tokens=5)
    assert split.inputs["input_ids"].tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0], [1, 2, 3, 12, 0]]
    assert split.completion_ids.tolist() == [7, 8, 9, 10, 11, 12]
    assert split.completion_positions.tolist() == [2, 3, 5, 6, 7, 12]


def test_prompts_that_begin_alike_share_one_copy_of_their_beginning_per_row():
    first, second = EncodedPrompt([1, 2, 3, 4]), EncodedPrompt([1, 2, 5])
    prompts, completions = [first, second, first], [[7, 8], [9], [10]]
    batch = collate(prompts, completions, pad_id=0, packed_row_tokens=16)
    # [1, 2] once, then each prompt's own rest followed by its completions.
    assert batch.inputs["input_ids"].tolist() == [[1, 2, 3, 4, 7, 8, 10, 5, 9]]
    assert batch.inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 4, 2, 3]]
    mask = batch.inputs["attention_mask"][0, 0]
    assert mask[8].tolist() == [True, True, False, False, False, False, False, True, True]  # 9: [1, 2], 5, itself
    assert mask[6].tolist() == [True, True, True, True, False, False, True, False, False]  # 10: [1, 2, 3, 4], itself
    assert mask[7].tolist() == [True, True, False, False, False, False, False, True, False]  # 5: [1, 2], itself
    assert batch.completion_ids.tolist() == [7, 8, 9, 10]
    assert batch.completion_positions.tolist() == [3, 4, 7, 3]
    assert batch.inputs["input_ids"].flatten()[batch.completion_positions[:2] + 1].tolist() == [7, 8]
    # Off: a row per prompt, as without a common beginning.
    alone = collate(prompts, completions, pad_id=0, packed_row_tokens=16, share_prefix=False)
    assert alone.inputs["input_ids"].tolist() == [[1, 2, 3, 4, 7, 8, 10], [1, 2, 5, 9, 0, 0, 0]]
    # One sample per prompt: the beginning alone is worth a packed row.
    assert collate([first, second], [[7], [9]], 0, packed_row_tokens=16).inputs["input_ids"].tolist() == [[1, 2, 3, 4, 7, 5, 9]]


def test_a_shared_beginning_ends_at_the_first_picture_and_leaves_each_prompt_an_id():
    def shared(*ids, image_token_id=None, vision=False):
        pictures = {"pixel_values": torch.zeros(1, 1, 3, 2, 2)} if vision else {}
        return shared_prefix_length([EncodedPrompt(list(i), dict(pictures)) for i in ids], image_token_id)

    assert shared([1, 2, 99, 4], [1, 2, 99, 5], image_token_id=99, vision=True) == 2  # the pictures differ
    assert shared([1, 2, 99, 4], [1, 2, 99, 5], vision=True) == 0  # placeholder unknown: nothing shared
    assert shared([1, 2, 99, 4], [1, 2, 99, 5]) == 3  # text: 99 is a word like another
    assert shared([1, 2], [1, 2, 3]) == 1  # [1, 2] stays a prompt of its own
    assert shared([1, 2, 3]) == 0  # one prompt: nothing to share with


def test_packed_rows_are_balanced_within_the_budget_and_as_many_as_cost_least():
    assert balanced_rows([5, 4, 3, 3, 2, 1], capacity=9, count=2) == [[0, 3, 5], [1, 2, 4]]  # 9 and 9
    assert balanced_rows([6, 6, 6], capacity=9, count=2) is None
    # Without attention's cost the fewest positions, padding included; short chunks behind a long
    # prefix: few rows too.
    assert cheapest_rows([6, 6, 6, 6], prefix=2, max_row_tokens=14, pair_cost=0.0) == [[0, 2], [1, 3]]  # 2 x 14
    assert cheapest_rows([6, 6, 6], prefix=2, max_row_tokens=14, pair_cost=0.0) == [[0], [1], [2]]  # 3 x 8 < 2 x 14
    assert cheapest_rows([4] * 6, prefix=20, max_row_tokens=64, pair_cost=1 / 3456) == [[0, 1, 2, 3, 4, 5]]
    # Long chunks behind a short prefix: attention across them would cost more than the prefix saves.
    assert cheapest_rows([2000] * 4, prefix=20, max_row_tokens=10240, pair_cost=1 / 3456) == [[0], [1], [2], [3]]
    prompts = [EncodedPrompt([1, 2, 3 + i]) for i in range(6)]
    completions = [[7] * n for n in (5, 1, 2, 4, 3, 1)]
    batch = collate(prompts, completions, pad_id=0, packed_row_tokens=13)
    rows = batch.inputs["input_ids"]
    # [1, 2] then 1 + n tokens per prompt: 22 after the beginnings, two rows of 2 + 11, no padding.
    assert rows.shape == (2, 13) and (rows != 0).sum(dim=1).tolist() == [13, 13]
    assert sorted(batch.completion_ids.tolist()) == sorted(t for c in completions for t in c)


def test_completions_are_cut_to_the_longer_prompt_and_dropped_when_nothing_fits():
    short, long = EncodedPrompt([1] * 4), EncodedPrompt([1] * 7)
    assert completion_budget(short, long, 10) == 3 and completion_budget(long, long, 7) == 0
    completions = [
        Completion(0, [5, 6, 7, 8, 9], [-1.0] * 5),  # cut to 3
        Completion(0, [], []),  # empty: dropped
        Completion(1, [5], [-1.0]),  # prompt already at the budget: dropped
    ]
    examples, counts = build_examples([short, long], [long, EncodedPrompt([1] * 10)], ["a", "b"], completions, 10)
    assert [(e.sample_id, e.completion_ids, len(e.engine_logprobs)) for e in examples] == [("a", [5, 6, 7], 3)]
    assert counts == {"empty_completions": 1, "truncated_completions": 1, "prompt_too_long": 1}


def test_the_teacher_sequence_ends_with_the_student_completion_ids(processor):
    from opsd.pipeline import Rollout, rollout_examples

    run_cfg = config_from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "prompts": {"privileged": ["text"]}})
    cfg = run_cfg.prompts
    samples = [sample(0), sample(1)]
    prompts = [student_prompt(s, processor, cfg) for s in samples]
    completions = [Completion(1, [11, 12], [-0.5, -0.5]), Completion(0, [13], [-0.1])]
    rollout = Rollout(samples, prompts, completions)
    examples, _ = rollout_examples(rollout, processor, run_cfg)
    assert [e.sample_id for e in examples] == ["s1", "s0"]
    for e, s in zip(examples, [samples[1], samples[0]]):
        assert e.teacher.input_ids == encode_prompt(processor, teacher_prompt(s, processor, cfg)).input_ids
        assert len(e.teacher.input_ids) > len(e.student.input_ids)  # the worked solution
    # Without the privileged prompt (`--check`'s first check) the teacher sequence is the student's.
    same, _ = rollout_examples(rollout, processor, run_cfg, privileged=False)
    assert all(e.teacher is e.student for e in same)


def test_prompt_length_check_measures_the_teacher_prompt(processor):
    cfg = PromptConfig(privileged=["text"])
    s = sample(privileged_text="step " * 200)
    student_len = len(encode_prompt(processor, student_prompt(s, processor, cfg)).input_ids)
    check = prompt_length_check(processor, cfg, max_forward_tokens=student_len + 10)
    with pytest.raises(BadSample) as err:
        check(s)
    assert err.value.reason == "prompt_too_long"
    prompt_length_check(processor, cfg, max_forward_tokens=4096)(s)  # fits: no error


def test_padding_example_is_one_token():
    example = padding_example(EncodedPrompt([1, 2]), EncodedPrompt([1, 2, 3]), token_id=0)
    assert example.completion_ids == [0] and example.engine_logprobs == [0.0]


def test_flat_patches_concatenate_whatever_their_rank(tiny_paddleocr_vl_dir):
    """PaddleOCR-VL's patches are 4-D ([patches, C, 14, 14]) yet flat like Qwen-VL's 2-D ones: the
    batch concatenates them beside `image_grid_thw`, it does not pad them per image like Idefics3's."""
    from PIL import Image

    from opsd.config import ModelConfig
    from opsd.modeling import load_processor
    from opsd.prompts import Prompt
    from opsd.sequences import collate, encode_prompt, flat_patches
    from opsd.tiny_models import PADDLE_IMAGE

    processor = load_processor(ModelConfig(path=str(tiny_paddleocr_vl_dir)))
    prompts = [encode_prompt(processor, Prompt(f"{PADDLE_IMAGE * len(sizes)} hi", [Image.new("RGB", s) for s in sizes]))
               for sizes in ([(112, 60)], [(56, 56), (40, 90)], [])]
    assert flat_patches(prompts[0].vision) and prompts[0].vision["pixel_values"].dim() == 4
    batch = collate(prompts, [[5], [6, 7], [8]], pad_id=0)
    assert batch.inputs["pixel_values"].shape[0] == sum(p.vision["pixel_values"].shape[0] for p in prompts if p.vision)
    assert batch.inputs["image_grid_thw"].shape == (3, 3)
