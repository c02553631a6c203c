"""`python -m workbench.sweep status NAME` and `python -m workbench.sweep collect NAME [--wait]`.

status: read-only; the trial table from sweeps/NAME/ (Slurm states of trials still running).
collect: tell Optuna every trial that ended since the last look, submit what a detached or killed
driver left prepared, update the parent MLflow run and print the table; --wait keeps going
until the budget is spent. It is the driver's own loop (driver.drive), so the sweep that ends
in a collect gets what an attached driver gives it: the recipe's comparison on the parent run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workbench.cli import guarded
from workbench.errors import InputError
from workbench.places import SWEEPS_DIR


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # bad usage is bad input: one line, exit 2
        raise InputError(f"{message}; usage: python -m workbench.sweep status|collect NAME "
                         "[--dir sweeps] [--wait] [--rejected]")


def parse(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m workbench.sweep", add_help=True)
    p.add_argument("command", choices=["status", "collect"])
    p.add_argument("name")
    p.add_argument("--dir", default=SWEEPS_DIR, help="parent folder of the sweep state")
    p.add_argument("--wait", action="store_true", help="collect: until every trial ended")
    p.add_argument("--rejected", action="store_true", help="also list rejected layouts")
    return p.parse_args(argv)


@guarded
def main(argv: list[str]) -> int:
    from workbench.sweep import driver, report
    from workbench.sweep.space import objectives, parse_sweep
    from workbench.sweep.state import SweepState

    args = parse(argv)
    folder = Path(args.dir) / args.name
    if args.command == "status":
        state = SweepState.load(folder)
        sweep = parse_sweep(state.plan["sweep"])
        print(report.table(state, objectives(sweep), rejected=args.rejected))
        return 0
    sw = driver.from_state(folder)
    driver.start(sw)
    try:
        driver.drive(sw, wait=args.wait)
    finally:
        sw.state.unlock()
    print(report.table(sw.state, sw.objectives, rejected=args.rejected))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
