"""transformers `generate` as a rollout engine: batched, with its own copy of the weights.

`generate` merges the model's own `generation_config` (a checkpoint's `repetition_penalty`, `top_k`,
`min_p`, ...) and transformers' global defaults (`top_k=50`) into whatever it is given. The engine
therefore replaces the model's generation config with a clean one (token ids only) and passes a
complete one of its own on every call: completions are drawn from the student's distribution
tempered by the rollout settings and nothing else.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from opsd.prompts import Prompt, is_multimodal, tokenizer_of
from opsd.rollout.engine import Completion, EngineCapabilities, SamplingSettings


class HFEngine:
    capabilities = EngineCapabilities()  # its own float32 copy of the weights, always resident

    def __init__(self, model, processor, *, batch_size: int = 16):
        self.model = model.eval().requires_grad_(False)
        own = model.generation_config
        self.token_ids = dict(eos_token_id=own.eos_token_id, bos_token_id=own.bos_token_id)
        model.generation_config = GenerationConfig(**self.token_ids)  # nothing else of it may leak in
        self.processor = processor
        self.tokenizer = tokenizer_of(processor)
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

    def generation_config(self, sampling: SamplingSettings) -> GenerationConfig:
        """Every setting that shapes the sampled distribution, explicitly (None would be filled in)."""
        greedy = sampling.temperature == 0
        return GenerationConfig(
            do_sample=not greedy,
            temperature=1.0 if greedy else sampling.temperature,
            top_k=0 if greedy else sampling.top_k,  # 0 = off (transformers' default would be 50)
            top_p=1.0 if greedy else sampling.top_p,
            min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
            repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
            min_length=0, min_new_tokens=None, suppress_tokens=None, begin_suppress_tokens=None,
            sequence_bias=None, forced_bos_token_id=None, forced_eos_token_id=None,
            exponential_decay_length_penalty=None, renormalize_logits=False, remove_invalid_values=False,
            num_beams=1, max_new_tokens=sampling.max_new_tokens, num_return_sequences=1,  # prompts repeated instead
            bad_words_ids=[[t] for t in sampling.banned_token_ids] or None,
            output_logits=True,  # raw logits, comparable with the trainer's (scores are warped)
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id,
            **self.token_ids,
        )

    def _generate_batch(self, prompts: list[Prompt], sampling: SamplingSettings, index_offset: int) -> list[Completion]:
        # Each prompt `n` times in the batch rather than `num_return_sequences`: expanding the inputs
        # for that is the model's job, and models with flat patch tensors (PaddleOCR-VL in
        # transformers 5.19) repeat the patches wrongly, pairing the copies with other images.
        inputs = self._encode([p for p in prompts for _ in range(sampling.n)])
        out = self.model.generate(**inputs, generation_config=self.generation_config(sampling))
        new_tokens = out.sequences[:, inputs["input_ids"].shape[1] :]
        logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        eos = self.token_ids["eos_token_id"]
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
