"""Shared pytest fixtures. Expensive artefacts are session-scoped so every test file reuses them."""

import os

# Tests never touch the network; set before anything imports huggingface_hub or datasets.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from mergekit_lite.toy import ToyPair, build_toy_pair


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory) -> ToyPair:
    """The toy pre -> post pair (seed 0), saved in several safetensors shards so streaming code
    sees sharded inputs. Built once per session (a few seconds)."""
    return build_toy_pair(tmp_path_factory.mktemp("toy_pair"), seed=0, max_shard_size="100KB")
