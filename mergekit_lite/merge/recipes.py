"""The members of the task-vector family by name, apart from the math so that configs are checked without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskVectorRecipe:
    """One member of the task-vector family: which sparsifier, whether signs must agree, default normalization."""

    sparsifier: str | None  # None, "magnitude", "random", "magprune" or "outliers"
    consensus: bool
    normalize: bool
    rescale: bool = False  # the sparsifier's rescaling on by default (mergekit's defaults)


TASK_VECTOR_METHODS = {
    "task_arithmetic": TaskVectorRecipe(sparsifier=None, consensus=False, normalize=False),
    "ties": TaskVectorRecipe(sparsifier="magnitude", consensus=True, normalize=True),
    "dare_linear": TaskVectorRecipe(sparsifier="random", consensus=False, normalize=False, rescale=True),
    "dare_ties": TaskVectorRecipe(sparsifier="random", consensus=True, normalize=True, rescale=True),
    "della": TaskVectorRecipe(sparsifier="magprune", consensus=True, normalize=True, rescale=True),
    "della_linear": TaskVectorRecipe(sparsifier="magprune", consensus=False, normalize=False, rescale=True),
    "breadcrumbs": TaskVectorRecipe(sparsifier="outliers", consensus=False, normalize=False),
    "breadcrumbs_ties": TaskVectorRecipe(sparsifier="outliers", consensus=True, normalize=False),
}
# methods that take no base in mergekit (its BasePolicy.IGNORED): in a slice the base is just another source
BASE_IGNORED = {"linear", "karcher", "passthrough"}
L1_RESCALED = {"magprune", "outliers"}  # sparsifiers whose `rescale` restores the L1 norm (DARE's divides by 1-drop)
DARE_MASK_VERSION = 2  # 1: torch's Mersenne Twister, float uniforms, one sequential stream per tensor;
# 2: Philox4x64-10, 16 bits per entry at the entry's own counter (`keep_indicator`)
