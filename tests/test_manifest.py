"""The manifest's environment (torch and CUDA versions, the machine) is read without importing
torch, so a driver that only launches ranks (torchrun, Slurm, a sweep) does not pay ~2 s of CPU
for it, and says the same as torch itself would."""

from __future__ import annotations

import json
import subprocess
import sys


def test_versions_read_without_torch_equal_torchs_own():
    probe = ("import json, sys\n"
             "from workbench.track import manifest\n"
             "from workbench.launch.torchrun import TorchrunLauncher\n"
             "from workbench.train.counts import n_params\n"
             "v, hw = manifest.versions(), manifest.hardware()\n"
             "print(json.dumps({'v': v, 'hw': hw, 'torch': 'torch' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    got = json.loads(out.stdout)
    assert got["torch"] is False  # nothing above imported torch
    import torch

    assert got["v"]["torch"] == torch.__version__
    assert got["v"]["cuda"] == torch.version.cuda
    assert got["v"]["python"] == sys.version.split()[0]
    assert got["hw"]["cpus"] >= 1 and got["hw"]["memory_bytes"] > 0


def test_a_process_that_loaded_torch_records_its_threads():
    from workbench.track import manifest

    manifest.hardware.cache_clear()
    import torch

    assert manifest.hardware()["torch_threads"] == torch.get_num_threads()
