"""Score completions: next-token logits of a model on the completion positions only."""

from __future__ import annotations

import torch

from opsd.sequences import ForwardBatch

SCORING_METHOD = "opsd_completion_logits"
"""A sharded (FSDP2) model scores through this method of its own, registered as an FSDP forward
method (opsd/trainer/fsdp.py) so that FSDP gathers the parameters outside the blocks around it."""


def completion_logits(model, batch: ForwardBatch) -> torch.Tensor:
    """[N, V] logits predicting each completion token, in `batch.completion_ids` order.

    The LM head runs on the completion positions alone: prompts (with many image tokens) can be
    far longer than completions, and [B, L, V] logits would dominate memory.
    """
    sharded = getattr(model, SCORING_METHOD, None)
    if sharded is not None:
        return sharded(batch)
    return forward_completion_logits(model, batch)


def forward_completion_logits(model, batch: ForwardBatch) -> torch.Tensor:
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.inputs.items()}
    hidden = model.model(**inputs).last_hidden_state
    logits = model.get_output_embeddings()(hidden[batch.predicts_completion.to(device)])
    return postprocess_logits(model.config, logits)


def postprocess_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the model's own `forward` does to the LM head's output, which scoring bypasses:
    Gemma 2/3 `final_logit_softcapping`, Cohere `logit_scale`, Granite `logits_scaling`."""
    text = config.get_text_config()
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if getattr(text, "logit_scale", None) is not None and text.model_type.startswith("cohere"):
        logits = logits * text.logit_scale
    if getattr(text, "logits_scaling", None) is not None:
        logits = logits / text.logits_scaling
    return logits


class UnsupportedModelError(ValueError):
    """The model's forward computes logits that opsd's scoring would not reproduce."""


@torch.no_grad()
def check_scoring_matches_forward(model, num_tokens: int = 6, atol: float = 1e-4) -> None:
    """Refuse a model whose own `forward` post-processes logits in a way `postprocess_logits` does
    not know: scoring it would silently train on other distributions than the engine samples.

    One forward of a few text tokens, through the model's `forward` and through scoring, compared.
    """
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(1, num_tokens + 1, device=device).remainder(vocab).unsqueeze(0)
    batch = ForwardBatch(
        inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        predicts_completion=torch.ones_like(ids, dtype=torch.bool),
        completion_ids=ids[0],
    )
    was_training = model.training
    model.eval()
    try:
        expected = model(**batch.inputs).logits[0].float()
        got = forward_completion_logits(model, batch).float()
    finally:
        model.train(was_training)
    if not torch.allclose(got, expected, atol=atol, rtol=atol):
        gap = (got - expected).abs().max().item()
        raise UnsupportedModelError(
            f"model type {model.config.model_type!r} ({type(model).__name__}): its forward changes the LM "
            f"head's logits in a way opsd's scoring does not reproduce (max gap {gap:.3g}); add it to "
            "opsd.scoring.postprocess_logits before training this model"
        )
