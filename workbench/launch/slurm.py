"""The Slurm launcher: submitit's executor around the one rank entry point.

Each Slurm task is one rank. It runs `TrainTask(job_file)`, which exports the torch.distributed
rendezvous from the Slurm environment, then calls `workbench.rank.run_job` on the job file,
exactly as the local and torchrun launchers do. A time-limit (USR2, from `--signal`) or preemption
(TERM) signal only raises a flag; the training loop polls it between steps, writes a checkpoint
and returns, and then the task requeues itself through submitit (USR2) or lets Slurm requeue it
(TERM from `scontrol requeue` or a preemption). The requeued task runs the same pickled
`TrainTask(job_file)`, so it resumes from the checkpoint into the same MLflow run, whatever was
edited in the working tree since submission.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from workbench.config import LauncherConfig, TrackingConfig
from workbench.errors import ConfigError
from workbench.job import Job
from workbench.launch.node_loss import peer_lost, wait_for_requeue
from workbench.launch.world import world_size
from workbench.startup import fewer_gc_passes

# How many times a job may hit its time limit and requeue itself. Slurm checks limits on a ~30 s
# tick, so a short job can be signalled several times; a site job rarely needs more than a few.
MAX_TIMEOUT_REQUEUES = 10
SIGNAL_DELAY_S = 90  # `--signal=USR2@90`: the warning before the time limit
RENDEZVOUS_WAIT_S = 600.0  # how long ranks wait for rank 0's port (the process-group timeout)


@dataclass
class StopFlag:
    """Set by a signal handler, read by the training loop between steps (never acts itself:
    a checkpoint written inside a signal handler could interleave with a half-done step)."""

    signals: list[int] = field(default_factory=list)

    def handler(self, signum: int, frame: Any = None) -> None:
        self.signals.append(signum)

    @property
    def requeue_self(self) -> bool:
        """USR2 (time limit / submitit interrupt): this task must requeue itself."""
        return signal.SIGUSR2 in self.signals

    def local(self) -> bool:
        return bool(self.signals)


class TrainTask(submitit.helpers.Checkpointable):
    """What each Slurm task runs: one rank of the job in `job_path`. Checkpointable: submitit
    re-pickles this same object on a requeue, and training state lives in the run's checkpoints,
    so the requeued task simply runs the job file again and resumes."""

    def __init__(self, job_path: str):
        self.job_path = str(job_path)

    def __call__(self) -> dict[str, float]:
        fewer_gc_passes()  # before torch loads (workbench/startup.py)
        env = submitit.JobEnvironment()
        het = bool(os.environ.get("SLURM_HET_SIZE"))  # one component per pool (launch/hetjob)
        if env.num_tasks > 1:
            dist_env = submitit.helpers.TorchDistributedEnvironment()
            if "MASTER_PORT" not in os.environ:  # a site's own choice wins
                dist_env.master_port = rendezvous_port(env.global_rank, rendezvous_file(env))
            dist_env.export(set_cuda_visible_devices=False)
            if het:
                from workbench.launch.hetjob import master_addr

                os.environ["MASTER_ADDR"] = master_addr()
        cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)
        if cpus and "OMP_NUM_THREADS" not in os.environ:
            import torch

            torch.set_num_threads(cpus)  # one rank per CPU slot; no oversubscription
        flag = StopFlag()
        submitit_usr2 = signal.getsignal(signal.SIGUSR2)
        signal.signal(signal.SIGUSR2, flag.handler)
        signal.signal(signal.SIGTERM, flag.handler)
        job = Job.load(self.job_path)
        tags = slurm_tags(env) if env.global_rank == 0 else {}
        if env.num_tasks > 1:
            tags |= node_tags(env.global_rank)
        if het:
            from workbench.launch.hetjob import rank_tags

            tags |= rank_tags(env.global_rank)
        if tags:
            _tag_run(job, tags)
        try:
            last = job.run_on_this_rank(progress=False, stop_requested=flag.local)
        except Exception as exc:
            if int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1) > 1 and peer_lost(exc):
                wait_for_requeue(env.global_rank, exc, str(job.run_dir))  # launch/node_loss
            raise
        if "stopped_at" not in last:
            # Done: a time-limit warning that arrives now must not kill the exiting process
            # (Slurm would then record FAILED for a finished run).
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return last
        print(f"stopped at step {last['stopped_at']} after signal(s) {flag.signals}; "
              "checkpoint written", file=sys.stderr, flush=True)
        if flag.requeue_self and env.global_rank == 0 and callable(submitit_usr2):
            # submitit's own handler: counts timeouts, re-pickles this task, `scontrol requeue`
            # of this job (one array task only), then exits without writing a result.
            submitit_usr2(signal.SIGUSR2, None)
        # TERM: Slurm (requeue or preemption) is ending this attempt; the non-zero ranks wait for
        # rank 0's requeue to end them. Neither writes a result: the job is not done.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(1)
        raise SystemExit(1)


def rendezvous_file(env: submitit.JobEnvironment) -> Path:
    """Where rank 0 of this attempt publishes its rendezvous port: the job's own folder (shared
    by its tasks, as submitit requires), named by job and restart count so that a requeued
    attempt never reads the port of the one before."""
    e = os.environ
    return Path(env.paths.folder) / (f"rendezvous_{e.get('SLURM_JOB_ID', env.job_id)}_"
                                     f"{e.get('SLURM_RESTART_COUNT', '0')}.port")


def rendezvous_port(rank: int, path: Path, wait_s: float = RENDEZVOUS_WAIT_S) -> int:
    """The MASTER_PORT of this attempt. submitit derives it from the job id, anywhere in
    20000-60000: inside Linux's ephemeral range, so any outgoing connection on the node (an
    MLflow or database client) can hold it, and then rank 0 cannot listen and the other ranks
    wait out the whole process-group timeout. Rank 0 takes a port the kernel says is free and
    writes it to `path`; the others read it from there."""
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(path)  # atomic: a reader sees no file or the whole port
        return port
    deadline = time.monotonic() + wait_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: rank 0 published no rendezvous port in {path} "
                               f"within {wait_s:.0f} s")
        time.sleep(0.2)
    return int(path.read_text())


def slurm_tags(env: submitit.JobEnvironment | None = None) -> dict[str, str]:
    """The Slurm identity of this attempt as MLflow tags (job, array, restart, log paths)."""
    e = os.environ
    tags = {"slurm.job_id": e.get("SLURM_JOB_ID", ""),
            "slurm.array_job_id": e.get("SLURM_ARRAY_JOB_ID", ""),
            "slurm.array_task_id": e.get("SLURM_ARRAY_TASK_ID", ""),
            "slurm.restart_count": e.get("SLURM_RESTART_COUNT", "0"),
            "slurm.nodelist": e.get("SLURM_JOB_NODELIST", ""),
            "slurm.cluster": e.get("SLURM_CLUSTER_NAME", "")}
    if env is not None:
        tags["slurm.submitit_id"] = env.job_id
        tags["slurm.stdout"] = str(env.paths.stdout)
        tags["slurm.stderr"] = str(env.paths.stderr)
    return {k: v for k, v in tags.items() if v}


def node_tags(global_rank: int) -> dict[str, str]:
    """Where this rank ran, from its own environment (evidence, not intent): its node, and the
    address its collectives use (the one its host name resolves to, gloo's default device); on
    rank 0 also the rendezvous address, the job's node count and what limits that address's
    NIC (a `tc` qdisc, as the local cluster's --link-mbit sets; 'no limit' when none)."""
    e = os.environ
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = ""
    tags = {f"wb.rank{global_rank}.node": e.get("SLURMD_NODENAME", ""),
            f"wb.rank{global_rank}.addr": addr}
    if global_rank == 0:
        tags |= {"slurm.nnodes": e.get("SLURM_JOB_NUM_NODES", ""),
                 "wb.rendezvous": f"{e.get('MASTER_ADDR', '')}:{e.get('MASTER_PORT', '')}",
                 "wb.link.nic": nic_limit(addr)}
    return {k: v for k, v in tags.items() if v and v != ":"}


def nic_limit(addr: str) -> str:
    """'IFACE: tbf rate 100Mbit' (the root qdisc's rate on the interface holding `addr`),
    'IFACE: no limit', or '' where iproute2 is missing or the address is on no interface."""
    import shutil
    import subprocess

    if not addr or shutil.which("ip") is None or shutil.which("tc") is None:
        return ""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=10, check=False).stdout
    iface = next((line.split()[1] for line in out.splitlines()
                  if f" {addr}/" in line), "")
    if not iface:
        return ""
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", iface, "root"], capture_output=True,
                           text=True, timeout=10, check=False).stdout
    found = re.search(r"\b(tbf|htb|netem)\b.*?\brate (\S+)", qdisc)
    return f"{iface}: {found.group(1)} rate {found.group(2)}" if found else f"{iface}: no limit"


