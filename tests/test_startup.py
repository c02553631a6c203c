"""Every workbench process scans for garbage less often than CPython's default while torch,
torch._dynamo and MLflow load, and goes back to the defaults once its training loop has built the
optimizer (workbench/startup.py); `benchmarks/loop_overhead.py` measures what it saves. Checked
in fresh interpreters, as the commands and ranks start."""

from __future__ import annotations

import ast
import subprocess
import sys

from workbench.startup import MIDDLE_EVERY, OLD_EVERY, YOUNG_OBJECTS

WANT = (YOUNG_OBJECTS, MIDDLE_EVERY, OLD_EVERY)


def _threshold_in_fresh_process(code: str) -> tuple:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_every_command_sets_the_thresholds_before_its_work():
    code = ("import gc; from workbench.cli import guarded; "
            "guarded(lambda argv: print(gc.get_threshold()) or 0)([])")
    assert _threshold_in_fresh_process(code) == WANT
    assert WANT[0] > 700  # CPython's default, which the benchmark's baseline keeps


def test_the_rank_entry_sets_them_before_torch_loads():
    code = ("import gc, sys, builtins; seen = []; real = builtins.__import__\n"
            "def spy(name, *a, **k):\n"
            "    if name == 'torch' and not seen: seen.append(gc.get_threshold())\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = spy; import workbench.train.__main__; print(seen[0])")
    assert _threshold_in_fresh_process(code) == WANT


TRAIN_ONE_STEP = """
import gc, tempfile
from workbench.compose import compose
from workbench.cli import guarded
from workbench.data.corpus import load
from workbench.layout import resolve
from workbench.testing.multirank import run_single

def main(argv):
    cfg = compose(["train.steps=1", "train.eval_batches=1", "tracking=none",
                   "data.max_bytes=400000"])
    assert gc.get_threshold()[0] == YOUNG and gc.get_freeze_count() == 0
    run_single(cfg, resolve(cfg.layout, cfg.train, 1), load(cfg.data), tempfile.mkdtemp())
    assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()
    print(gc.get_threshold())
    return 0

guarded(main)([])
"""


def test_training_goes_back_to_the_default_thresholds_with_startup_frozen():
    code = TRAIN_ONE_STEP.replace("YOUNG", str(YOUNG_OBJECTS))
    assert _threshold_in_fresh_process(code) == (700, 10, 10)
