"""Rollout dumps: a step's completions with per-token scores, written during training or offline,
and their analysis.

- `record`: the file format and the recorder a training step fills (`logging.dump_rollouts_every`);
- `offline`: sample and score a dataset with a model or checkpoint, no training;
- `analysis`: summaries and plots; `python -m opsd.dumps` (or `python -m opsd.rollouts`) is the CLI.
"""
