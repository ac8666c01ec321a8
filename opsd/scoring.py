"""Score completions: next-token logits of a model on the completion positions only."""

from __future__ import annotations

import torch

from opsd.sequences import ForwardBatch


def completion_logits(model, batch: ForwardBatch) -> torch.Tensor:
    """[N, V] logits predicting each completion token, in `batch.completion_ids` order.

    The LM head runs on the completion positions alone: prompts (with many image tokens) can be
    far longer than completions, and [B, L, V] logits would dominate memory.
    """
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.inputs.items()}
    hidden = model.model(**inputs).last_hidden_state
    return model.get_output_embeddings()(hidden[batch.predicts_completion.to(device)])
