"""The README is a contract: every fenced ```bash block in it runs here, as a user would type it.

A block runs as one bash script (top to bottom, `set -e`) in a fresh folder laid out like a
clone (benchmarks/, slurm/ and tracking/ linked from the repository, ../shared beside it),
writing its MLflow store there (./mlflow.db, as a user's run does) and sharing the tests' corpus
cache.
At CPU scale: `python -m workbench.run` gets a few steps, benchmarks get their smallest
arguments (`SMALL` below); nothing else is changed. A marker line
`<!-- readme: TAG ... -->` right before a block says what it needs:

- `install`: the first command; its install steps are what .ci/run (and the wheel test) do, so
  only what follows them runs here;
- `ci`: the test command, which .ci/run itself runs (it is not run from inside the tests);
- `slurm`: runs under the slurm marker (the local cluster of slurm/);
- `gpu`, `network`: composed but not run (no GPU, no network here): every `workbench.run` /
  `workbench.plan` command in it must compose, and every other command must answer --help;
- `slow`: marked slow (CI still runs it).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, in_ci

README = REPO / "README.md"
TAGS = {"install", "ci", "slurm", "gpu", "network", "slow"}
RUN_SMALL = ["train.steps=3", "train.eval_every=2", "train.warmup_steps=1",
             "train.eval_batches=1"]
SWEEP_SMALL = ["train.steps=4", "train.eval_every=2", "train.warmup_steps=1",
               "train.eval_batches=1"]
STDLIB_SMALL = ["data.max_bytes=1000000"]  # the test session's corpus cache (conftest.FAST)
SMALL = {  # a benchmark's smallest arguments: the same code path, seconds instead of minutes
    "benchmarks/loop_overhead.py": ["--steps", "6", "--trials", "1"],  # > its 5 warm-up steps
    "benchmarks/parallel_cpu.py": ["--steps", "2"],
    "benchmarks/lowrank_cpu.py": ["--steps", "12", "model.n_layers=2", "model.hidden=64",
                                  "model.ffn_hidden=256", "model.seq_len=64"],  # gpt_small, cut
    "benchmarks/lowrank_switch.py": ["--steps", "60"],  # gpt_tiny, 4 runs to their switch
    "benchmarks/sweep_overhead.py": ["--trials", "4"],
    "benchmarks/prepare_speed.py": ["--mb", "1", "--vocab", "512"],
    "benchmarks/concurrent_runs.py": ["--runs", "2", "--steps", "2"],
    "benchmarks/store_create.py": ["--stores", "1"],
    "benchmarks/tracking_throughput.py": ["--steps", "200"],
    "benchmarks/lowrank_scaling.py": ["--quick"],  # full rank + PowerSGD, 1 and 2 ranks
    "benchmarks/hetero_cpu.py": ["--quick"],  # 4 layers, 3 steps; speed printed, not checked
    "benchmarks/lowrank_scaling_probe.py": ["--worlds", "2", "--steps", "3"],
    "benchmarks/lowrank_sync_probe.py": ["--busy-ms", "0", "--iters", "20", "--rounds", "1",
                                        "--steps", "4"],
}


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    tags: set[str]
    commands: list[str]  # continuation lines joined

    @property
    def id(self) -> str:
        return f"L{self.line}"


def blocks(text: str) -> list[Block]:
    """Every ```bash block with the tags of the marker line before it."""
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
            out.append(Block(i + 1, tags, _commands(lines[i + 1:end])))
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


def scaled(cmd: str) -> str:
    """The command at CPU scale; a trailing comment is dropped."""
    if "\n" in cmd:  # a here-document runs as written
        return cmd
    words = shlex.split(cmd, comments=True)
    if words[:3] == ["python", "-m", "workbench.run"]:
        small = SWEEP_SMALL if any(w.lstrip("+").startswith("sweep=") for w in words) \
            else RUN_SMALL
        if not any(w.startswith(("data=tokens", "data.path", "data.max_bytes")) for w in words):
            small = small + STDLIB_SMALL  # the embedded corpus (and its BPE), at test size
        keys = {s.split("=")[0] for s in small}
        words = [w for w in words if w.split("=")[0] not in keys] + small
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


ALL = blocks(README.read_text())


def test_readme_has_blocks_and_known_tags():
    assert len(ALL) >= 8
    for b in ALL:
        assert b.tags <= TAGS, (b.id, b.tags - TAGS)
        assert b.commands, f"empty block at {b.id}"
    assert [b.tags for b in ALL[:2]] == [{"install"}, {"ci"}]
    ci = (REPO / ".ci" / "run").read_text()
    assert "test-command" in ci and "<!-- test-command -->" in README.read_text()


def _params():
    for b in ALL:
        if "ci" in b.tags:
            continue
        marks = [getattr(pytest.mark, t) for t in ("slurm", "slow") if t in b.tags]
        yield pytest.param(b, id=b.id, marks=marks)


@pytest.fixture
def clone(workdir) -> Path:
    """A folder laid out like a user's clone: the repository's scripts, ../shared beside it."""
    root = workdir / "clone"
    root.mkdir()
    for name in ("benchmarks", "slurm", "tracking", ".ci"):
        (root / name).symlink_to(REPO / name)
    shared = REPO.parent / "shared"
    if shared.is_dir():
        (workdir / "shared").symlink_to(shared)
    return root


def _compose_only(block: Block, cwd: Path) -> None:
    from workbench.cli import compose

    for cmd in block.commands:
        words = shlex.split(cmd, comments=True)
        if words[:3] in (["python", "-m", "workbench.run"], ["python", "-m", "workbench.plan"]):
            compose([w for w in words[3:] if not w.startswith("-")])
        elif words[0] == "python" and (words[1].startswith("benchmarks/") or words[1] == "-m"):
            entry = words[1:2] if words[1] != "-m" else words[1:3]
            proc = subprocess.run(["python", *entry, "--help"], cwd=cwd, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 0, (block.id, cmd, proc.stderr[-2000:])
        else:
            raise AssertionError(f"{block.id}: cannot compose {cmd!r} without running it")


@pytest.mark.parametrize("block", list(_params()))
def test_readme_block_runs(block: Block, clone: Path):
    if "slurm" in block.tags and not os.environ.get("SLURM_CONF") and not in_ci():
        pytest.skip("needs the local Slurm cluster (slurm/start-local-cluster.sh)")
    if block.tags & {"gpu", "network"}:
        _compose_only(block, clone)
        return
    cmds = [_install_tail(c) for c in block.commands] if "install" in block.tags \
        else [scaled(c) for c in block.commands]
    script = "set -euo pipefail\n" + "\n".join(
        f"echo \"+ [$SECONDS s] \"{shlex.quote(c.splitlines()[0])} >&2\n{c}" for c in cmds) + "\n"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # ./mlflow.db
    proc = subprocess.run(["bash", "-c", script], cwd=clone, capture_output=True, text=True,
                          timeout=1500, env=env)
    assert proc.returncode == 0, f"README {block.id} failed:\n{proc.stderr[-4000:]}"


def test_reading_the_code_lists_every_module_once():
    text = README.read_text()
    section = text[text.index("## Reading the code"):]
    section = section[:section.index("\n## ", 1)]
    listed = re.findall(r"^- `(workbench/[\w/.]+)`", section, flags=re.M)
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "workbench").rglob("*.py")
                     if p.stat().st_size > 0)
    assert sorted(x for x in listed if x.endswith(".py")) == modules
    assert len(listed) == len(set(listed))
    assert all((REPO / x).exists() for x in listed)
