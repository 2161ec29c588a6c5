"""mergekit-lite: recover what post-training forgot by merging checkpoints.

Floors, each importing only from those below it (tests/test_layout.py checks it): `io`; `merge`; `evaluate` and
the top-level `audits` package; `audited` (merging with the audit gate); `sweep`; `demo`; the `cli` package on top.
"""

__version__ = "0.1.0"
