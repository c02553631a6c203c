"""Running over pools, checked without a cluster: the planner's split for the CPU pools the
benchmark runs, the CPU quota that emulates a slow pool, and the heterogeneous Slurm job that
launcher.stage_pools submits (placement, its sbatch script, its state from sacct). The job on the
real local cluster: tests/test_slurm.py; the measured split: benchmarks/hetero_cpu.py (README)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import in_ci

TWO_POOLS = ["model=gpt_tiny", "model.n_layers=8", "cluster=cpu_two_pools",
             "train.global_batch=16"]


def test_planner_gives_the_slow_pool_fewer_layers_and_predicts_a_faster_step():
    from workbench.compose import compose
    from workbench.plan.pools.search import plan_pipeline

    cfg = compose(TWO_POOLS)
    for order in (["fast", "slow"], ["slow", "fast"]):
        plan = plan_pipeline(cfg.model, cfg.cluster, cfg.train, order, 4)
        even = plan_pipeline(cfg.model, cfg.cluster, cfg.train, order, 4, [4, 4])
        slow = order.index("slow")
        assert sum(plan.layers) == 8 and plan.layers[slow] < plan.layers[1 - slow], plan
        assert plan.step_time_s < 0.8 * even.step_time_s, (plan, even)
        assert even.stage_s[slow] > 2 * even.stage_s[1 - slow]  # the pool 3x slower per layer
        assert plan.micro_batches == 4
    same = compose(TWO_POOLS + ["cluster.pools.1.peak_bf16_flops=1e11",
                                "cluster.pools.1.peak_fp32_flops=1e11",
                                "cluster.pools.1.hbm_bw_bytes_per_s=2e10"])
    alike = plan_pipeline(same.model, same.cluster, same.train, ["fast", "slow"], 4)
    assert abs(alike.layers[0] - alike.layers[1]) <= 1, alike  # equal pools: about even
    with pytest.raises(ValueError, match="must be one of"):
        plan_pipeline(cfg.model, cfg.cluster, cfg.train, ["fast", "gpu"], 4)


def test_cpu_quota_caps_a_process_and_is_removed():
    from workbench.testing.cpuquota import CpuQuota, unavailable_reason

    why = unavailable_reason()
    if why:
        if in_ci():
            pytest.fail(f"CI runs as root with a cgroup cpu controller: {why}")
        pytest.skip(why)
    burn = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass"
    with CpuQuota("test", 0.2) as quota:
        assert os.path.isdir(quota.path)
        code = f"from workbench.testing.cpuquota import join; join({quota.path!r})\n{burn}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        capped_s = time.perf_counter() - t0
    assert not os.path.exists(quota.path)
    # 0.3 s of CPU at 0.2 CPU takes >= 1.5 s of wall time, whatever else runs
    assert capped_s >= 1.4, capped_s


def _cfg(*extra: str):
    from workbench.compose import compose

    return compose(["launcher=slurm", "cluster=cpu_two_pools", "launcher.tasks_per_node=2",
                    "layout=pp", *extra])


def test_stage_pools_place_each_pipeline_rank_on_its_pool():
    from workbench import layout as layouts
    from workbench.launch.hetjob import placement, stage_tags

    cfg = _cfg("launcher.stage_pools=[slow,fast]", "layout.stage_layers=[1,3]")
    lay = layouts.resolve(cfg.layout, cfg.train, 2)
    comps = placement(cfg, lay, 2)
    assert [(c.pool, c.partition, c.pp_ranks, c.ntasks) for c in comps] == \
        [("slow", "pool2", (0,), 1), ("fast", "debug", (1,), 1)]
    tags = stage_tags(comps, lay, 4)
    assert tags["wb.stage0.pool"] == "slow" and tags["wb.stage0.layers"] == "1"
    assert tags["wb.stage1.partition"] == "debug" and tags["wb.stage1.layers"] == "3"


@pytest.mark.parametrize("extra, key, words", [
    (["launcher=local", "launcher.stage_pools=[fast,slow]"], "launcher.stage_pools",
     "needs launcher=slurm"),
    (["launcher.stage_pools=[fast]"], "launcher.stage_pools", "layout.pp=2 entries"),
    (["launcher.stage_pools=[fast,gpu]"], "launcher.stage_pools", "not a pool of cluster"),
    (["launcher.stage_pools=[fast,slow]", "cluster.pools.1.partition="],
     "cluster.pools\\[1\\].partition", "needs the Slurm partition"),
])
def test_bad_placements_are_config_errors(extra, key, words):
    from workbench import layout as layouts
    from workbench.errors import ConfigError
    from workbench.launch.hetjob import placement

    cfg = _cfg(*extra)
    with pytest.raises(ConfigError, match=f"{key}.*{words}"):
        placement(cfg, layouts.resolve(cfg.layout, cfg.train, 2), 2)


def test_pool_ranks_must_be_consecutive():
    from workbench import layout as layouts
    from workbench.errors import ConfigError
    from workbench.launch.hetjob import placement

    cfg = _cfg("layout.pp=4", "launcher.tasks_per_node=4",
               "launcher.stage_pools=[fast,slow,fast,slow]")
    with pytest.raises(ConfigError, match="consecutive"):
        placement(cfg, layouts.resolve(cfg.layout, cfg.train, 4), 4)


def test_heterogeneous_sbatch_script(tmp_path):
    from workbench import layout as layouts
    from workbench.launch.hetjob import make_het_executor, placement
    from workbench.launch.slurm import sbatch_parameters

    cfg = _cfg("launcher.stage_pools=[fast,slow]", "launcher.time_min=30")
    comps = placement(cfg, layouts.resolve(cfg.layout, cfg.train, 2), 2)
    ex = make_het_executor(comps, tmp_path, sbatch_parameters(cfg.launcher, "wb-x"), 3)
    assert ex._num_tasks() == 2
    text = ex._make_submission_file_text("python -m x", "u")
    head, tail = text.split("#SBATCH hetjob\n")
    assert "#SBATCH --partition=debug\n" in head and "#SBATCH --ntasks-per-node=1\n" in head
    for line in ("--partition=pool2", "--nodes=1", "--ntasks-per-node=1", "--time=30",
                 "--signal=USR2@90"):
        assert f"#SBATCH {line}\n" in tail, line
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun --het-group=0-1 --unbuffered")
    assert "%j" not in srun and "${SLURM_JOB_ID}" in srun  # the leader's id: one log folder


def test_job_state_from_sacct_component_lines():
    from workbench.launch.hetjob import HetInfoWatcher

    head = "JobID|State|NodeList\n"
    ok = head + "7+0|COMPLETED|vm\n7+0.batch|COMPLETED|vm\n7+1|COMPLETED|vm-pool2\n"
    bad = head + "7+0|COMPLETED|vm\n7+1|FAILED|vm-pool2\n"
    running = head + "7+1|RUNNING|vm-pool2\n7+0|RUNNING|vm\n"
    watcher = HetInfoWatcher()
    assert watcher.read_info(ok)["7"]["State"] == "COMPLETED"
    assert watcher.read_info(bad)["7"]["State"] == "FAILED"
    assert watcher.read_info(running)["7"]["NodeList"] == "vm"
