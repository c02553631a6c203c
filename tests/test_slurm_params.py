"""The sbatch script `launcher=slurm` produces, checked without a cluster."""

from __future__ import annotations

import pytest


def test_launcher_config_becomes_sbatch_options(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    from workbench.compose import compose
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
    from workbench.compose import compose
    from workbench.errors import ConfigError
    from workbench.launch.slurm import SlurmLauncher

    cfg = compose(["launcher=slurm", "launcher.tasks_per_node=0"]).launcher
    with pytest.raises(ConfigError, match="launcher.tasks_per_node"):
        SlurmLauncher(cfg)


def test_rank_zero_publishes_a_free_port_that_every_rank_reads(tmp_path, monkeypatch):
    """A Slurm job's rendezvous port is one the kernel gave rank 0 as free, read by the other
    ranks from the job folder, and named per attempt: submitit's hash of the job id lands in
    the ephemeral range, where a client connection can hold it and leave the job hanging."""
    import socket
    import threading
    from types import SimpleNamespace

    from submitit.core.utils import JobPaths

    from workbench.launch.slurm import rendezvous_file, rendezvous_port

    env = SimpleNamespace(job_id="159_1", paths=JobPaths(tmp_path / "%j", "159_1"))
    (tmp_path / "159_1").mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "159")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    path = rendezvous_file(env)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert rendezvous_file(env) != path and path.parent == tmp_path / "159_1"
    read: list[int] = []
    reader = threading.Thread(target=lambda: read.append(rendezvous_port(1, path, wait_s=30)))
    reader.start()
    port = rendezvous_port(0, path)
    reader.join(timeout=30)
    assert read == [port] and not path.with_name(path.name + ".tmp").exists()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))  # still free for rank 0's store to listen on
    with pytest.raises(RuntimeError, match="rank 2: rank 0 published no rendezvous port"):
        rendezvous_port(2, tmp_path / "never.port", wait_s=0.3)


@pytest.mark.parametrize("args, says", [
    (["--nodes", "0"], "--nodes must be a whole number >= 1, not '0'"),
    (["--nodes", "two"], "--nodes must be a whole number >= 1, not 'two'"),
    (["--nodes", "65"], "--nodes must be at most 64, not 65"),
    (["--link-mbit", "fast"], "--link-mbit must be a number of Mbit/s (0: unlimited), not 'fast'"),
    (["--node", "2"], "unknown argument '--node' (valid: --nodes N, --link-mbit R)"),
])
def test_the_local_cluster_refuses_a_bad_shape_with_one_line_before_touching_anything(
        args, says, tmp_path):
    """Checked before any package, daemon or namespace is touched (no root needed)."""
    import subprocess

    from conftest import REPO

    proc = subprocess.run(["bash", str(REPO / "slurm" / "start-local-cluster.sh"), *args],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "SLURM_LOCAL_DIR": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == \
        [f"start-local-cluster.sh: {says}"], proc.stderr
    assert not any(tmp_path.iterdir())
