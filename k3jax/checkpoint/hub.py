"""Hugging Face model ids ("moonshotai/Kimi-Linear-48B-A3B-Instruct") -> a local checkpoint directory.

Resolved through `huggingface_hub`: the local cache first (the hub's own layout, under `download_dir`
or the hub's default cache), then a download of the files a loader reads unless the hub is offline
(`HF_HUB_OFFLINE=1`, which huggingface_hub reads itself). Without network and without the files the
caller gets one error naming the id, the revision and the cache path.
"""
from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

# ORG/NAME as the hub spells repository ids (letters, digits, '-', '_', '.'; no leading '.' or '-')
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")

# What the loaders read: config, weights, tokenizer, chat template, image preprocessing, and the
# checkpoint's own tokenization/encoding code (read as data by the K3 renderer's tests, never run).
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.jinja", "*.txt", "*.py")


def looks_like_repo_id(name: str) -> bool:
    """True for ORG/NAME that is not an existing path (a relative directory of that name wins)."""
    return bool(_REPO_ID.match(name)) and not os.path.exists(name)


def cache_dir(download_dir: str | None = None) -> str:
    """Where the hub keeps (or would keep) its files."""
    if download_dir:
        return os.path.abspath(download_dir)
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def resolve(repo_id: str, *, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local snapshot directory of `repo_id` at `revision` (default: the main branch), downloading
    what is missing unless the hub is offline. Raises ValueError naming the id and the cache path."""
    from huggingface_hub import constants, snapshot_download
    where = cache_dir(download_dir)
    rev = revision or "main"
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True,
                                 allow_patterns=list(CHECKPOINT_FILES))
        log.info("%s@%s: from the local cache %s", repo_id, rev, path)
        return path
    except Exception as cached_error:       # noqa: BLE001  (huggingface_hub's error classes vary by version)
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"model {repo_id!r} (revision {rev}) is not in the Hugging Face cache at {where} and "
                             "the hub is offline (HF_HUB_OFFLINE=1): download it on a machine with network "
                             "(huggingface-cli download) into that cache, or pass a local directory") from cached_error
    log.info("%s@%s: not cached in %s, downloading", repo_id, rev, where)
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=list(CHECKPOINT_FILES))
    except Exception as e:                  # noqa: BLE001
        raise ValueError(f"model {repo_id!r} (revision {rev}) is not in the Hugging Face cache at {where} and "
                         f"could not be downloaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
