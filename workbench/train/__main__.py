"""`python -m workbench.train JOB_FILE`: the rank entry point."""

from workbench.startup import fewer_gc_passes

fewer_gc_passes()  # before torch loads (workbench/startup.py)

from workbench.train.main import entry  # noqa: E402

if __name__ == "__main__":
    entry()
