"""The logprobs an engine reported for its completions, and the trainer's own for the same tokens."""

import torch

from opsd.loss import token_logprobs
from opsd.scoring import completion_logits
from opsd.sequences import collate, encode_prompt

TOLERANCE = 1e-4


def trainer_logprobs(model, processor, prompts, completions):
    encoded = [encode_prompt(processor, prompts[c.prompt_index]) for c in completions]
    pad_id = getattr(processor, "tokenizer", processor).pad_token_id
    batch = collate(encoded, [c.token_ids for c in completions], pad_id)
    with torch.no_grad():
        return token_logprobs(completion_logits(model, batch), batch.completion_ids)


def engine_logprobs(completions):
    return torch.tensor([lp for c in completions for lp in c.logprobs])
