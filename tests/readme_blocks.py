"""The documented bash blocks as data (README.md, then every page of the manual, docs/*.md):
parsed, scaled to CPU size and run as a user would type them.

`tests/test_readme.py` runs every block, except that a feature's end-to-end test which would
repeat a block's slow commands (a whole sweep, torchrun jobs) runs the block itself through
`run_block` at its own scale and checks what the block left (`CLAIMED`), and a block that another
block runs first in its own fresh clone is not run twice (`covered_by`; the README's tour blocks
are each the start of a block of the manual): CI runs each command once.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"  # the manual: one page a topic, executed like the README
TAGS = {"install", "ci", "slurm", "gpu", "network", "slow", "steps"}
RUN_SMALL = ["train.steps=3", "train.eval_every=2", "train.warmup_steps=1",
             "train.eval_batches=1"]
# 4 sequences a step unless the command sets the batch (gpt_small's 16 x 256 tokens cost ~7 s a
# step here); 4 divides every data-parallel degree the documented runs use (at most 4 ranks).
RUN_BATCH = ["train.global_batch=4"]
SWEEP_SMALL = ["train.steps=4", "train.eval_every=2", "train.warmup_steps=1",
               "train.eval_batches=1"]
STDLIB_SMALL = ["data.max_bytes=1000000"]  # the test session's corpus cache (conftest.FAST)
SMALL = {  # a benchmark's smallest arguments: the same code path, seconds instead of minutes
    "benchmarks/loop_overhead.py": ["--steps", "6", "--trials", "1"],  # > its 5 warm-up steps
    # 2 micro-batches of 2 (a 2-stage pipeline needs 2): every layout, a quarter of the compute
    "benchmarks/parallel_cpu.py": ["--steps", "2", "--global-batch", "4", "--micro-batch", "2"],
    # a few steps force every switch by the cap: the same code, no verdict (--smoke)
    "benchmarks/lowrank_cpu.py": ["--smoke", "--steps", "12", "model.n_layers=2",
                                  "model.hidden=64", "model.ffn_hidden=256",
                                  "model.seq_len=64"],  # gpt_small, cut
    "benchmarks/lowrank_switch.py": ["--smoke", "--steps", "12"],  # gpt_tiny, 4 runs
    "benchmarks/sweep_overhead.py": ["--trials", "4"],
    "benchmarks/prepare_speed.py": ["--mb", "1", "--vocab", "512"],
    "benchmarks/concurrent_runs.py": ["--runs", "2", "--steps", "2"],
    "benchmarks/store_create.py": ["--stores", "1"],
    "benchmarks/tracking_throughput.py": ["--steps", "200"],
    "benchmarks/lowrank_scaling.py": ["--quick"],  # PowerSGD (every term), 1 and 2 ranks
    "benchmarks/hetero_cpu.py": ["--quick", "--global-batch", "8"],  # 4 layers, 3 steps, 2
    # micro-batches of 4 (the pipeline's 2 stages need 2); speed printed, not checked
    "benchmarks/lowrank_scaling_probe.py": ["--worlds", "2", "--steps", "3"],
    "benchmarks/lowrank_sync_probe.py": ["--busy-ms", "0", "--iters", "20", "--rounds", "1",
                                        "--steps", "4"],
    "benchmarks/profile_accuracy.py": ["--quick"],  # quick profiles, a layout a world size
    "benchmarks/profile_repeatability.py": ["--quick"],  # two quick profiles
    "benchmarks/slurm_link.py": ["--quick"],  # a quick profile of the link, 3 steps of ddp
}


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    tags: set[str]
    commands: list[str]  # continuation lines joined
    doc: str = "README.md"  # the document, relative to the repository

    @property
    def id(self) -> str:
        return f"{self.doc}:L{self.line}"


def documents() -> list[Path]:
    """README.md first (its first two blocks are the install and the test command that .ci/run
    reads), then the manual's pages in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def blocks(text: str, doc: str = "README.md") -> list[Block]:
    """Every ```bash block of one document with the tags of the marker line before it."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            tags: set[str] = set()
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            m = re.fullmatch(r"<!--\s*readme:\s*([\w\s-]+?)\s*-->", lines[j].strip()) \
                if j >= 0 else None
            if m:
                tags = set(m.group(1).split())
            end = lines.index("```", i + 1)
            out.append(Block(i + 1, tags, _commands(lines[i + 1:end]), doc))
            i = end
        i += 1
    return out


def _commands(body: list[str]) -> list[str]:
    """Commands of a block: continuation lines joined, a here-document kept whole."""
    cmds, cur, heredoc = [], "", None
    for raw in body:
        line = raw.rstrip()
        if heredoc is not None:
            cur += "\n" + line
            if line.strip() == heredoc:
                cmds.append(cur)
                cur, heredoc = "", None
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        m = re.search(r"<<-?\s*'?(\w+)'?", cur)
        if m:
            heredoc = m.group(1)
            continue
        if cur.strip() and not cur.strip().startswith("#"):
            cmds.append(cur.strip())
        cur = ""
    if heredoc is not None:  # bash would run nothing after it: say so instead of passing
        raise ValueError(f"here-document {heredoc!r} is never closed: {cur.splitlines()[0]!r}")
    return cmds


def scaled(cmd: str, extra: List[str] = (), own_steps: bool = False) -> str:
    """The command at CPU scale (a `workbench.run` command then takes `extra` overrides, which
    win over the standard small ones; with `own_steps`, a block tagged `steps`, it keeps the
    `train.steps` it sets, since its later commands use the checkpoints of its earlier ones); a
    trailing comment is dropped."""
    if "\n" in cmd:  # a here-document runs as written
        return cmd
    words = shlex.split(cmd, comments=True)
    if words[:3] == ["python", "-m", "workbench.run"]:
        sweep = any(w.lstrip("+").startswith("sweep=") for w in words)
        small = SWEEP_SMALL if sweep else RUN_SMALL
        if not any(w.startswith(("data=tokens", "data.path", "data.max_bytes")) for w in words):
            small = small + STDLIB_SMALL  # the embedded corpus (and its BPE), at test size
        if not sweep and not any(
                w.startswith(("train.global_batch", "train.micro_batch")) for w in words):
            small = small + RUN_BATCH  # a command that sets the batch keeps it
        own = {w.split("=")[0] for w in words} & {"train.steps"} if own_steps else set()
        small = [w for w in small
                 if w.split("=")[0] not in {e.split("=")[0] for e in extra} | own]
        small = small + list(extra)
        keys = {s.split("=")[0] for s in small}
        words = [w for w in words if w.split("=")[0] not in keys] + small
    elif words[:3] == ["python", "-m", "workbench.profile"] and "--quick" not in words:
        words = words + ["--quick"]  # the same measurements, fewer sizes and shorter trials
    elif len(words) >= 2 and words[0] == "python" and words[1] in SMALL:
        words = words + SMALL[words[1]]
    if "$(" in cmd:
        return cmd.split(" #")[0]
    # a word with $VAR expands as it would in the README (double quotes), the rest stay literal
    return " ".join(f'"{w}"' if "$" in w and not set(w) & set('"`\\') else shlex.quote(w)
                    for w in words)


def _install_tail(cmd: str) -> str:
    steps = [s.strip() for s in cmd.split("&&")]
    keep = [s for s in steps if not s.startswith(("python3 -m venv", ". .venv", "pip install"))]
    return " && ".join(scaled(s) for s in keep)


ALL = [b for path in documents()
       for b in blocks(path.read_text(), str(path.relative_to(REPO)))]

# A block whose slow command is also a feature's end-to-end test: that test runs the block
# (`run_block`, at its own scale) and checks what it left, and test_readme does not run it again.
# needle (a command's words) -> the test file that runs the block holding it
CLAIMED: Dict[str, str] = {
    "python -m workbench.run +sweep=lowrank_vs_fullrank": "tests/test_lowrank_ddp.py",
    "python -m workbench.run +sweep=data_mixture": "tests/test_data_mixture.py",
    "python -m workbench.run launcher=torchrun launcher.nproc_per_node=2 layout=ddp":
        "tests/test_parallel_cli.py",
    "python benchmarks/costmodel_accuracy.py --interconnect": "tests/test_costmodel_twins.py",
    "python -m workbench.run train.run_dir=runs/stable": "tests/test_branch.py",
    "python -m workbench.run --multirun train.seed=1,2,3": "tests/test_compare.py",
    "python benchmarks/lowrank_heldout.py": "tests/test_lowrank_heldout.py",
}


def block_with(needle: str) -> Block:
    """The one block with a command that starts with `needle`, in whichever document (a README
    tour block that only repeats the start of the manual's block, `covered_by`, is not it)."""
    found = [b for b in ALL
             if any(c.startswith(needle) for c in b.commands) and covered_by(b) is None]
    if len(found) != 1:
        raise LookupError(f"{len(found)} documented blocks run {needle!r}")
    return found[0]


def claimed_by(block: Block) -> Optional[str]:
    return next((f for n, f in CLAIMED.items() if block_with(n) is block), None)


def script_commands(block: Block, extra: List[str] = ()) -> List[str]:
    """What the block runs at CPU scale, in order."""
    if "install" in block.tags:
        return [_install_tail(c) for c in block.commands]
    return [scaled(c, extra, "steps" in block.tags) for c in block.commands]


def covered_by(block: Block) -> Optional[Block]:
    """Another block that runs this one's commands first, in the same order, in its own fresh
    clone (itself, or through the feature's test that claims it): running this one too would
    repeat them exactly. The install block's main job is the first command of the manual's
    Running block; each tour block of the README is the start of a block of the manual (of two
    equal blocks, the later one runs)."""
    mine, at = script_commands(block), ALL.index(block)
    for i, other in enumerate(ALL):
        theirs = script_commands(other) if not other.tags & {"ci", "gpu", "network"} else []
        longer = len(theirs) > len(mine) or (len(theirs) == len(mine) and i > at)
        if other is not block and longer and theirs[:len(mine)] == mine \
                and ("slurm" in other.tags) <= ("slurm" in block.tags):
            return other
    return None


def make_clone(workdir: Path) -> Path:
    """A folder laid out like a user's clone: the repository's scripts and data, nothing beside
    it (every documented command runs from a clone alone)."""
    root = workdir / "clone"
    root.mkdir()
    for name in ("benchmarks", "slurm", "tracking", ".ci"):
        (root / name).symlink_to(REPO / name)
    return root


def run_block(block: Block, clone: Path, extra: List[str] = ()) -> subprocess.CompletedProcess:
    """The block as one bash script (`set -e`) in the clone, writing ./mlflow.db there as a
    user's run does; every `workbench.run` in it takes `extra` overrides."""
    cmds = script_commands(block, extra)
    script = "set -euo pipefail\n" + "\n".join(
        f"echo \"+ [$SECONDS s] \"{shlex.quote(c.splitlines()[0])} >&2\n{c}" for c in cmds) + "\n"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # ./mlflow.db
    return subprocess.run(["bash", "-c", script], cwd=clone, capture_output=True, text=True,
                          timeout=1500, env=env)
