"""Out-of-process rollout engine: a separate `vllm serve` on this host, driven over HTTP.

Start the server with `python -m opsd.rollout.serve --config ...` (it prints and runs the exact
`vllm serve` command line), then train with `rollout.engine=server`.

- generate: one `/inference/v1/generate` request per prompt (vLLM's token-in/token-out API), all in
  flight at once so the server batches them. The prompt goes as token ids, exactly the trainer's
  tokenisation, with its images as PNG data URLs; the answer holds the sampled ids and their
  logprobs. Sampling parameters are the colocated engine's (opsd/rollout/vllm_args.py).
- weight sync: tensors cannot travel through the server's `/collective_rpc` (strings only), so each
  bucket is written to a safetensors file under /dev/shm and loaded by the worker extension
  (opsd/rollout/server_worker.py) inside one reload session per update, then deleted: at most one
  bucket is staged at a time. After the update the prefix, multimodal and encoder caches are reset.
"""

from __future__ import annotations

import base64
import io
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from pathlib import Path

import httpx
import torch

from opsd.prompts import Prompt, tokenizer_of
from opsd.rollout.engine import Completion, EngineCapabilities, EngineLost, SamplingSettings
from opsd.rollout.receivers import save_bucket
from opsd.rollout.vllm_args import sampling_params

LAUNCH_HINT = "start it with `python -m opsd.rollout.serve --config <your config>` (see README, out-of-process engine)"


class ServerError(RuntimeError):
    """The server refused a request or is not set up for opsd; the message says which and why."""


class ServerLost(ServerError, EngineLost):
    """The server stopped answering during the run: its connection was refused or cut, or its
    `/health` did not answer within `health_timeout_s`."""


def _png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server decodes the trainer's exact pixels
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _staging_dir(weights_dir: str | None) -> tuple[Path, bool]:
    """(directory, created here): the configured one, or a fresh one in shared memory."""
    if weights_dir:
        Path(weights_dir).mkdir(parents=True, exist_ok=True)
        return Path(weights_dir), False
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() else None  # RAM-backed on Linux; elsewhere the temp dir
    return Path(tempfile.mkdtemp(prefix="opsd-weights-", dir=root)), True


class _DaemonPool:
    """Up to `size` calls at once, each in a daemon thread: a call blocked on a frozen server (up to
    `request_timeout_s`) neither holds the caller, who gives up on it (`ServerEngine._guarded`), nor the
    process's exit, as the worker threads of a ThreadPoolExecutor would (they are joined at exit)."""

    def __init__(self, size: int):
        self._slots = threading.BoundedSemaphore(size)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()

        def run():
            with self._slots:
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # handed to the caller through the future
                    future.set_exception(err)

        threading.Thread(target=run, daemon=True, name="opsd-server-request").start()
        return future


