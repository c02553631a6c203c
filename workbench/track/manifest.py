"""The reproducibility record of a run: what code, environment, config and data produced it.

Logged as an artifact and summarized in tags, so that `workbench.rerun` can rebuild the run and
say what differs now (another commit, an edited file, another torch).
"""

from __future__ import annotations

import ast
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
from typing import Any, Dict, List, Optional, Tuple

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


# The driver of a torchrun, Slurm or sweep job never needs torch itself; importing it only to
# read its version cost ~2 s of CPU per launch (and torch.cuda.get_device_name starts CUDA).
# So the environment is read from what is installed, and from torch only when this process
# has already loaded it (the local launcher's, which trains in-process).


@lru_cache(maxsize=1)
def hardware() -> Dict[str, Any]:
    import psutil

    hw: Dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(),
                          "machine": platform.machine(), "cpus": os.cpu_count(),
                          "memory_bytes": psutil.virtual_memory().total}
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else os.environ.get("OMP_NUM_THREADS", "")
    if str(threads).isdigit():  # torch's own default is only known once torch is loaded
        hw["torch_threads"] = int(threads)
    gpus = nvidia_gpus()
    if gpus:
        hw["gpus"] = gpus
    return hw


def nvidia_gpus() -> List[str]:
    """The NVIDIA GPUs' model names from the driver's /proc files (every GPU of the machine, in
    bus order), without starting CUDA."""
    names = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return names


@lru_cache(maxsize=1)
def versions() -> Dict[str, Optional[str]]:
    torch = sys.modules.get("torch")
    if torch is not None:
        version, cuda = torch.__version__, torch.version.cuda
    else:
        version, cuda = _installed_torch()
    nccl = None
    if cuda and nvidia_gpus():  # the NCCL wheel torch's CUDA builds load
        nccl = next((p.split("==", 1)[1] for p in pip_freeze()
                     if p.startswith("nvidia-nccl")), None)
    return {"python": sys.version.split()[0], "torch": version, "cuda": cuda, "nccl": nccl}


def _installed_torch() -> Tuple[Optional[str], Optional[str]]:
    """torch's version and CUDA version as its own torch/version.py states them (the values
    torch.__version__ and torch.version.cuda return), read as text."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None, None
    values: Dict[str, Any] = {}
    try:
        tree = ast.parse(Path(str(dist.locate_file("torch/version.py"))).read_text())
    except (OSError, SyntaxError):
        return dist.version, None
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    return values.get("__version__", dist.version), values.get("cuda")


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
