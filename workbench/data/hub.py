"""The Hugging Face hub, offline first.

A tokenizer or dataset named by its hub id should work on a cluster without internet when it is
in the local Hugging Face cache, and fail at once, in one line, when it is not and the hub cannot
be reached. huggingface_hub alone does neither: offline, each request retries with backoff for
about 25 s, logging every retry, before it falls back to the cache.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from workbench.errors import InputError


def hub_host() -> str:
    """The host huggingface_hub talks to (HF_ENDPOINT, else huggingface.co)."""
    return urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or ""


def hub_offline_reason() -> str:
    """Why the hub cannot be reached ("" when it may be): HF_HUB_OFFLINE, or a host name that
    does not resolve (the usual state of a cluster's compute nodes)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    host = hub_host()
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"{host} does not resolve ({e.strerror or e})"
    return ""


def cached_or_downloaded(repo_id: str, filename: str, what: str) -> str:
    """Local path of `filename` of the hub model `repo_id`: from the cache without touching the
    network, else downloaded; InputError naming `what` when neither works."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, filename, local_files_only=True)
    except Exception:  # not cached (or a malformed id): ask the hub, if it can be reached
        pass
    offline = hub_offline_reason()
    if offline:
        raise InputError(f"{what}={repo_id!r}: not a local file, not in the Hugging Face cache, "
                         f"and the hub is unreachable: {offline}")
    try:
        return hf_hub_download(repo_id, filename)
    except Exception as e:
        raise InputError(f"{what}={repo_id!r}: not a local file and not loadable from the hub "
                         f"({str(e).splitlines()[0][:120]})") from None
