"""How repeatable a profile of this machine is: profile it several times, as
benchmarks/profile_accuracy.py does (4 ranks over loopback), and price the same layouts from
each profile.

    python benchmarks/profile_repeatability.py [--profiles 2] [--quick] [--reuse DIR]

An accuracy figure measured from one profile cannot be better than the profiles agree with
each other: where two profiles of the same machine, minutes apart, price a layout 10% apart,
one of them is at least 5% off whatever the layout then measures. This prints, for
profile_accuracy's layouts of 1, 2 and 4 ranks (the link's are left out), each layout's price
from every profile and their spread (largest over smallest, less one), the median and largest
spread per world size, and which part of a profile carries it: each section (compute tables,
collectives, engine probes) of the other profiles put in place of the first's, one at a time,
and how far that moves the first profile's prices (median over the layouts). No layout is run,
so a change made to the profiler against this spends no held-out row of profile_accuracy.py.
No verdict: the figure to make smaller.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import yaml

SECTIONS = ("compute", "comms", "probes")
HERE = "bench_here"  # the cluster name profile_accuracy.profile_here writes


def prices(conf: Path) -> Dict[str, List[float]]:
    """Every 1-4 rank layout's predicted step from the profile in `conf`, priced in a fresh
    interpreter (the user's config folder is read once per process), as {name: [world, s]}."""
    out = subprocess.run([sys.executable, __file__, "--price", str(conf)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def _price_here() -> Dict[str, List[float]]:
    from profile_accuracy import base_overrides
    from profile_layouts import LAYOUTS

    from workbench import layout as layouts
    from workbench.compose import compose
    from workbench.plan.cost.estimate import estimate

    cluster = compose([f"cluster={HERE}"]).cluster
    out = {}
    for name, world, overrides, _ in LAYOUTS:
        if world == "link":
            continue
        cfg = compose(base_overrides(8, world) + overrides)
        layout = layouts.resolve(cfg.layout, cfg.train, world)
        out[name] = [world, estimate(cfg.model, cluster, cfg.train, layout).step_time_s]
    return out


def _spread(values: List[float]) -> float:
    return max(values) / min(values) - 1


def swapped(first: Path, other: Path, section: str, dest: Path) -> Path:
    """`first`'s profile with one section taken from `other`'s, as a config folder."""
    data = yaml.safe_load((first / "cluster" / f"{HERE}.yaml").read_text())
    theirs = yaml.safe_load((other / "cluster" / f"{HERE}.yaml").read_text())["profile"]
    data["profile"].pop(section, None)
    if section in theirs:  # a profile without engine probes has no such section
        data["profile"][section] = copy.deepcopy(theirs[section])
    (dest / "cluster").mkdir(parents=True, exist_ok=True)
    (dest / "cluster" / f"{HERE}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def report(confs: List[Path], root: Path) -> None:
    each = [prices(c) for c in confs]
    names = list(each[0])
    print(f"{'layout':<30} {'ranks':>5} " + " ".join(f"{f'profile {i}':>10}"
                                                      for i in range(len(confs))) + "  spread")
    by_world: Dict[int, List[float]] = {}
    for name in names:
        world, values = each[0][name][0], [p[name][1] for p in each]
        by_world.setdefault(world, []).append(_spread(values))
        print(f"{name:<30} {world:>5} " + " ".join(f"{v * 1e3:>8.1f}ms" for v in values)
              + f"  {_spread(values):>5.1%}")
    print()
    for world, spreads in sorted(by_world.items()):
        print(f"{world} rank(s), {len(spreads)} layouts: spread between profiles median "
              f"{statistics.median(spreads):.1%}, largest {max(spreads):.1%}")
    everything = [s for v in by_world.values() for s in v]
    print(f"all {len(everything)} layouts: median {statistics.median(everything):.1%}")
    for section in SECTIONS:
        moved = []
        for i, other in enumerate(confs[1:], start=1):
            mixed = prices(swapped(confs[0], other, section, root / f"mix-{section}-{i}"))
            moved += [abs(mixed[n][1] / each[0][n][1] - 1) for n in names]
        print(f"the {section} section of another profile moves profile 0's prices by "
              f"{statistics.median(moved):.1%} (median), {max(moved):.1%} (largest)")


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="quick profiles (a smoke test)")
    ap.add_argument("--reuse", default="", metavar="DIR",
                    help="price again from an earlier run's folder, profiling nothing")
    ap.add_argument("--price", default="", help=argparse.SUPPRESS)  # one profile, in a child
    args = ap.parse_args(argv)
    if args.price:
        os.environ["WORKBENCH_CONF"] = args.price
        print(json.dumps(_price_here()))
        return 0
    if args.profiles < 2:
        print(f"error: --profiles {args.profiles}: at least 2 (a spread needs two)",
              file=sys.stderr)
        return 2
    if args.reuse:
        root = Path(args.reuse)
        confs = sorted(root.glob("profile*/conf"))
        if len(confs) < 2:
            print(f"error: --reuse {root}: no two profile*/conf folders in it", file=sys.stderr)
            return 2
    else:
        from profile_accuracy import profile_here

        root = Path(tempfile.mkdtemp(prefix="wb-profile-repeat-"))
        confs = []
        for i in range(args.profiles):
            print(f"profile {i + 1} of {args.profiles} (4 ranks over loopback) ...",
                  file=sys.stderr, flush=True)
            confs.append(root / f"profile{i}" / "conf")
            (root / f"profile{i}" / "work").mkdir(parents=True)
            profile_here(confs[-1], root / f"profile{i}" / "work", args.quick)
    report(confs, root)
    print(f"profiles kept in {root} (--reuse {root})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
