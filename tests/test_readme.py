"""The README and the manual (docs/*.md) are a contract: every fenced ```bash block in them runs
here, as a user would type it (test ids name the document and line: `docs/planner.md:L40`).

A block runs as one bash script (top to bottom, `set -e`) in a fresh folder laid out like a
clone (benchmarks/, slurm/ and tracking/ linked from the repository, nothing beside it),
writing its MLflow store there (./mlflow.db, as a user's run does) and sharing the tests' corpus
cache.
At CPU scale: `python -m workbench.run` gets a few steps (of 4 sequences unless it sets the
batch), benchmarks get their smallest arguments (`SMALL` in readme_blocks.py); nothing else is
changed. A block whose slow command is also a feature's end-to-end test (`CLAIMED`: the two
sweeps, the torchrun jobs, the cost model's fabric what-if) is run by that test, at its
scale, with its checks on what the block left; a block whose commands another block runs
first, in the same order, in its own fresh clone, is not run twice (`covered_by`: the install
block, and the README's tour, each of whose blocks opens a block of the manual). A marker line
`<!-- readme: TAG ... -->` right before a block says what it needs:

- `install`: the first command; its install steps are what .ci/run (and the wheel test) do, so
  only what follows them runs here;
- `ci`: the test command, which .ci/run itself runs (it is not run from inside the tests);
- `slurm`: runs under the slurm marker (the local cluster of slurm/);
- `gpu`, `network`: composed but not run (no GPU, no network here): every `workbench.run` /
  `workbench.plan` command in it must compose, and every other command must answer --help;
- `slow`: marked slow (CI still runs it);
- `steps`: the block's own `train.steps` are kept (its later commands use the checkpoints of its
  earlier ones).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, in_ci
from readme_blocks import (
    ALL,
    CLAIMED,
    DOCS,
    README,
    TAGS,
    Block,
    block_with,
    claimed_by,
    covered_by,
    make_clone,
    run_block,
)

README_MAX_LINES = 260  # a front door: what it is, the two commands, a tour, links into docs/
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a markdown link's target


def test_readme_has_blocks_and_known_tags():
    assert len(ALL) >= 8
    for b in ALL:
        assert b.tags <= TAGS, (b.id, b.tags - TAGS)
        assert b.commands, f"empty block at {b.id}"
    assert [b.tags for b in ALL[:2]] == [{"install"}, {"ci"}]
    assert [b.doc for b in ALL[:2]] == ["README.md"] * 2
    assert not any(b.tags & {"install", "ci"} for b in ALL[2:])
    assert {b.doc for b in ALL} >= {"README.md", "docs/running.md", "docs/planner.md"}
    ci = (REPO / ".ci" / "run").read_text()
    assert "test-command" in ci and "<!-- test-command -->" in README.read_text()


def _params():
    for b in ALL:
        if "ci" in b.tags or claimed_by(b) or covered_by(b):  # run by .ci/run, a feature's
            continue                                              # test, or a longer block
        marks = [getattr(pytest.mark, t) for t in ("slurm", "slow") if t in b.tags]
        yield pytest.param(b, id=b.id, marks=marks)


@pytest.fixture
def clone(workdir) -> Path:
    return make_clone(workdir)


def _compose_only(block: Block, cwd: Path) -> None:
    from workbench.compose import compose

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
    proc = run_block(block, clone)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stderr[-4000:]}"


def test_a_covered_block_runs_first_in_the_block_that_covers_it():
    """The install block's main job opens the manual's Running block and every tour block of the
    README opens a block of the manual, so the README adds no run of its own; no block of the
    manual repeats another's."""
    covered = {b.id: covered_by(b).id for b in ALL if "ci" not in b.tags and covered_by(b)}
    running = block_with("python -m workbench.run model=gpt_small")  # the Running section's
    assert covered[ALL[0].id] == running.id, covered
    tour = [b.id for b in ALL if b.doc == "README.md" and "ci" not in b.tags]
    assert len(tour) >= 7 and set(covered) == set(tour), covered
    assert not any(target.startswith("README.md") for target in covered.values()), covered


def test_claimed_blocks_are_run_by_their_tests():
    """A block left to a feature's test is still executed: that test runs it by its needle."""
    for needle, path in CLAIMED.items():
        block = block_with(needle)
        assert not block.tags & {"gpu", "network", "ci", "install"}, block.id  # one that runs
        text = (REPO / path).read_text()
        assert f'"{needle}"' in text and "run_block(block_with(" in text.replace(
            "block = block_with(", "run_block(block_with("), (needle, path)


def _local_links(doc: Path) -> list[tuple[Path, str]]:
    """The files a document links to, each with its #anchor ("" for none); web addresses and
    mail left out, an in-page anchor taken as a link to the document itself."""
    out = []
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        out.append(((doc.parent / path).resolve() if path else doc.resolve(), anchor))
    return out


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped,
    spaces as hyphens."""
    prose = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)  # not code comments
    heads = re.findall(r"^#+ (.+)$", prose, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_the_readme_is_a_front_door_whose_links_resolve():
    """At most README_MAX_LINES lines; every file the README or a page of the manual links to
    exists, and every anchor into a markdown file names one of its headings; every page of the
    manual is reached from the README or from docs/README.md."""
    assert len(README.read_text().splitlines()) <= README_MAX_LINES
    pages = sorted(DOCS.glob("*.md"))
    for doc in [README, *pages]:
        for target, anchor in _local_links(doc):
            assert target.exists(), (doc.name, str(target))
            assert not anchor or target.suffix != ".md" or anchor in _anchors(target), \
                (doc.name, f"{target.name}#{anchor}")
    index = DOCS / "README.md"
    readme_links = {t for t, _ in _local_links(README)}
    assert index.resolve() in readme_links
    reached = readme_links | {t for t, _ in _local_links(index)}
    assert [p.name for p in pages if p != index and p.resolve() not in reached] == []


def test_reading_the_code_lists_every_module_once():
    section = (DOCS / "reading-the-code.md").read_text()
    listed = re.findall(r"^- `(workbench/[\w/.]+)`", section, flags=re.M)
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "workbench").rglob("*.py")
                     if p.stat().st_size > 0)
    assert sorted(x for x in listed if x.endswith(".py")) == modules
    assert len(listed) == len(set(listed))
    assert all((REPO / x).exists() for x in listed)
    # the files the README and this page point a first reader to exist too
    named = re.findall(r"`(workbench/[\w/.]+)`", section + README.read_text())
    assert [x for x in named if not (REPO / x).exists()] == []
