"""mergekit-lite: recover what post-training forgot by merging checkpoints."""

__version__ = "0.1.0"
