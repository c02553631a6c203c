"""Across a node boundary, on the local cluster of `slurm/start-local-cluster.sh --nodes 2`: two
slurmds, each in a network namespace and UTS namespace of its own (its own address on
10.78.0.0/24 and its own host name), so a job's ranks on two nodes talk over a network path
between two addresses and rendezvous on the first node's address, never on loopback.

A two-node run is one MLflow run that records where each rank ran; ddp, fsdp, tp and pp with one
stage per node train with the losses of one process; a node lost in the middle of a run (every
process on it killed: its slurmd, slurmstepd and ranks) ends in Slurm's requeue and a resume
from the last checkpoint with every step recorded once and the losses of an uninterrupted run,
for the node of rank 0 too. The sweep array and the pooled run on two nodes are in
test_slurm.py (they run on this cluster in CI). Under CI a missing two-node cluster fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import List

import pytest
from conftest import REPO, cli, in_ci, metric_series, only_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NODES = ["node1", "node2"]
BASE = ["model=gpt_tiny", "train.steps=4", "train.global_batch=8", "train.micro_batch=2",
        "train.eval_every=100", "train.ckpt_every=100", "train.warmup_steps=1",
        "train.threads=1", "data.max_bytes=400000"]
REL_TOL = 1e-5  # as tests/test_parallel.py: the reduction order differs from one process


def node_states() -> dict:
    if not shutil.which("sinfo"):
        return {}
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %T"],
                         capture_output=True, text=True, timeout=30, check=False).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    states = node_states()
    if not all(states.get(n, "").rstrip("*") in ("idle", "mixed", "allocated") for n in NODES):
        why = (f"needs the two-node local cluster (bash slurm/start-local-cluster.sh --nodes 2);"
               f" sinfo: {states or 'no cluster'}")
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)


def slurm_run(workdir: Path, extra: List[str], experiment: str) -> subprocess.Popen:
    args = ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1", *BASE, *extra,
            f"tracking.experiment={experiment}", f"train.run_dir={workdir / experiment}"]
    import sys

    return subprocess.Popen([sys.executable, "-m", "workbench.run", *args], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ.copy())


def losses(experiment: str) -> List[float]:
    return [v for _, v in metric_series(only_run(experiment).info.run_id, "loss")]


def test_a_two_node_run_is_one_run_on_two_nodes_with_its_rendezvous_on_the_first(workdir):
    """The issue's command: one MLflow run of world size 2, one rank per node, the rendezvous
    on node1's address (not localhost), Slurm's accounting listing both nodes."""
    proc = cli("workbench.run", ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1",
                                 "layout.dp_replicate=2", "train.steps=5",
                                 "data.max_bytes=1000000"], workdir, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run()
    tags = run.data.tags
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    assert [tags["wb.rank0.node"], tags["wb.rank1.node"]] == NODES
    assert [tags["wb.rank0.addr"], tags["wb.rank1.addr"]] == ["10.78.0.11", "10.78.0.12"]
    assert tags["slurm.nodelist"] == "node[1-2]" and tags["slurm.nnodes"] == "2"
    assert tags["wb.rendezvous"].startswith("node1:"), tags["wb.rendezvous"]
    assert tags["wb.link.nic"].startswith("eth0: "), tags["wb.link.nic"]
    acct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", tags["slurm.job_id"], "-o",
                           "NNodes,NodeList"], capture_output=True, text=True, timeout=30,
                          check=True).stdout.split()
    assert acct == ["2|node[1-2]"], acct
    assert [s for s, _ in metric_series(run.info.run_id, "loss")] == list(range(5))


LAYOUTS = {"ddp": ["layout=ddp"], "fsdp": ["layout=fsdp"], "tp": ["layout=tp"],
           "pp": ["layout=pp", "layout.pp_schedule=1f1b"]}


def test_layouts_across_the_node_boundary_train_with_the_losses_of_one_process(workdir):
    """ddp, fsdp, tp and pp (one stage per node) over the two nodes, two jobs at a time (each
    takes one CPU of each node); the one-process reference runs meanwhile, locally."""
    procs = {name: slurm_run(workdir, extra, name) for name, extra in LAYOUTS.items()}
    ref = cli("workbench.run", [*BASE, "tracking.experiment=one_process",
                                f"train.run_dir={workdir / 'one_process'}"], workdir)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = losses("one_process")
    assert len(reference) == 4
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, err[-3000:])
        run = only_run(name)
        assert {run.data.tags["wb.rank0.node"], run.data.tags["wb.rank1.node"]} == set(NODES)
        assert losses(name) == pytest.approx(reference, rel=REL_TOL), name


LOSS_RUN = ["train.steps=24", "train.global_batch=16", "train.micro_batch=8",
            "train.ckpt_every=8", "train.eval_every=8", "train.warmup_steps=2",
            "train.threads=1", "data.max_bytes=1000000", "layout.dp_replicate=2"]


def nodes_sh(*args: str) -> None:
    subprocess.run(["bash", str(REPO / "slurm" / "nodes.sh"), *args], check=True, timeout=60)


def _wait(predicate, timeout_s: float, what: str, every_s: float = 1.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.mark.parametrize("victim", ["node2", "node1"], ids=["node2", "node1_of_rank0"])
def test_a_node_lost_mid_run_is_requeued_and_resumes_bitwise(workdir, victim):
    """Every process on `victim` is killed after the first checkpoint (step 8) and before the
    run ends; Slurm calls the node DOWN, requeues the job, the node comes back (its slurmd
    restarted, ReturnToService=2) and the job resumes from its checkpoint into the same run:
    steps 0-23 each recorded once, the losses of the uninterrupted run of the same layout."""
    from mlflow.tracking import MlflowClient

    from workbench.compose import compose
    from workbench.launch.slurm import SlurmLauncher, results
    from workbench.submit import prepare_job

    launcher = ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1"]
    jobs = []
    for name in ("lost", "uninterrupted"):
        cfg = compose([*LOSS_RUN, *launcher, f"train.run_dir={workdir / name}"])
        jobs.append(prepare_job(cfg, LOSS_RUN, 2, {"test": name}))
    slurm = SlurmLauncher(compose(launcher).launcher)
    handle = slurm.submit(jobs[0])
    client = MlflowClient()
    _wait(lambda: len(client.get_metric_history(jobs[0].run_id, "loss")) >= 11, 300,
          "the run to pass its first checkpoint (step 8)")
    nodes_sh("lose", victim)
    _wait(lambda: node_states().get(victim, "").startswith("down"), 120,
          f"Slurm to call {victim} DOWN")
    nodes_sh("start", victim)  # the node comes back; the requeued job waits for it
    results(handle)  # raises if the job failed instead of resuming
    run = client.get_run(jobs[0].run_id)
    assert run.info.status == "FINISHED"
    assert int(run.data.tags["slurm.restart_count"]) >= 1, run.data.tags
    series = metric_series(jobs[0].run_id, "loss")
    assert [s for s, _ in series] == list(range(24)), series  # none lost, none twice
    results(slurm.submit(jobs[1]))
    reference = metric_series(jobs[1].run_id, "loss")
    assert [v for _, v in series] == [v for _, v in reference]  # bitwise
    log = Path(handle.paths.stderr).read_text()
    assert "resumed from checkpoint" in log


def test_a_node_lost_under_no_requeue_fails_with_one_line_and_resumes(workdir):
    """A site that forbids requeue (`--no-requeue`): the lost node ends the job, the command
    exits 1 with one line naming the node and the resume command, and that command continues
    the run from its checkpoint, every step recorded once."""
    import sys

    run_dir = workdir / "no_requeue"
    args = ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1", *LOSS_RUN,
            "+launcher.extra_sbatch.no-requeue=true", f"train.run_dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "-m", "workbench.run", *args], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ.copy())
    from mlflow.tracking import MlflowClient

    from workbench.job import Job

    # the store is read once the run exists (its job file written): a raw MLflow client that
    # creates ./mlflow.db itself, while the command creates it too, is not what is tested here
    _wait(lambda: (run_dir / "job.json").is_file(), 120, "the run's job file")
    run_id, client = Job.load(str(run_dir / "job.json")).run_id, MlflowClient()
    _wait(lambda: len(client.get_metric_history(run_id, "loss")) >= 11, 300,
          "the run to pass its first checkpoint (step 8)")
    nodes_sh("lose", "node2")
    out, err = proc.communicate(timeout=300)
    nodes_sh("start", "node2")
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: slurm job ") and "lost a node (NODE_FAIL" in last, last
    assert "node2" in last and f"train.run_dir={run_dir}" in last, last
    _wait(lambda: node_states().get("node2", "").rstrip("*") == "idle", 120, "node2 back")
    resumed = cli("workbench.run", [f"train.run_dir={run_dir}"], workdir, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = only_run()
    assert run.info.status == "FINISHED"
    assert [s for s, _ in metric_series(run.info.run_id, "loss")] == list(range(24))


def test_a_sweep_trial_that_loses_its_node_is_requeued_not_failed(workdir):
    """A detached sweep's array task across both nodes loses node2 after its first checkpoint:
    sacct shows the dead attempt (NODE_FAIL) while Slurm has queued the task again, and
    `sweep collect --wait` waits for it instead of recording a failed trial; the trial's run
    ends with every step recorded once."""
    import json

    name = "lost_node_sweep"
    args = ["+sweep=seeds", "sweep.space.train.seed=[1]", "sweep.n_trials=1",
            f"sweep.name={name}", "sweep.detach=true", "launcher=slurm", "launcher.nodes=2",
            "launcher.tasks_per_node=1", *LOSS_RUN]
    proc = cli("workbench.run", args, workdir, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    trials = workdir / f"sweeps/{name}/trials.json"
    run_id = next(iter(json.loads(trials.read_text()).values()))["run_id"]
    client = MlflowClient()
    _wait(lambda: len(client.get_metric_history(run_id, "loss")) >= 11, 300,
          "the trial to pass its first checkpoint (step 8)")
    nodes_sh("lose", "node2")
    _wait(lambda: node_states().get("node2", "").startswith("down"), 120, "node2 DOWN")
    nodes_sh("start", "node2")
    done = cli("workbench.sweep", ["collect", name, "--wait"], workdir, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    trial = next(iter(json.loads(trials.read_text()).values()))
    assert trial["status"] == "complete", trial
    assert [s for s, _ in metric_series(run_id, "loss")] == list(range(24))
    assert int(client.get_run(run_id).data.tags["slurm.restart_count"]) >= 1


def test_a_node_cut_off_the_network_mid_run_is_requeued_and_resumes_bitwise(workdir):
    """node2's link goes down (its processes run on, unreachable): the ranks block in their
    collective instead of seeing a reset, Slurm calls the node DOWN and requeues the job; the
    link comes back, Slurm ends the old attempt's processes on node2, and the job resumes from
    its checkpoint with every step recorded once and the uninterrupted run's losses."""
    from mlflow.tracking import MlflowClient

    from workbench.compose import compose
    from workbench.launch.slurm import SlurmLauncher, results
    from workbench.submit import prepare_job

    launcher = ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1"]
    jobs = [prepare_job(compose([*LOSS_RUN, *launcher, f"train.run_dir={workdir / name}"]),
                        LOSS_RUN, 2, {"test": name}) for name in ("cut", "uninterrupted")]
    slurm = SlurmLauncher(compose(launcher).launcher)
    handle = slurm.submit(jobs[0])
    client = MlflowClient()
    _wait(lambda: len(client.get_metric_history(jobs[0].run_id, "loss")) >= 11, 300,
          "the run to pass its first checkpoint (step 8)")
    nodes_sh("cut", "node2")
    try:
        _wait(lambda: node_states().get("node2", "").startswith("down"), 120,
              "Slurm to call node2 DOWN")
    finally:
        nodes_sh("join", "node2")
    results(handle)
    series = metric_series(jobs[0].run_id, "loss")
    assert [s for s, _ in series] == list(range(24)), series
    assert client.get_run(jobs[0].run_id).info.status == "FINISHED"
    results(slurm.submit(jobs[1]))
    assert [v for _, v in series] == [v for _, v in metric_series(jobs[1].run_id, "loss")]
