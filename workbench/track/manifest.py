"""The reproducibility record of a run: what code, environment, config and data produced it.

Logged as an artifact and summarized in tags, so that `workbench.rerun` can rebuild the run and
say what differs now (another commit, an edited file, another torch).
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
import sys
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state() -> Dict[str, Any]:
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    diff = _git("diff", "HEAD") if commit else _git("diff")
    untracked = (_git("ls-files", "--others", "--exclude-standard") or "").split()
    return {"commit": commit, "diff": diff or "", "untracked": untracked,
            "diff_sha256": hashlib.sha256((diff or "").encode()).hexdigest()}


@lru_cache(maxsize=1)
def pip_freeze() -> List[str]:
    """Installed distributions as name==version, read from metadata (no pip subprocess).
    Read once per process: parsing every distribution's metadata costs ~0.1-0.3 s, which a sweep
    driver preparing 64 trials would otherwise pay 64 times for the same answer."""
    pkgs = {(d.metadata["Name"] or "").lower(): d.version for d in metadata.distributions()}
    return sorted(f"{n}=={v}" for n, v in pkgs.items() if n)


@lru_cache(maxsize=1)
def hardware() -> Dict[str, Any]:
    import psutil
    import torch

    hw: Dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(),
                          "machine": platform.machine(), "cpus": os.cpu_count(),
                          "memory_bytes": psutil.virtual_memory().total,
                          "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        hw["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return hw


@lru_cache(maxsize=1)
def versions() -> Dict[str, Optional[str]]:
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl = None
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl}


_GIT_FRESH_S = 10.0  # a round of trials prepared within this shares one snapshot
_git_seen: Dict[str, Any] = {}


def recent_git_state() -> Dict[str, Any]:
    """git_state(), re-read when the last read is older than _GIT_FRESH_S: three git
    subprocesses per trial were a third of a sweep driver's per-trial cost, and the trials of
    one round are prepared from the same tree within a second; a later round (or a long-lived
    driver after an edit) reads the tree again."""
    now = time.monotonic()
    if not _git_seen or now - _git_seen["at"] > _GIT_FRESH_S:
        _git_seen.update(at=now, state=git_state())
    return _git_seen["state"]


def build(config_yaml: str, overrides: List[str], seed: int, data_fingerprint: str) -> Dict:
    return {"config_yaml": config_yaml, "argv": list(sys.argv), "overrides": list(overrides),
            "cwd": os.getcwd(), "git": recent_git_state(), "pip_freeze": list(pip_freeze()),
            "versions": dict(versions()), "hardware": dict(hardware()), "seed": seed,
            "data_fingerprint": data_fingerprint}


def tags(manifest: Dict) -> Dict[str, str]:
    g = manifest["git"]
    return {"wb.git_commit": g["commit"] or "none",
            "wb.git_dirty": str(bool(g["diff"] or g["untracked"])).lower(),
            "wb.torch": manifest["versions"]["torch"],
            "wb.python": manifest["versions"]["python"],
            "wb.host": manifest["hardware"]["host"],
            "wb.seed": str(manifest["seed"]),
            "wb.data_fingerprint": manifest["data_fingerprint"][:16],
            "wb.overrides": " ".join(manifest["overrides"])[:5000]}


def differences(old: Dict, new: Dict) -> List[str]:
    """Human-readable lines on what changed between two manifests' code and environment."""
    out = []
    og, ng = old.get("git", {}), new.get("git", {})
    if og.get("commit") != ng.get("commit"):
        out.append(f"git commit: {og.get('commit')} -> {ng.get('commit')}")
    if og.get("diff_sha256") != ng.get("diff_sha256"):
        out.append("uncommitted changes differ from the original run's")
    if sorted(og.get("untracked", [])) != sorted(ng.get("untracked", [])):
        out.append("untracked files differ")
    for k in ("python", "torch", "cuda", "nccl"):
        a, b = old.get("versions", {}).get(k), new.get("versions", {}).get(k)
        if a != b:
            out.append(f"{k}: {a} -> {b}")
    oldp, newp = set(old.get("pip_freeze", [])), set(new.get("pip_freeze", []))
    if oldp != newp:
        changed = sorted({p.split("==")[0] for p in oldp ^ newp})
        out.append(f"packages differ: {', '.join(changed[:10])}"
                   + (f" (+{len(changed) - 10} more)" if len(changed) > 10 else ""))
    if old.get("data_fingerprint") != new.get("data_fingerprint"):
        out.append("token data fingerprint differs")
    return out
