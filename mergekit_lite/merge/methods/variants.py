"""The variants the merge code branches on, as enums valued by the strings they have always been written as
(`Variant`): a task-vector method's sparsifier here, a plan step's action in merge/plan.py. Nothing here imports
the rest of the package, so the declarations, the math and the plan all can."""

from __future__ import annotations

import enum


class Variant(str, enum.Enum):
    """One of a fixed set of variants (a sparsifier, a plan step's action), valued by the string it has always been
    written as: equal to it, hashed, printed, formatted and JSON-written as it, so configs, plans and recorded
    hashes read the same. Code asks the member (`is`, its properties), never compares the string."""

    __str__ = str.__str__
    __format__ = str.__format__


class Sparsifier(Variant):
    """How a member of the family selects each task vector's entries (one that keeps them all has None). The
    declarations, the plan and the math ask its properties, or which member it `is`."""

    MAGNITUDE = "magnitude"  # TIES's trim (Yadav et al. 2023, sec. 3): the largest |delta|, by a threshold per model
    RANDOM = "random"  # DARE's drop (Yu et al. 2024): entries dropped at random, the rest rescaled by 1/(1 - drop)
    MAGPRUNE = "magprune"  # DELLA's MagPrune (Deep et al. 2024, sec. 3.1): a drop with magnitude-ranked odds
    OUTLIERS = "outliers"  # Model Breadcrumbs (Davari & Belilovsky 2024): the largest and the smallest left out

    @property
    def by_magnitude(self) -> bool:
        """It keeps a `density` share of the entries chosen by their magnitudes, so it may select a NaN or Inf
        entry away; DARE's drop looks at no value (its 0-or-1 mask multiplies, keeping a NaN)."""
        return self is not Sparsifier.RANDOM

    @property
    def over_whole_tensors(self) -> bool:
        """Its selection ranks every magnitude of the tensor (DELLA's ranks within rows, Breadcrumbs' band)."""
        return self in (Sparsifier.MAGPRUNE, Sparsifier.OUTLIERS)

    @property
    def l1_rescaled(self) -> bool:
        """Its `rescale` restores the L1 norm the task vector had before (mergekit's, over the whole tensor);
        DARE's divides its survivors by 1 - drop."""
        return self in (Sparsifier.MAGPRUNE, Sparsifier.OUTLIERS)
