"""`python -m workbench.train JOB_FILE`: the rank entry point."""

from workbench.train.main import entry

if __name__ == "__main__":
    entry()
