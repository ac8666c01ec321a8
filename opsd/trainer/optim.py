"""AdamW with warm-up, then cosine decay to `min_lr` or a constant rate."""

from __future__ import annotations

import torch
from transformers.optimization import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from opsd.config import OptimConfig


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: OptimConfig, optimizer, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    if cfg.schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps)
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, cfg.warmup_steps, max_steps, min_lr=cfg.min_lr)
