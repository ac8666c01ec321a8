"""transformers `generate` as a rollout engine: batched, with its own copy of the weights."""

from __future__ import annotations

import torch

from opsd.prompts import Prompt, is_multimodal
from opsd.rollout.engine import Completion, SamplingSettings


class HFEngine:
    def __init__(self, model, processor, *, batch_size: int = 16):
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.batch_size = batch_size

    def _encode(self, prompts: list[Prompt]) -> dict[str, torch.Tensor]:
        self.tokenizer.padding_side = "left"  # generation continues from the last prompt token
        texts = [p.text for p in prompts]
        if is_multimodal(self.processor) and any(p.images for p in prompts):
            batch = self.processor(text=texts, images=[p.images for p in prompts], padding=True, return_tensors="pt")
        else:
            batch = self.tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
        return {k: v.to(self.model.device) for k, v in batch.items()}

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], sampling: SamplingSettings) -> list[Completion]:
        completions = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            # A private RNG stream: reproducible for a seed, and the trainer's stream is untouched.
            with torch.random.fork_rng(devices=[self.model.device] if self.model.device.type == "cuda" else []):
                torch.manual_seed(sampling.seed + start)
                completions += self._generate_batch(chunk, sampling, index_offset=start)
        return completions

    def _generate_batch(self, prompts: list[Prompt], sampling: SamplingSettings, index_offset: int) -> list[Completion]:
        inputs = self._encode(prompts)
        eos = self.model.generation_config.eos_token_id
        greedy = sampling.temperature == 0
        warpers = {} if greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or None}
        out = self.model.generate(
            **inputs,
            do_sample=not greedy,
            **warpers,
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=sampling.n,
            bad_words_ids=[[t] for t in sampling.banned_token_ids] or None,
            output_logits=True,  # raw logits, comparable with the trainer's (scores are warped)
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        new_tokens = out.sequences[:, inputs["input_ids"].shape[1] :]
        logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        stop_ids = set(eos if isinstance(eos, list) else [eos])
        completions = []
        for row in range(new_tokens.shape[0]):
            ids = new_tokens[row].tolist()
            length = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), len(ids))
            ids = ids[:length]
            completions.append(
                Completion(
                    prompt_index=index_offset + row // sampling.n,
                    token_ids=ids,
                    logprobs=token_logprobs[row, :length].tolist(),
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    finish_reason="stop" if ids and ids[-1] in stop_ids else "length",
                )
            )
        return completions

    def begin_weight_update(self) -> None:
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def receive_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in bucket:
            self._params[name].copy_(tensor)

    def end_weight_update(self) -> None:
        self._params = None

    def close(self) -> None:
        self.model = None
