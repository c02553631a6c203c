"""`python -m workbench.train JOB_FILE`: the rank entry point (workbench/rank.py: the training
loop with the features the job's config asks for)."""

from workbench.startup import fewer_gc_passes

fewer_gc_passes()  # before torch loads (workbench/startup.py)

import sys  # noqa: E402
from typing import List  # noqa: E402

from workbench.cli import guarded  # noqa: E402
from workbench.job import Job  # noqa: E402
from workbench.rank import run_job  # noqa: E402


@guarded
def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m workbench.train JOB_FILE", file=sys.stderr)
        return 2
    run_job(Job.load(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