class ServerEngine:
    def __init__(
        self,
        url: str,
        processor,
        *,
        weights_dir: str | None = None,
        startup_timeout_s: float = 300,
        request_timeout_s: float = 600,
        health_timeout_s: float = 10,
        max_parallel_requests: int = 32,
        weight_dtype: torch.dtype | None = None,
        frozen_vision: bool = False,
    ):
        self.url = url
        # The server's weight dtype: weight buckets are written in it (half the bytes in bfloat16);
        # the server's vLLM loads weights under their checkpoint names.
        self.capabilities = EngineCapabilities(weight_dtype=weight_dtype, checkpoint_names=True)
        self.frozen_vision = frozen_vision  # as VLLMEngine's: updates after the first keep the image encodings
        self.weight_updates = 0
        self.tokenizer = tokenizer_of(processor)
        self.client = httpx.Client(base_url=url, timeout=request_timeout_s)
        self.health_timeout_s = health_timeout_s
        self._probe = httpx.Client(base_url=url, timeout=health_timeout_s)  # its own short timeout
        self._ready = False
        self._wait_until_ready(startup_timeout_s)
        self.model = self._call("GET", "/v1/models")["data"][0]["id"]
        self.weights_dir, owns_weights_dir = _staging_dir(weights_dir)
        # Removed on close, and at exit when a crash skips close (shared memory outlives processes).
        self._remove_weights_dir = weakref.finalize(self, shutil.rmtree, self.weights_dir, ignore_errors=True)
        if not owns_weights_dir:
            self._remove_weights_dir.detach()
        self._pool = _DaemonPool(max_parallel_requests)
        self._calls = _DaemonPool(1)  # weight-sync calls: one at a time, in order
        self._bucket_index = 0
        self._ready = True  # from here on, a server that stops answering is lost, not missing

    @classmethod
    def from_config(cls, cfg, processor) -> "ServerEngine":
        s = cfg.rollout.server
        return cls(
            s.url, processor, weights_dir=s.weights_dir, startup_timeout_s=s.startup_timeout_s,
            request_timeout_s=s.request_timeout_s, health_timeout_s=s.health_timeout_s,
            max_parallel_requests=s.max_parallel_requests,
            weight_dtype=getattr(torch, cfg.model.dtype),  # the server runs with --dtype model.dtype
            frozen_vision=cfg.model.freeze_vision,
        )

    # -- HTTP -------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None):
        try:
            response = self.client.request(method, path, json=body)
        except httpx.TransportError as err:
            if self._ready:
                raise ServerLost(f"rollout server {self.url} stopped answering: {path} failed with {err!r} "
                                 "(the server died or its connection was cut)") from err
            raise ServerError(f"rollout server {self.url}{path}: {err!r}; is it running? {LAUNCH_HINT}") from err
        if response.status_code == 404:
            raise ServerError(f"rollout server {self.url} has no endpoint {path}; {LAUNCH_HINT}")
        if response.is_error:
            raise ServerError(f"rollout server {self.url}{path} answered {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else None

    def _rpc(self, method: str, *args: str) -> list:
        """Call a worker-extension method on every worker; string arguments only."""
        return self._guarded(self._calls.submit(self._call, "POST", "/collective_rpc", {"method": method, "args": list(args)}))[0]["results"]

    def _guarded(self, *futures):
        """The results of requests in flight, probing `/health` every `health_timeout_s` (with that
        timeout) while they run: a server that does not answer the probe is lost, whatever the
        requests' own `request_timeout_s`."""
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=self.health_timeout_s, return_when=FIRST_EXCEPTION)
            if any(f.done() and f.exception() is not None for f in futures):
                break
            if pending:
                self._check_health()
        return [f.result() for f in futures]

    def _check_health(self) -> None:
        started = time.monotonic()
        try:
            status = self._probe.get("/health").status_code
        except httpx.TransportError as err:
            reason = (f"no answer to /health within {self.health_timeout_s:g} s (rollout.server.health_timeout_s): "
                      "the server is frozen or overloaded" if isinstance(err, httpx.TimeoutException)
                      else f"/health failed with {err!r}: the server died")
            raise ServerLost(f"rollout server {self.url} stopped answering: {reason}") from err
        if status != 200:
            raise ServerLost(f"rollout server {self.url} is unhealthy: /health answered {status} after "
                             f"{time.monotonic() - started:.1f} s")

    def _wait_until_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"no healthy rollout server at {self.url} after {timeout_s:.0f} s; {LAUNCH_HINT}")
            time.sleep(0.5)
        ping = self.client.post("/collective_rpc", json={"method": "opsd_ping"})
        if ping.status_code == 404:
            raise ServerError(
                f"rollout server {self.url} has no /collective_rpc: the weight sync needs its dev "
                f"endpoints (VLLM_SERVER_DEV_MODE=1); {LAUNCH_HINT}"
            )
        if ping.is_error:
            raise ServerError(
                f"rollout server {self.url} lacks opsd's worker extension "
                f"(--worker-extension-cls opsd.rollout.server_worker.WeightSyncExtension); {LAUNCH_HINT}"
            )

    # -- sampling ---------------------------------------------------------------------------------
    def _request(self, prompt: Prompt, sampling: SamplingSettings, prompt_index: int) -> dict:
        body = {
            "model": self.model,
            # Token ids, so the server cannot add special tokens the trainer's tokenisation did not;
            # an image stays one placeholder token each, which the server expands.
            "token_ids": self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"],
            "sampling_params": {
                **sampling_params(sampling, prompt_index),
                "logit_bias": {str(t): -100.0 for t in sampling.banned_token_ids} or None,  # JSON keys
                "detokenize": False,  # text is decoded here, with the trainer's tokenizer
            },
            "output_mode": "tokens",
        }
        if prompt.images:
            body["content_parts"] = [{"type": "image_url", "url": _png_data_url(im)} for im in prompt.images]
        return body

    def generate(self, prompts: list[Prompt], sampling: SamplingSettings) -> list[Completion]:
        requests = [self._request(p, sampling, i) for i, p in enumerate(prompts)]
        responses = self._guarded(*(self._pool.submit(self._call, "POST", "/inference/v1/generate", body) for body in requests))
        completions = []
        for i, response in enumerate(responses):
            for choice in sorted(response["choices"], key=lambda c: c["index"]):
                ids = choice["token_ids"]
                steps = choice["logprobs"]["content"]
                if [s["token_id"] for s in steps] != ids:
                    raise ServerError(f"rollout server {self.url}: logprobs do not follow the sampled ids")
                completions.append(Completion(
                    i, ids, [s["logprob"] for s in steps],
                    self.tokenizer.decode(ids, skip_special_tokens=True), str(choice["finish_reason"]),
                ))
        return completions

    # -- weight sync: one reload session per update -----------------------------------------------
    def begin_weight_update(self) -> None:
        self._rpc("opsd_begin_weight_update")
        self._bucket_index = 0

    def receive_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        path = self.weights_dir / f"bucket-{self._bucket_index:05d}.safetensors"
        self._bucket_index += 1
        save_bucket(bucket, path)
        try:
            self._rpc("opsd_load_weights_file", str(path))
        finally:
            path.unlink(missing_ok=True)

    def end_weight_update(self) -> None:
        keep = self.frozen_vision and self.weight_updates > 0
        self._rpc("opsd_finish_weight_update", *(["keep_image_encodings"] if keep else []))
        # Cached KV blocks and image encodings were computed by the old weights; the scheduler
        # keeps its own record of cached encodings, so it is reset too (else "Encoder cache miss").
        for path in ("/reset_prefix_cache", "/reset_mm_cache", *([] if keep else ["/reset_encoder_cache"])):
            self._guarded(self._calls.submit(self._call, "POST", path))
        self.weight_updates += 1

    def weight_checksums(self) -> dict[str, str]:
        """Digest of every engine parameter, as the colocated engine offers."""
        return self._call("POST", "/weight_checker", {"action": "checksum"})["checksums"]

    def close(self) -> None:
        """Drops the connection and the staging dir; the server itself keeps running (not ours)."""
        self._probe.close()
        self.client.close()
        self._remove_weights_dir()
