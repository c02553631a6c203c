"""`python -m workbench.run --multirun train.seed=1,2,3 layout=single,ddp`: Hydra's plain grid.

`workbench.run` composes with Hydra's compose API (not @hydra.main), so Hydra's own multirun
does not apply; this expands comma lists, `range()` and `choice()` with Hydra's override parser
and runs each combination as its own run, one after another. Every combination is composed and
validated before the first one starts, so a typo in the fifth value fails at once (exit 2).
"""

from __future__ import annotations

import itertools
import sys

from workbench.compose import compose
from workbench.errors import ConfigError

FLAGS = ("--multirun", "-m")


def expand(overrides: list[str]) -> list[list[str]]:
    """The cartesian product of every sweep override, as lists of plain overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    axes: list[list[str]] = []
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except HydraException as e:
            raise ConfigError(text.split("=")[0], text, " ".join(str(e).split())[:160]) from None
        if not ov.is_sweep_override():
            axes.append([text])
            continue
        if not ov.is_discrete_sweep():
            raise ConfigError(ov.get_key_element(), ov.value(),
                              "--multirun takes lists, range() or choice(); intervals need "
                              "+sweep=NAME")
        axes.append([f"{ov.get_key_element()}={v}" for v in ov.sweep_string_iterator()])
    return [list(combo) for combo in itertools.product(*axes)]


def main(argv: list[str]) -> int:
    """Run every combination; exit status 1 if any run failed (the others still run)."""
    from workbench import submit

    combos = expand([a for a in argv if a not in FLAGS])
    for combo in combos:  # validate all before recording or running any
        compose(combo)
    failed = []
    for i, combo in enumerate(combos):
        print(f"[multirun {i + 1}/{len(combos)}] {' '.join(combo)}", file=sys.stderr)
        try:
            cfg, job = submit.start(combo)
            last = submit.launch(cfg, job)
            print(submit.summary(cfg, job, last))
        except (ConfigError, RuntimeError, FloatingPointError) as e:
            failed.append(i)
            print(f"[multirun {i + 1}/{len(combos)}] failed: {' '.join(str(e).split())}",
                  file=sys.stderr)
    if failed:
        print(f"{len(failed)} of {len(combos)} runs failed: {failed}", file=sys.stderr)
    return 1 if failed else 0
