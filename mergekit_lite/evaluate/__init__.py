"""Evaluation: lm-eval runs, the sample-level forgetting map, coefficient sweeps and their reports."""
