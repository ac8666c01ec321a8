"""A rollout server that dies or freezes mid-run is a named `EngineLost` within a bounded time
(a `/health` probe with its own short timeout), not a traceback or a 600 s wait. A fake server
stands in for `vllm serve`: it answers what `ServerEngine` asks at start, then dies or freezes."""

import http.server
import json
import threading
import time

import pytest

from opsd.prompts import Prompt
from opsd.rollout import EngineLost, SamplingSettings
from opsd.rollout.server_engine import ServerEngine


class FakeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *args):
        super().__init__(*args)
        self.frozen = threading.Event()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.server.frozen.is_set():
            time.sleep(60)  # SIGSTOPped: the connection is accepted, nothing answers
        self._answer({"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/inference/v1/generate":
            time.sleep(60)  # a generation the server never finishes
        self._answer({"results": [None]})


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1, 2, 3]}


@pytest.fixture
def server():
    fake = FakeServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    yield fake
    fake.shutdown()
    fake.server_close()


def engine_of(server):
    return ServerEngine(f"http://127.0.0.1:{server.server_address[1]}", Tokenizer(), health_timeout_s=0.5,
                        request_timeout_s=600)


def generate(engine):
    engine.generate([Prompt("hi", [])], SamplingSettings(max_new_tokens=4))


def test_a_frozen_server_is_named_within_twice_the_health_timeout(server):
    engine = engine_of(server)
    server.frozen.set()
    start = time.monotonic()
    with pytest.raises(EngineLost, match=r"stopped answering: no answer to /health within 0.5 s "
                                         r"\(rollout.server.health_timeout_s\): the server is frozen"):
        generate(engine)
    assert time.monotonic() - start < 3  # not request_timeout_s
    engine.close()


def test_a_dead_server_is_named_at_once(server):
    engine = engine_of(server)
    server.shutdown()
    server.server_close()
    start = time.monotonic()
    with pytest.raises(EngineLost, match=r"stopped answering: .*the server died"):
        engine.begin_weight_update()
    assert time.monotonic() - start < 3
    engine.close()
