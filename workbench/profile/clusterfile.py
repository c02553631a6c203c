"""A profile as a cluster file: the base cluster's figures, the measured curves under `profile:`,
written whole or not at all; and the short table the command prints.

Whole or not at all: the file appears by one rename after everything is measured, so a profile
interrupted at any point leaves the user's conf/ as it was.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

import yaml

from workbench.config import ClusterConfig

HEADER = ("# Measured by `python -m workbench.profile` ({command}) on {host}, {when}:\n"
          "# torch {torch}, {device_type} {device_name!r}, {world} rank(s) on {nodes} node(s).\n"
          "# The cost model prices layouts on this cluster from the curves under `profile:`.\n")


def cluster_dict(base: ClusterConfig, name: str, profile: Dict[str, Any]) -> Dict[str, Any]:
    """The base cluster's fields (its datasheet figures stay: MFU is reported against them),
    renamed, sized as measured, with the profile."""
    out = asdict(base)
    meta = profile["measured"]
    out.update(name=name, nodes=int(meta["nodes"]),
               gpus_per_node=max(1, int(meta["world"]) // int(meta["nodes"])), profile=profile)
    out.pop("pools", None) if not out.get("pools") else None
    out.pop("links", None) if not out.get("links") else None
    return out


class _Dumper(yaml.SafeDumper):
    """Curves as one flow-style line each: a file a person can read and diff."""


def _represent_list(dumper: yaml.SafeDumper, data: List[Any]) -> yaml.Node:
    flow = bool(data) and all(isinstance(v, (int, float, str)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def write(path: Path, data: Dict[str, Any]) -> None:
    """Write `data` to `path` as YAML by one atomic rename (fsynced first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = HEADER.format(**{"command": "", **data["profile"]["measured"]}) + yaml.dump(
        data, Dumper=_Dumper, sort_keys=False, width=100)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a cluster file from colleagues
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def summary(profile: Dict[str, Any]) -> str:
    """The short table: what each level computes, what each collective costs, memory."""
    lines = []
    for level in profile["compute"]:
        ew = level["elementwise"]
        bw = ew["bytes"][-1] / ew["s"][-1] / 1e9
        head = f"compute, {level['ranks']} rank(s) busy per host"
        head += f", {level['threads']} thread(s) each" if level["threads"] else ""
        lines.append(f"{head}: elementwise {bw:.1f} GB/s, {ew['s'][0] * 1e6:.1f} us/op")
        for g in level["gemm"]:
            rate = [2 * t * k * n / s / 1e9
                    for k, n, t, s in zip(g["k"], g["n"], g["tokens"], g["fwd_s"])]
            lines.append(f"  GEMM {g['dtype']}: {len(rate)} shapes, {min(rate):.1f}-"
                         f"{max(rate):.1f} GFLOP/s forward (median {statistics.median(rate):.1f})")
        for b in level["blocks"]:
            lines.append(f"  {b['model']} block {b['dtype']}: " + ", ".join(
                f"tp{tp} {tok} tok {1e3 * (f + w):.2f} ms"
                for tp, tok, f, w in zip(b["tp"], b["tokens"], b["fwd_s"], b["bwd_s"])
                if tok == max(b["tokens"])))
        for o in level["optimizer"]:
            lines.append(f"  {o['model']} optimizer step: {1e3 * o['step_s']:.2f} ms "
                         f"({o['params'] / 1e6:.2f}M params)")
    for c in profile["comms"]:
        bw = c["bytes"][-1] / c["s"][-1] / 1e9
        lines.append(f"{c['kind']:>14} x{c['group']} {c['span']}: {c['s'][0] * 1e6:.0f} us at "
                     f"{c['bytes'][0] / 1024:.0f} KiB, {bw:.2f} GB/s at "
                     f"{c['bytes'][-1] / 2**20:.1f} MiB")
    mem = profile.get("memory") or {}
    if mem:
        lines.append(f"memory: {mem['baseline_bytes'] / 2**20:.0f} MiB held before any model, "
                     f"{mem['step_peak_bytes'] / 2**20:.0f} MiB peak over a step of "
                     f"{mem['model']}")
    return "\n".join(lines)
