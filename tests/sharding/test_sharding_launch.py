"""Launch scripts and multi-host helpers: command lines, env plumbing (fake srun), single-process no-ops."""
import os
import shlex
import socket
import subprocess
import sys

import numpy as np
import pytest

from k3jax.cache import SeqChunk, make_step_batch
from sharding import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dry(script, *args):
    out = subprocess.run(["bash", os.path.join(ROOT, "deploy", script), *args, "--dry-run", "--", "sharding.check",
                          "--mesh", "expert=2,tensor=8"], capture_output=True, text=True, check=True)
    return out.stdout


def test_tpu_pod_command_line():
    out = _dry("launch_tpu_pod.sh", "--tpu", "k3-pod", "--zone", "us-east5-a", "--project", "p1",
               "--env", "JAX_COMPILATION_CACHE_DIR=/tmp/cache")
    assert out.startswith("gcloud compute tpus tpu-vm ssh k3-pod --zone us-east5-a --worker=all --command ")
    assert "K3JAX_DISTRIBUTED=auto" in out and "JAX_COMPILATION_CACHE_DIR=/tmp/cache" in out
    argv = shlex.split(out)                                   # as the local shell runs it
    remote = shlex.split(argv[argv.index("--command") + 1])     # as each worker's shell runs it
    assert remote[:3] == ["cd", "~/k3jax", "&&"] and remote[3] == "K3JAX_DISTRIBUTED=auto"
    assert remote[-6:] == ["python3", "-m", "sharding.launch", "sharding.check", "--mesh", "expert=2,tensor=8"]
    assert out.rstrip().endswith("--project p1")
    bad = subprocess.run(["bash", os.path.join(ROOT, "deploy", "launch_tpu_pod.sh"), "--", "x"], capture_output=True)
    assert bad.returncode == 2


def test_slurm_command_line():
    out = _dry("launch_gpu_slurm.sh", "--nodes", "2", "--gpus-per-node", "8", "--port", "4321")
    assert out.startswith("srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8")
    assert "K3JAX_COORDINATOR=\"${first}:4321\"" in out and "K3JAX_LOCAL_DEVICE_IDS" in out
    host = _dry("launch_gpu_slurm.sh", "--per-host", "--nodes", "4")
    assert "--ntasks-per-node=1" in host and "per-host\" == per-gpu" in host


def test_single_process_helpers_are_no_ops(monkeypatch):
    for k in ("K3JAX_COORDINATOR", "K3JAX_NUM_PROCESSES", "K3JAX_PROCESS_ID", "K3JAX_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.initialize() is False
    assert distributed.initialize(num_processes=1) is False
    batch = make_step_batch([SeqChunk([1, 2, 3], 0, [1], -1, 1)], 16, num_tokens=8)
    got = distributed.broadcast_host_tree(batch)
    np.testing.assert_array_equal(got.tokens, batch.tokens)
    assert distributed._bucket(1) == 1024 and distributed._bucket(5000) == 8192


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_slurm_script_runs_two_tasks_with_fake_srun(tmp_path):
    """The task script's env (coordinator = first node, ids from SLURM_*) starts a real 2-process job."""
    (tmp_path / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    (tmp_path / "srun").write_text(
        "#!/bin/bash\nwhile [[ \"$1\" == --* ]]; do shift; done\n"
        "for i in 0 1; do SLURM_NTASKS=2 SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_JOB_NODELIST=n[1-2] "
        "\"$@\" > \"$(dirname \"$0\")/task$i.log\" 2>&1 & done; wait\n")
    for f in ("scontrol", "srun"):
        os.chmod(tmp_path / f, 0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
    subprocess.run(["bash", os.path.join(ROOT, "deploy", "launch_gpu_slurm.sh"), "--per-host", "--port", str(port),
                    "--python", sys.executable, "--", "sharding.check", "--mesh", "tensor=2,expert=4", "--max-new", "3"],
                   env=env, cwd=ROOT, check=True, timeout=220)
    log0 = (tmp_path / "task0.log").read_text()
    assert "processes 2, devices 8 (cpu)" in log0 and "\nOK" in log0, log0[-2000:]
