"""The combination types of `merge-adapters`, with PEFT's names (`add_weighted_adapter`'s combination_type). Torch-free,
so the command line offers them without importing the math (merge/adapter_merge.py)."""

COMBINATIONS = (
    "svd",
    "linear",
    "cat",
    "ties",
    "ties_svd",
    "dare_linear",
    "dare_ties",
    "dare_linear_svd",
    "dare_ties_svd",
    "magnitude_prune",
    "magnitude_prune_svd",
)
