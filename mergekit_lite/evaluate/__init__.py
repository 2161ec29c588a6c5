"""Evaluation: lm-eval runs (lm_harness, backends) and the sample-level forgetting map; coefficient sweeps live in mergekit_lite.sweep."""
