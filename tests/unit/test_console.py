"""The quiet console: third-party logging, warnings and native output go to run.log, once each."""

import logging
import os
import sys
import warnings

from opsd.trainer.console import THIRD_PARTY_LOG, native_output_to_log, third_party_output


def emit_third_party_noise():
    for _ in range(3):  # vLLM repeats some warnings on every request
        logging.getLogger("vllm.v1.worker.cpu_worker").warning("CPU backend doesn't allow torch.set_num_threads")
    logging.getLogger("transformers.configuration_utils").warning("pad_token_id out of the vocabulary")
    warnings.warn("reduce_op is deprecated", FutureWarning)


def test_third_party_output_goes_to_the_log_once_and_not_to_the_console(tmp_path, capfd):
    root_handlers = logging.getLogger().handlers[:]
    with third_party_output(tmp_path, verbose=False) as path:
        emit_third_party_noise()
    out, err = capfd.readouterr()
    assert path == tmp_path / THIRD_PARTY_LOG
    log = path.read_text()
    assert log.count("set_num_threads") == 1
    assert "pad_token_id" in log and "reduce_op is deprecated" in log
    assert "set_num_threads" not in out + err and "pad_token_id" not in out + err
    assert logging.getLogger().handlers == root_handlers  # undone afterwards


def test_verbose_also_shows_it_on_the_console(tmp_path, capfd):
    with third_party_output(tmp_path, verbose=True):
        emit_third_party_noise()
    err = capfd.readouterr().err
    assert err.count("set_num_threads") == 1 and "pad_token_id" in err
    assert "pad_token_id" in (tmp_path / THIRD_PARTY_LOG).read_text()


def test_transformers_progress_bars_are_off_inside_and_restored_after(tmp_path):
    from transformers.utils import logging as transformers_logging

    assert transformers_logging.is_progress_bar_enabled()
    with third_party_output(tmp_path):
        assert not transformers_logging.is_progress_bar_enabled()
    assert transformers_logging.is_progress_bar_enabled()


def test_native_output_goes_to_the_log_file(tmp_path, capfd):
    log = tmp_path / "run.log"
    with native_output_to_log(log):
        os.write(2, b"NUMA binding notice from C++\n")
        os.write(1, b"loading shards\n")
        print("a progress bar to sys.stderr", file=sys.stderr)  # not descriptor 2 under a capture or a notebook
    os.write(2, b"after\n")
    out, err = capfd.readouterr()
    assert "NUMA" not in err and "loading shards" not in out and "progress bar" not in err and "after" in err
    assert log.read_text() == "NUMA binding notice from C++\nloading shards\na progress bar to sys.stderr\n"
