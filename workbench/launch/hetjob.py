"""One Slurm job over the pools of a mixed cluster: a heterogeneous job, one component per pool.

Why a heterogeneous job: a Slurm job runs in ONE partition (`--partition=a,b` only lets Slurm
pick whichever starts first), and on a site each GPU type is a partition, so a pipeline whose
stages must sit on two types needs Slurm's heterogeneous job: components with their own
partition, nodes and tasks, allocated and started together, and one job step over all of them
(`srun --het-group=0-K`) whose tasks share one numbering (SLURM_PROCID 0..N-1 in component
order), one SLURM_NTASKS and the leader's SLURM_JOB_ID. So the torch.distributed rendezvous, the
one rank entry point and submitit's result files work unchanged, and global rank r is the r-th
task of the components in order: the components follow the pipeline, so pipeline rank p (the
outermost mesh dimension: ranks p * R .. p * R + R - 1, R = world / pp) is on its stage's pool.

submitit has no API for heterogeneous jobs (facebookincubator/submitit#1741). HetSlurmExecutor
writes submitit's own batch script for component 0, adds a `#SBATCH hetjob` block per further
component and `--het-group` to its srun; its job class reads sacct's `ID+K` component lines as
the job's state. Slurm's backfill scheduler, the only one that starts heterogeneous jobs, plans
whole nodes: two components never share a node (the local cluster gives its second partition a
node of its own, slurm/slurm.conf.in).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import submitit
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob, _parse_node_list

from workbench.config import RunConfig
from workbench.errors import ConfigError
from workbench.layout import Layout

FAILED = ("FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED")


@dataclass(frozen=True)
class Component:
    """One heterogeneous-job component: a pool's consecutive pipeline ranks in its partition."""

    pool: str
    partition: str
    pp_ranks: tuple[int, ...]
    ntasks: int
    nodes: int
    tasks_per_node: int


