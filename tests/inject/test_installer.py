"""``comminsight inject install|status|uninstall`` on a real environment, and a real torchrun job (gloo, CPU).

The training script (scripts/inject_job.py) has no CommInsight code and is started unchanged: the
hook reaches it through the ``.pth`` file alone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from comminsight.evidence.process_groups import load_tables

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
COMMINSIGHT = Path(sys.executable).parent / "comminsight"
TORCH_SITE = Path(torch.__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_venv(root: Path, python: str = sys.executable, with_torch: bool = True) -> Path:
    subprocess.run([python, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = next(root.glob("lib/python3*/site-packages"))
    if with_torch:  # the workload's own dependencies (torch), as a path entry: not part of what we install
        (site / "workload_dependencies.pth").write_text(f"{TORCH_SITE}\n")
    return root / "bin" / "python"


def snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in sorted(root.rglob("*"))}


def inject(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(COMMINSIGHT), "inject", *args], capture_output=True, text=True, timeout=300, **kwargs)


@pytest.mark.slow
def test_an_installed_hook_names_the_groups_of_an_unmodified_torchrun_job_and_uninstall_restores_the_venv(tmp_path):
    python = make_venv(tmp_path / "venv")
    before = snapshot(tmp_path / "venv")
    installed = inject("install", "--python", str(python))
    assert installed.returncode == 0, installed.stderr
    status = json.loads(inject("status", "--python", str(python), "--json").stdout)
    assert (status["installed"], status["environment"], status["torch"]) == (True, "venv", torch.__version__)
    assert status["level"] == 2  # this PyTorch has no NCCL config binding with comm_name

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(COMMINSIGHT_HOME=str(home), OMP_NUM_THREADS="1")
    job = subprocess.run(
        [
            str(python),
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--master-port",
            str(free_port()),
            str(REPO / "scripts/inject_job.py"),
            "--backend",
            "gloo",
            "--tp",
            "2",
            "--pp",
            "2",
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert job.stdout.count("TRAINING-OK") == 4, job.stderr[-3000:]
    tables = {t["rank"]: t for t in load_tables(home)}
    assert sorted(tables) == [0, 1, 2, 3]
    groups = {(g["desc"], tuple(g["ranks"])) for t in tables.values() for g in t["groups"]}
    # rank = stage * (dp * tp) + dp_index * tp + tp_index, with tp = pp = 2 and dp = 1
    assert groups == {
        ("default_pg", (0, 1, 2, 3)),
        ("TENSOR_MODEL_PARALLEL_GROUP", (0, 1)),
        ("TENSOR_MODEL_PARALLEL_GROUP", (2, 3)),
        ("PIPELINE_MODEL_PARALLEL_GROUP", (0, 2)),
        ("PIPELINE_MODEL_PARALLEL_GROUP", (1, 3)),
        *(("DATA_PARALLEL_GROUP", (r,)) for r in range(4)),
    }
    assert {t["level"] for t in tables.values()} == {2}

    removed = inject("uninstall", "--python", str(python))
    assert removed.returncode == 0, removed.stderr
    assert snapshot(tmp_path / "venv") == before
    assert subprocess.run([str(python), "-c", "import comminsight_inject"], capture_output=True).returncode != 0


def test_a_read_only_environment_is_refused_and_nothing_is_written():
    root = Path(tempfile.mkdtemp(prefix="ci-readonly-", dir="/tmp"))
    try:
        root.chmod(0o755)
        as_root = os.geteuid() == 0
        if as_root and not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot act as an ordinary user")
        # as root, act as nobody (root writes through any mode); nobody needs an interpreter it can read
        python = make_venv(root / "venv", "/usr/bin/python3" if as_root else sys.executable, with_torch=False)
        site = next((root / "venv").glob("lib/python3*/site-packages"))
        site.chmod(0o555)
        before = snapshot(root / "venv")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_root else []
        interpreter = "/usr/bin/python3" if as_root else sys.executable
        out = subprocess.run(
            [*prefix, interpreter, "-m", "comminsight_inject", "install", "--python", str(python)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/tmp",
            env={**os.environ, "PYTHONPATH": str(REPO / "inject"), "HOME": "/tmp"},
        )
        assert out.returncode == 2
        assert "not writable" in out.stderr
        assert str(site) in out.stderr
        assert snapshot(root / "venv") == before
    finally:
        for path in root.rglob("*"):
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)


def test_the_inject_wheel_needs_nothing_beyond_the_standard_library(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(REPO / "inject"),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("comminsight_inject-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert {"comminsight_inject/hook.py", "comminsight_inject/autoload.py"} <= set(names)
    assert "Requires-Dist" not in metadata
