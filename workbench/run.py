"""`python -m workbench.run [overrides]`: one run, a sweep (`+sweep=NAME`) or a plain grid
(`--multirun`). Dispatch only: preparing and launching a job lives in `workbench.submit`, the
sweep driver in `workbench.sweep`.
"""

from __future__ import annotations

import sys
from typing import List

from workbench.cli import guarded
from workbench.launch import RanksFailed
from workbench.submit import launch, start, summary


@guarded
def main(argv: List[str]) -> int:
    if "--multirun" in argv or "-m" in argv:
        from workbench.sweep.multirun import main as multirun_main

        return multirun_main(argv)
    if any(a.lstrip("+").startswith("sweep=") for a in argv):
        from workbench.sweep.driver import main as sweep_main

        return sweep_main(argv)
    cfg, job = start(argv)
    try:
        last = launch(cfg, job)
    except RanksFailed as e:  # the ranks' own logs said why; one line here, not a traceback
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(summary(cfg, job, last))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
