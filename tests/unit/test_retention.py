"""Retention probes (eval.retention): where the text comes from, the likelihood probe on a real
(tiny) model, the question probe through a real engine, both split over ranks, and bad input."""

import json

import pytest
import torch

from opsd.config import ConfigError, ModelConfig, RetentionConfig
from opsd.data.errors import DataConfigError
from opsd.data.retention_questions import GENERAL_QUESTIONS, answered_right, load_questions
from opsd.retention import RetentionProbe, question_accuracy, text_nll, text_pieces, text_source


@pytest.fixture(scope="module")
def tiny(tiny_text_dir):
    from opsd.modeling import load_model, load_processor

    cfg = ModelConfig(path=str(tiny_text_dir))
    processor = load_processor(cfg)
    return cfg, processor, load_model(cfg, processor, torch.device("cpu"))


class SplitRanks:
    """Rank `rank` of `world_size`: `sum` records what this rank contributes and returns it."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size, self.sent = rank, world_size, []

    def sum(self, values):
        self.sent.append(list(values))
        return list(values)


def test_the_default_text_is_the_apache_licence_transformers_ships():
    path = text_source(RetentionConfig().text)
    assert ".dist-info" in path.as_posix() and "Apache License" in path.read_text()[:300]


@pytest.mark.parametrize("source, named", [
    ("no-such-package-opsd:LICENSE", "package 'no-such-package-opsd' is not installed"),
    ("transformers:NO_SUCH_FILE.txt", "ships no file 'NO_SUCH_FILE.txt'"),
    ("/nonexistent/retention.txt", "no file '/nonexistent/retention.txt'"),
])
def test_a_missing_text_is_named(source, named):
    with pytest.raises(ConfigError, match="eval.retention.text") as err:
        text_source(source)
    assert named in str(err.value)


def test_text_pieces_cover_the_first_tokens(tmp_path, tiny):
    _, processor, _ = tiny
    file = tmp_path / "text.txt"
    file.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    pieces = text_pieces(str(file), processor, max_tokens=50, piece_tokens=16)
    ids = processor(file.read_text(), add_special_tokens=False)["input_ids"]
    assert [len(p) for p in pieces] == [16, 16, 16, 2] and sum(pieces, []) == ids[:50]  # a 2-token tail predicts 1
    pieces = text_pieces(str(file), processor, max_tokens=49, piece_tokens=16)
    assert [len(p) for p in pieces] == [16, 16, 16] and sum(pieces, []) == ids[:48]  # a 1-token tail: dropped


def test_text_nll_is_the_models_own_likelihood_and_moves_only_with_the_weights(tiny):
    _, processor, model = tiny
    pieces = text_pieces(RetentionConfig().text, processor, max_tokens=96, piece_tokens=32)
    before = text_nll(model, pieces, pad_id=0)
    with torch.no_grad():  # the same number from the model's own forward
        expected = torch.cat([
            -torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, :-1].float(), -1)
            .gather(-1, torch.tensor(p[1:])[:, None])[:, 0] for p in pieces
        ]).mean().item()
    assert before == pytest.approx(expected, rel=1e-5) and before > 0
    model.train()
    assert text_nll(model, pieces, pad_id=0) == before  # untouched weights: not a hair of movement
    assert model.training  # the probe scores in eval mode and gives the mode back
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        assert abs(text_nll(model, pieces, pad_id=0) - before) > 1e-3
    finally:
        model.load_state_dict(state)


def test_text_nll_split_over_ranks_counts_every_piece_once(tiny):
    _, processor, model = tiny
    pieces = text_pieces(RetentionConfig().text, processor, max_tokens=80, piece_tokens=16)
    assert len(pieces) == 5  # 3 on rank 0, 2 + a padding forward on rank 1
    whole = text_nll(model, pieces, pad_id=0)
    shares = [SplitRanks(r, 2) for r in range(2)]
    for ranks in shares:
        text_nll(model, pieces, pad_id=0, ranks=ranks)
    total, count = (sum(s.sent[0][i] for s in shares) for i in range(2))
    assert count == sum(len(p) - 1 for p in pieces) and total / count == pytest.approx(whole, rel=1e-6)


def test_question_probe_through_a_real_engine_moves_when_the_weights_do(tmp_path, tiny):
    from opsd.rollout.hf_engine import HFEngine

    cfg, processor, model = tiny
    engine = HFEngine(type(model).from_pretrained(cfg.path), processor)
    questions = [q for q, _ in GENERAL_QUESTIONS[:6]]
    probe = RetentionProbe.build(RetentionConfig(text=None, questions="general", max_new_tokens=6), processor)
    # What this random model answers at "step 0" is what it knows: make those the answers.
    settings = probe.settings
    said = [c.text.strip() for c in sorted(engine.generate(probe.prompts[:6], settings), key=lambda c: c.prompt_index)]
    file = tmp_path / "known.jsonl"
    file.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in zip(questions, said) if a))
    probe = RetentionProbe.build(RetentionConfig(text=None, questions=str(file), max_new_tokens=6), processor)
    assert probe.measure(None, engine) == {"eval/retention_accuracy": 1.0}
    assert probe.measure(None, engine) == {"eval/retention_accuracy": 1.0}  # untouched: the same
    shares = [SplitRanks(r, 2) for r in range(2)]
    right = sum(question_accuracy(engine, probe.prompts, probe.answers, settings, ranks) for ranks in shares)
    assert right == 1.0 and [s.sent for s in shares] == [[[3]], [[len(probe.prompts) - 3]]]
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    assert probe.measure(None, engine)["eval/retention_accuracy"] < 1.0


def test_general_questions_and_a_questions_file(tmp_path):
    assert len(load_questions("general")) == 24 and load_questions("general") == GENERAL_QUESTIONS
    good = tmp_path / "q.jsonl"
    good.write_text('{"question": "Capital of France?", "answers": ["Paris"]}\n\n{"question": "2+2?", "answers": ["4", "four"]}\n')
    assert load_questions(str(good)) == (("Capital of France?", ("Paris",)), ("2+2?", ("4", "four")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Capital of France?", "answers": ["Paris"]}\n{"question": "2+2?", "answers": "4"}\n')
    with pytest.raises(DataConfigError, match=r"bad.jsonl, line 2: needs \"question\" \(text\) and \"answers\""):
        load_questions(str(bad))
    with pytest.raises(DataConfigError, match="neither `general` nor a file"):
        load_questions(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("completion, answers, right", [
    ("The capital of France is Paris.", ("Paris",), True),
    ("paris, of course", ("Paris",), True),
    ("Parisian cafes", ("Paris",), False),
    ("A spider has 8 legs.", ("eight", "8"), True),
    ("The square root of 9 is approximately 3.09.", ("3",), False),
    ("It is Leonardo da Vinci.", ("da Vinci",), True),
])
def test_an_answer_counts_as_a_whole_word(completion, answers, right):
    assert answered_right(completion, answers) is right


@pytest.mark.parametrize("retention, named", [
    ({"txt": "notes.txt"}, "eval.retention.txt: Unexpected keyword"),  # a misspelt key
    ({"text": None, "questions": None}, "eval.retention: Value error, text and questions are both off"),
    ({"text": " "}, "eval.retention.text: Value error, empty"),
    ({"questions": ""}, "eval.retention.questions: Value error, empty"),
    ({"chunk_tokens": 1}, "eval.retention.chunk_tokens: Input should be greater than 1"),
    ({"text_tokens": "many"}, "eval.retention.text_tokens"),
    ({"max_new_tokens": 0}, "eval.retention.max_new_tokens: Input should be greater than 0"),
    ("yes", "eval.retention: Input should be a dictionary"),
])
def test_bad_retention_keys_and_values_are_named(retention, named):
    from opsd.config import config_from_dict

    raw = {"model": {"path": "m"}, "data": {"path": "d"}, "eval": {"every": 5, "retention": retention}}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert named in str(err.value)


def test_retention_needs_evaluations_and_takes_defaults_from_an_empty_section():
    from opsd.config import config_from_dict

    raw = {"model": {"path": "m"}, "data": {"path": "d"}, "eval": {"every": 5, "retention": {}}}
    assert config_from_dict(raw).eval.retention == RetentionConfig()
    assert config_from_dict({**raw, "eval": {"every": 5}}).eval.retention is None  # off unless asked for
    raw["eval"]["every"] = 0
    with pytest.raises(ConfigError, match=r"eval: .*set eval\.every > 0"):
        config_from_dict(raw)


def test_a_bad_retention_source_stops_the_run_with_one_error_line(tmp_path, tiny_text_dir, capsys):
    """The probe's text and questions are resolved with the evaluation set, before any weights load."""
    from opsd.train import main

    args = ["--config", "configs/learn_facts_smollm2.yaml", f"model.path={tiny_text_dir}", "model.build=null",
            "rollout.engine=hf", f"data.datasets.0.path={tmp_path / 'facts'}", f"logging.output_dir={tmp_path / 'run'}"]
    assert main([*args, "eval.retention.text=no-such-package-opsd:LICENSE"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: eval.retention.text: package 'no-such-package-opsd' is not installed "
                   "(name another package:file, a path, or null to turn the text probe off)"]
    assert main([*args, f"eval.retention.questions={tmp_path / 'missing.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: eval.retention.questions: '{tmp_path / 'missing.jsonl'}' is neither `general` nor a file"]
