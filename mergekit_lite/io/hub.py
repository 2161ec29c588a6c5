"""Model references that name a Hugging Face Hub repository (`org/name`, `org/name@revision`), as in mergekit.

A reference that exists on disk is always the local file or folder. Anything else of the form `org/name`
is fetched into huggingface_hub's own cache (weights, config and tokenizer files only) and replaced by
the snapshot folder. With HF_HUB_OFFLINE=1 the cache alone answers, and a model that is not cached is a
one-line error that says so.
"""

from __future__ import annotations

import re
from pathlib import Path

from mergekit_lite.errors import InputError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# What a merge reads from a model repository: weights, their index, config and tokenizer files.
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                  "*.model", "chat_template.*", "adapter_config.json"]


def is_hub_id(reference: str) -> bool:
    """True for `org/name[@revision]` that is not a path on disk (a local folder always wins)."""
    return bool(HUB_ID.match(reference)) and not Path(reference).exists()


def resolve_model(reference: str) -> str:
    """The local path for a model reference: itself when on disk or not hub-shaped, else the hub snapshot."""
    if not is_hub_id(reference):
        return reference
    match = HUB_ID.match(reference)
    repo, revision = match["repo"], match["revision"]
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.HF_HUB_OFFLINE
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=offline)
    except GatedRepoError:
        raise InputError(f"{reference}: gated model on the Hugging Face Hub; accept its terms and log in "
                         "(huggingface-cli login)") from None
    except RevisionNotFoundError:
        raise InputError(f"{reference}: the Hugging Face Hub has no revision {revision!r} of {repo}") from None
    except RepositoryNotFoundError:
        raise InputError(f"{reference}: no such folder, and no such model on the Hugging Face Hub") from None
    except LocalEntryNotFoundError:
        if offline:
            raise InputError(f"{reference}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                             "HF_HUB_OFFLINE=1; download it once online") from None
        raise InputError(f"{reference}: no such folder, and the Hugging Face Hub cannot be reached "
                         "(set HF_HUB_OFFLINE=1 to use the cache)") from None