def _tag_run(job: Job, tags: dict[str, str]) -> None:
    """Tag the job's run from inside the job (restart count and node list change per attempt)."""
    cfg = job.run_config()
    if not job.run_id or cfg.tracking.backend == "none":
        return
    from mlflow.entities import RunTag

    from workbench.track.store import client as store_client
    from workbench.track.tracker import with_retries

    client = store_client(cfg.tracking.resolved_uri())
    with_retries(client.log_batch, job.run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def tag_submitted(tracking: TrackingConfig, run_id: str | None,
                  handle: submitit.Job[Any], client: Any = None) -> None:
    """Record the job id and log paths on the run right after submission (before it starts),
    so a run that never starts still links to its Slurm job."""
    if not run_id or tracking.backend == "none":
        return
    from mlflow.entities import RunTag

    from workbench.track.store import client as store_client
    from workbench.track.tracker import with_retries

    tags = {"slurm.job_id": handle.job_id, "slurm.stdout": str(handle.paths.stdout),
            "slurm.stderr": str(handle.paths.stderr)}
    if "_" in handle.job_id:
        array_id, task_id = handle.job_id.split("_", 1)
        tags |= {"slurm.array_job_id": array_id, "slurm.array_task_id": task_id}
    client = client or store_client(tracking.resolved_uri())
    with_retries(client.log_batch, run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def sbatch_parameters(cfg: LauncherConfig, name: str) -> dict[str, Any]:
    """submitit's Slurm parameters from the launcher config; empty strings mean "site default"."""
    params: dict[str, Any] = {"job_name": name, "nodes": cfg.nodes,
                              "ntasks_per_node": cfg.tasks_per_node,
                              "cpus_per_task": cfg.cpus_per_task, "time": cfg.time_min,
                              "signal_delay_s": min(SIGNAL_DELAY_S, max(10, cfg.time_min * 30)),
                              "stderr_to_stdout": False,
                              # a rank that fails ends its peers at once (they would otherwise
                              # wait for a node loss that is not one: launch/node_loss)
                              "srun_args": ["--kill-on-bad-exit=1"]}
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cfg, key):
            params[key] = getattr(cfg, key)
    if cfg.gpus_per_node:
        params["gpus_per_node"] = cfg.gpus_per_node
    if cfg.extra_sbatch:  # {"mem": "32G", "exclusive": ""}: an empty or "true" value is a flag
        params["additional_parameters"] = {
            k.replace("-", "_"): True if str(v).lower() in ("", "true") else v
            for k, v in cfg.extra_sbatch.items()}
    return params


def validate(cfg: LauncherConfig) -> None:
    for key in ("nodes", "tasks_per_node", "cpus_per_task", "time_min"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"launcher.{key}", getattr(cfg, key), "must be > 0")
    if cfg.gpus_per_node < 0:
        raise ConfigError("launcher.gpus_per_node", cfg.gpus_per_node, "must be >= 0")


def make_executor(cfg: LauncherConfig, folder: Path, name: str,
                  array_parallelism: int = 256) -> submitit.SlurmExecutor:
    """A Slurm executor writing its logs and pickles under `folder/<job id>`."""
    validate(cfg)
    executor = submitit.SlurmExecutor(folder=str(folder / "%j"),
                                      max_num_timeout=MAX_TIMEOUT_REQUEUES)
    executor.update_parameters(**sbatch_parameters(cfg, name),
                               array_parallelism=array_parallelism)
    return executor


class SlurmLauncher:
    """`launcher=slurm`: submit the job, wait for it, return rank 0's final metrics."""

    def __init__(self, cfg: LauncherConfig):
        validate(cfg)
        self.cfg = cfg

    def world_size(self) -> int:
        return world_size(self.cfg)

    def submit(self, job: Job, folder: Path | None = None) -> submitit.Job[Any]:
        folder = folder or Path(job.run_dir) / "slurm"
        name = f"wb-{Path(job.run_dir).name}"
        if self.cfg.stage_pools:  # one heterogeneous job over the cluster's pools
            from workbench.launch.hetjob import make_het_executor, placement

            comps = placement(job.run_config(), job.the_layout(), job.world_size)
            executor: submitit.SlurmExecutor = make_het_executor(
                comps, folder, sbatch_parameters(self.cfg, name), MAX_TIMEOUT_REQUEUES)
        else:
            executor = make_executor(self.cfg, folder, name)
        handle = executor.submit(TrainTask(str(job.path)))
        tag_submitted(job.run_config().tracking, job.run_id, handle)
        return handle

    def submit_array(self, jobs: Sequence[Job], folder: Path, name: str,
                     parallelism: int) -> list[submitit.Job[Any]]:
        """One Slurm job array, one task per job file (submitit's batch: a single sbatch)."""
        executor = make_executor(self.cfg, folder, name, array_parallelism=parallelism)
        with executor.batch():
            handles = [executor.submit(TrainTask(str(j.path))) for j in jobs]
        client = None
        for job, handle in zip(jobs, handles):
            tracking = job.run_config().tracking
            if client is None and tracking.backend != "none":
                from workbench.track.store import client as store_client

                client = store_client(tracking.resolved_uri())
            tag_submitted(tracking, job.run_id, handle, client)
        return handles

    def launch(self, job: Job) -> dict[str, float]:
        handle = self.submit(job)
        print(f"slurm job {handle.job_id}; logs: {handle.paths.stdout}", file=sys.stderr)
        from submitit.core.utils import UncompletedJobError

        try:
            return results(handle)[0]  # one result per task; rank 0 owns the metrics
        except UncompletedJobError:
            state = ended_state(handle.job_id)
            if not state.startswith("NODE_FAIL"):
                raise
            from workbench.launch.world import RanksFailed

            raise RanksFailed(f"slurm job {handle.job_id} lost a node ({state}) and Slurm did not "
                              f"requeue it; resume with: python -m workbench.run "
                              f"train.run_dir={job.run_dir}") from None


def results(handle: submitit.Job[Any], poll_s: float = 2.0) -> list[Any]:
    """submitit's results of a job, waiting through Slurm's requeues. After a node failure
    sacct reports the attempt that died (NODE_FAIL) while Slurm has already queued the job again
    (launch/node_loss); submitit takes that state for the job's end and, finding no result,
    raises. The job is done only once it has left the queue."""
    from submitit.core.utils import UncompletedJobError

    while True:
        try:
            return handle.results()
        except UncompletedJobError:
            if not still_queued(handle.job_id):
                raise
            time.sleep(poll_s)


def ended_state(job_id: str) -> str:
    """The state sacct records for the job, and for a lost node which of its nodes Slurm now
    reports down or silent: 'NODE_FAIL; down now: node2 (down*)'."""
    import subprocess

    from workbench.launch.node_loss import silent_nodes

    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,NodeList"],
                         capture_output=True, text=True, timeout=30, check=False).stdout
    last = (out.strip().splitlines() or ["|"])[-1]
    state, _, nodes = last.partition("|")
    bad = silent_nodes(nodes) if nodes and state.startswith("NODE_FAIL") else []
    return f"{state}; down now: {', '.join(bad)}" if bad else f"{state} on {nodes}"


def still_queued(job_id: str) -> bool:
    """Is the job pending, running or requeued in Slurm's queue (not ended)?"""
    import subprocess

    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"],
                         capture_output=True, text=True, timeout=30, check=False).stdout
    return any(state.strip() for state in out.splitlines())
