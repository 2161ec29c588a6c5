"""The combination types of `merge-adapters`, with PEFT's names (`add_weighted_adapter`'s combination_type). Torch-free,
so the command line offers them without importing the math (merge/adapter_merge.py)."""

from mergekit_lite.merge.methods.variants import Sparsifier

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


def is_svd(kind: str) -> bool:
    """The types that factor a dense combined update at rank K."""
    return kind.endswith("svd")


def dense_rule(kind: str) -> str:
    """The combination rule of a type without its `_svd` suffix (`svd` itself: linear)."""
    return "linear" if kind == "svd" else kind.removesuffix("_svd")


# each rule (a type without `_svd`): (its sparsifier, whether it elects signs), after PEFT's merge_utils: its
# magnitude_based_pruning and random_pruning (`magnitude_pruned`, `randomly_pruned`)
RULES = {
    "linear": (None, False),
    "ties": (Sparsifier.MAGNITUDE, True),
    "magnitude_prune": (Sparsifier.MAGNITUDE, False),
    "dare_linear": (Sparsifier.RANDOM, False),
    "dare_ties": (Sparsifier.RANDOM, True),
}
SPARSIFIED = tuple(kind for kind in COMBINATIONS if kind != "cat" and RULES[dense_rule(kind)][0])