def placement(cfg: RunConfig, layout: Layout, world_size: int) -> List[Component]:
    """The components of a run with `launcher.stage_pools`, in pipeline order (ConfigError naming
    the key when the pools, their partitions or the layout do not fit together)."""
    names = [str(x) for x in cfg.launcher.stage_pools]
    if cfg.launcher.name != "slurm":
        raise ConfigError("launcher.stage_pools", names, "places ranks on Slurm partitions: "
                                                         "needs launcher=slurm")
    if len(names) != layout.pp:
        raise ConfigError("launcher.stage_pools", names,
                          f"needs one pool per pipeline rank: layout.pp={layout.pp} entries")
    pools = {str(p.name): (i, str(p.partition)) for i, p in enumerate(cfg.cluster.pools or [])}
    for n in names:
        if n not in pools:
            raise ConfigError("launcher.stage_pools", names,
                              f"{n!r} is not a pool of cluster {cfg.cluster.name} "
                              f"({', '.join(pools) or 'it has no pools'})")
        if not pools[n][1]:
            raise ConfigError(f"cluster.pools[{pools[n][0]}].partition", "",
                              f"pool {n!r} needs the Slurm partition of its nodes")
    runs: List[List[int]] = []
    for r, n in enumerate(names):
        if runs and names[runs[-1][0]] == n:
            runs[-1].append(r)
        elif any(names[run[0]] == n for run in runs):
            raise ConfigError("launcher.stage_pools", names,
                              "a pool's pipeline ranks must be consecutive (one component each)")
        else:
            runs.append([r])
    per_rank = world_size // layout.pp
    out = []
    for run in runs:
        ntasks = len(run) * per_rank
        tpn = min(cfg.launcher.tasks_per_node, ntasks)
        if ntasks % tpn:
            raise ConfigError("launcher.tasks_per_node", cfg.launcher.tasks_per_node,
                              f"must divide the {ntasks} ranks of pool {names[run[0]]!r}")
        out.append(Component(names[run[0]], pools[names[run[0]]][1], tuple(run), ntasks,
                             ntasks // tpn, tpn))
    return out


def stage_tags(comps: List[Component], layout: Layout, n_layers: int) -> Dict[str, str]:
    """Each pipeline rank's pool, partition and layer count, as run tags."""
    split = layout.stage_split(n_layers)
    tags = {"wb.pools": ",".join(c.pool for c in comps), "wb.hetjob_components": str(len(comps))}
    for c in comps:
        for r in c.pp_ranks:
            layers = sum(split[s] for s in range(r, len(split), layout.pp))
            tags |= {f"wb.stage{r}.pool": c.pool, f"wb.stage{r}.partition": c.partition,
                     f"wb.stage{r}.layers": str(layers)}
    return tags


def rank_tags(global_rank: int) -> Dict[str, str]:
    """What Slurm made of the components, as rank 0 sees it (evidence, not intent); each
    rank's own node is tagged by every multi-task job (launch/slurm.node_tags)."""
    e = os.environ
    tags: Dict[str, str] = {}
    if global_rank == 0 and e.get("SLURM_HET_SIZE"):
        tags["slurm.het_size"] = e["SLURM_HET_SIZE"]
        for k in range(int(e["SLURM_HET_SIZE"])):
            tags[f"slurm.het_group{k}.partition"] = e.get(f"SLURM_JOB_PARTITION_HET_GROUP_{k}", "")
            tags[f"slurm.het_group{k}.nodelist"] = e.get(f"SLURM_JOB_NODELIST_HET_GROUP_{k}", "")
            tags[f"slurm.het_group{k}.job_id"] = e.get(f"SLURM_JOB_ID_HET_GROUP_{k}", "")
    return {k: v for k, v in tags.items() if v}


def master_addr() -> str:
    """The address of global rank 0's node: the first node of component 0, as Slurm knows it
    (SLURM_JOB_NODELIST lists every component's nodes sorted by name, not rank 0's first)."""
    first = _parse_node_list(os.environ["SLURM_JOB_NODELIST_HET_GROUP_0"])[0]
    out = subprocess.run(["scontrol", "show", "node", first, "-o"], capture_output=True,
                         text=True, timeout=30, check=False)
    found = re.search(r"NodeAddr=(\S+)", out.stdout)
    return found.group(1) if found else first


class HetInfoWatcher(SlurmInfoWatcher):
    """sacct lists component K of job N as `N+K`: the job's state is component 0's (it runs
    the batch script), or a failed component's."""

    def read_info(self, string: Any) -> Dict[str, Dict[str, str]]:
        stats = super().read_info(string)
        out = dict(stats)
        for key in sorted(stats, key=lambda k: k.partition("+")[2] != "0"):
            main, plus, comp = key.partition("+")
            state = stats[key].get("State", "")
            if plus and (comp == "0" or state.split(" ")[0] in FAILED):
                out[main] = stats[key]
        return out


class HetSlurmJob(SlurmJob):
    watcher = HetInfoWatcher(delay_s=600)


class HetSlurmExecutor(submitit.SlurmExecutor):
    """submitit's executor, writing one heterogeneous job of `components` (see the module)."""

    job_class = HetSlurmJob

    def __init__(self, folder: str, components: List[Component], max_num_timeout: int):
        super().__init__(folder=folder, max_num_timeout=max_num_timeout)
        self.components = components

    def _num_tasks(self) -> int:
        return sum(c.ntasks for c in self.components)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = super()._make_submission_file_text(command, uid)
        lines = text.split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
        extra: List[str] = []
        for c in self.components[1:]:
            opts = component_options(c, self.parameters)
            extra += ["#SBATCH hetjob"] + [f"#SBATCH --{k}={v}" for k, v in opts.items()]
        lines[last + 1:last + 1] = extra
        # srun's log paths: %j would be each component's own job id, a folder submitit never
        # made (slurmd then fails with "could not connect IO"); the batch script's
        # SLURM_JOB_ID is the leader's, the id every task reports and submitit waits on.
        i = next(i for i, line in enumerate(lines) if line.startswith("srun "))
        groups = f"--het-group=0-{len(self.components) - 1}"
        lines[i] = lines[i].replace("%j", "${SLURM_JOB_ID}").replace(
            "srun --unbuffered", f"srun {groups} --unbuffered", 1)
        return "\n".join(lines)


# what Slurm resets for each component, so every further component repeats component 0's value
PER_COMPONENT = ("cpus_per_task", "time", "account", "qos", "constraint", "gpus_per_node")


def component_options(c: Component, params: Dict[str, Any]) -> Dict[str, Any]:
    """sbatch options of a further component: its partition and size, and component 0's values
    of what Slurm resets per component, taken from the job's submitit parameters (the launcher's
    one mapping, launch.slurm.sbatch_parameters), the time-limit warning included.
    launcher.extra_sbatch goes to component 0 only."""
    opts: Dict[str, Any] = {"partition": c.partition, "nodes": c.nodes,
                            "ntasks-per-node": c.tasks_per_node}
    opts |= {k.replace("_", "-"): params[k] for k in PER_COMPONENT if k in params}
    if params.get("signal_delay_s"):  # every component's tasks get the time-limit warning
        opts["signal"] = f"USR2@{params['signal_delay_s']}"
    return opts


def make_het_executor(components: List[Component], folder: Path, params: Dict[str, Any],
                      max_num_timeout: int) -> HetSlurmExecutor:
    """The executor of one heterogeneous job; `params` are the launcher's sbatch parameters,
    whose partition and size become component 0's."""
    executor = HetSlurmExecutor(str(folder / "%j"), components, max_num_timeout)
    first = components[0]
    executor.update_parameters(**{**params, "partition": first.partition,
                                  "nodes": first.nodes, "ntasks_per_node": first.tasks_per_node})
    return executor
