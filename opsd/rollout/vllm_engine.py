"""Colocated vLLM engine: runs in the training process and takes the trainer's weights in place."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from opsd.prompts import Prompt
from opsd.rollout.colocate import engine_kwargs, generate_in_group
from opsd.rollout.engine import Completion, EngineCapabilities, SamplingSettings
from opsd.rollout.vllm_args import VLLMOptions, cpu_environment, engine_args, sampling_params
from opsd.rollout.vllm_reload import (
    begin_reload,
    check_vllm_version,
    finish_reload,
    load_bucket,
    quiet_rotary_reload_warning,
    reset_caches,
)


_OWN_RPC_DIRS: set[str] = set()
"""`VLLM_RPC_BASE_PATH` directories these engines made (a user's own setting is left alone)."""


def _set_env_defaults() -> str | None:
    """Set vLLM's environment defaults; returns the socket directory made for this engine, if any."""
    # In-process engine core: starts in ~2 s instead of ~15 s and lets us hand it tensors directly.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # per-request INFO lines drown the trainer's
    rpc_dir = None
    if os.environ.get("VLLM_RPC_BASE_PATH") in _OWN_RPC_DIRS | {None}:
        # The engine's ZMQ socket files go to a directory of its own, out of the shared /tmp root;
        # `close` removes it (and process exit, when a crash skips `close`).
        rpc_dir = tempfile.mkdtemp(prefix="opsd-vllm-")
        _OWN_RPC_DIRS.add(rpc_dir)
        os.environ["VLLM_RPC_BASE_PATH"] = rpc_dir
    for key, value in cpu_environment().items():
        os.environ.setdefault(key, value)
    if not torch.cuda.is_available():
        # vLLM's CPU worker pins threads; without this torch in the same process may fall to one.
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return rpc_dir


def _remove_rpc_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _OWN_RPC_DIRS.discard(path)
    if os.environ.get("VLLM_RPC_BASE_PATH") == path:
        del os.environ["VLLM_RPC_BASE_PATH"]


def _shm_or_tmp() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class VLLMEngine:
    def __init__(self, options: VLLMOptions):
        """`VLLMOptions` (opsd/rollout/vllm_args.py) says what each option sets in vLLM."""
        self.rpc_dir = _set_env_defaults()
        """This engine's socket directory (None: the user's VLLM_RPC_BASE_PATH); removed on close."""
        self._remove_rpc_dir = weakref.finalize(self, _remove_rpc_dir, self.rpc_dir) if self.rpc_dir else None
        check_vllm_version()
        from vllm import LLM

        quiet_rotary_reload_warning()
        # vLLM refuses sleep mode on CPU; on GPUs it frees the engine's memory while the trainer trains.
        self.sleep_mode = options.sleep_mode and torch.cuda.is_available()
        self._asleep: set[str] = set()
        self._weights_discarded = False
        self.tensor_parallel_size = options.tensor_parallel_size
        self.weight_dtype = getattr(torch, options.dtype)
        """The engine's weights are `dtype`: the weight sync casts (and gathers) in it."""
        self.frozen_vision = options.frozen_vision
        self.weight_updates = 0
        # vLLM's start runs full garbage collections (its memory profiling) and ends by freezing the
        # heap (`freeze_gc_heap`; its shutdown unfreezes it). Frozen first, those collections skip the
        # objects this process already holds (torch, transformers, the trainer's model): the tiny VLM's
        # engine starts in about 3.2 s instead of 4.0, this collection included (bench/engine_start.py).
        gc.collect()
        gc.freeze()
        self.llm = LLM(**engine_args(options), **engine_kwargs(tensor_parallel_size=options.tensor_parallel_size))
        self.tokenizer = self.llm.get_tokenizer()
        self._lora_request = None  # the adapter every request names, once one was received
        self._adapter_root = Path(tempfile.mkdtemp(prefix="opsd-adapters-", dir=_shm_or_tmp())) if options.max_lora_rank else None
        if self._adapter_root is not None:  # removed on close, and at exit when a crash skips close (shared memory)
            weakref.finalize(self, shutil.rmtree, self._adapter_root, ignore_errors=True)

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            release_memory=True,
            # Every rank of a tensor-parallel engine must call `generate`, with or without prompts.
            generate_is_collective=self.tensor_parallel_size > 1,
            weight_dtype=self.weight_dtype,
            receive_adapter=self._adapter_root is not None,
            checkpoint_names=True,  # vLLM loads weights under their names in the checkpoint files
            # Asleep at level 2 (full weights on a GPU) the engine drops its weights.
            discards_weights=self.sleep_mode and self._adapter_root is None,
        )

    # Sleep mode (CUDA): asleep from the end of the step's rollouts to the weight sync, so that
    # training has the memory. Level 2 discards the weights (the sync after the step reloads every
    # one of them; level 1 would copy ~16 GB at 7B to pinned host memory and back for nothing) and the
    # KV cache; vLLM 0.32 keeps the buffers. The training allocator's cached blocks are returned to
    # the driver before waking, or the wake-up can run out.
    def release_memory(self) -> None:
        """Free the engine's GPU memory until the next weight update (which must follow)."""
        if self.sleep_mode and not self._asleep:
            # With LoRA adapters the base weights are never synced again: keep them (level 1, host copy).
            lora = self._adapter_root is not None
            self.llm.sleep(level=1 if lora else 2)
            self._asleep = {"weights", "kv_cache"}
            self._weights_discarded = not lora
            torch.cuda.empty_cache()

    def _wake(self, *tags: str) -> None:
        tags = [t for t in tags if t in self._asleep]
        if tags:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)

    def _request(self, prompt: Prompt) -> dict:
        if prompt.images:
            return {"prompt": prompt.text, "multi_modal_data": {"image": prompt.images}}
        # Token ids, so vLLM cannot add special tokens the trainer's tokenisation did not.
        return {"prompt_token_ids": self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]}

    def generate(self, prompts: list[Prompt], sampling: SamplingSettings) -> list[Completion]:
        if self._weights_discarded:
            raise RuntimeError("the engine's weights were released (sleep level 2): push weights before sampling")
        if self.tensor_parallel_size > 1:
            return generate_in_group(self._generate, prompts, sampling)
        return self._generate(prompts, sampling)

    def _generate(self, prompts: list[Prompt], sampling: SamplingSettings) -> list[Completion]:
        from vllm import SamplingParams

        if not prompts:
            return []

        params = [SamplingParams(**sampling_params(sampling, i), skip_special_tokens=True) for i in range(len(prompts))]
        outputs = self.llm.generate(
            [self._request(p) for p in prompts], params, use_tqdm=False, lora_request=self._lora_request
        )
        completions = []
        for i, out in enumerate(outputs):
            for sample in out.outputs:
                ids = list(sample.token_ids)
                logprobs = [step[tok].logprob for tok, step in zip(ids, sample.logprobs)]
                completions.append(Completion(i, ids, logprobs, sample.text, str(sample.finish_reason)))
        return completions

    # Weight updates run as one session per optimizer step: a session per bucket would process a
    # fused layer (qkv, gate_up) with half its shards loaded.
    def begin_weight_update(self) -> None:
        self._wake("weights")
        self.llm.collective_rpc(begin_reload)

    def receive_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        # In-process, the worker takes the tensors themselves (no serialisation).
        self.llm.collective_rpc(load_bucket, args=(bucket,))

    def end_weight_update(self) -> None:
        # The first update may bring any weights (a checkpoint's); later ones leave a frozen tower be.
        keep = self.frozen_vision and self.weight_updates > 0
        self.llm.collective_rpc(finish_reload, args=(keep,))
        self._weights_discarded = False
        self._wake("kv_cache")
        reset_caches(self.llm, keep_image_encodings=keep)
        self.weight_updates += 1

    def receive_adapter(self, update) -> None:
        """Serve a new LoRA adapter (an `opsd.lora.AdapterUpdate`): written as a PEFT directory (in
        /dev/shm where there is one) and named by the next requests under a new adapter id; the
        previous adapter leaves the engine. Only the adapter's bytes move, the base weights stay."""
        from vllm.lora.request import LoRARequest

        from opsd.lora import write_adapter_dir

        if self._adapter_root is None:
            raise RuntimeError("this VLLMEngine was built without LoRA (max_lora_rank=None)")
        # With adapter sync this is the step's weight update: the engine asleep since
        # `release_memory` wakes here, as `end_weight_update` wakes it after a full sync.
        self._wake("weights", "kv_cache")
        previous = self._lora_request
        adapter_id = previous.lora_int_id + 1 if previous else 1
        path = self._adapter_root / f"adapter-{adapter_id}"
        write_adapter_dir(path, update.tensors, update.config)
        self._lora_request = LoRARequest(f"opsd-{adapter_id}", adapter_id, str(path))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        # Load it now rather than at the first request naming it: a bad adapter fails here, in the sync.
        self.llm.llm_engine.add_lora(self._lora_request)

    def weight_checksums(self) -> dict[str, str]:
        """Digest of every engine parameter; lets tests and the demo see that a sync landed."""
        return self.llm.collective_rpc("compute_weight_checksums")[0]

    def close(self) -> None:
        """Idempotent: an error path may close the engine before its owner does."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        # The in-process engine core holds threads and sockets until shut down (vLLM's V1 engine).
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
        if self._remove_rpc_dir is not None:
            self._remove_rpc_dir()
