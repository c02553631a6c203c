"""The sbatch script `launcher=slurm` produces, checked without a cluster."""

from __future__ import annotations

import pytest


def test_launcher_config_becomes_sbatch_options(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    from workbench.cli import compose
    from workbench.launch.slurm import SlurmLauncher, sbatch_parameters

    cfg = compose(["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=4",
                   "launcher.partition=gpu", "launcher.account=proj", "launcher.qos=high",
                   "launcher.constraint=h100", "launcher.gpus_per_node=4",
                   "launcher.time_min=240", "+launcher.extra_sbatch.mem=64G",
                   "+launcher.extra_sbatch.exclusive=true"]).launcher
    assert SlurmLauncher(cfg).world_size() == 8
    script = _make_sbatch_string(command="python -m x", folder=str(tmp_path),
                                 **sbatch_parameters(cfg, "wb-test"))
    for line in ["--nodes=2", "--ntasks-per-node=4", "--partition=gpu", "--account=proj",
                 "--qos=high", "--constraint=h100", "--gpus-per-node=4", "--time=240",
                 "--signal=USR2@90", "--mem=64G", "--exclusive", "--job-name=wb-test"]:
        assert f"#SBATCH {line}\n" in script, line


def test_bad_launcher_values_are_config_errors():
    from workbench.cli import compose
    from workbench.config import ConfigError
    from workbench.launch.slurm import SlurmLauncher

    cfg = compose(["launcher=slurm", "launcher.tasks_per_node=0"]).launcher
    with pytest.raises(ConfigError, match="launcher.tasks_per_node"):
        SlurmLauncher(cfg)
