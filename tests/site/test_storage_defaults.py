"""An agent and the site on one machine, both on their defaults, meet in one archive directory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from apps.workloads.discovery import discovery_root, discovery_scan
from apps.workloads.models import SystemSettings
from comminsight.agent.config import DEFAULT_HOME, load_config
from comminsight.agent.providers import FilesystemProvider, SpoolEntry
from tests.site.archives import valid_archive

ROOT = Path(__file__).resolve().parents[2]


def test_the_sites_default_archive_path_is_the_agents_default_home(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMINSIGHT_", "DJANGO_"))}
    env["COMMINSIGHT_SERVER_DATA_DIR"] = str(tmp_path)
    shown = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "shell",
            "-c",
            "from django.conf import settings; print(settings.DEFAULT_ARCHIVE_PATH)",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip().splitlines()[-1] == DEFAULT_HOME
    assert load_config(env={}).archive_root == Path(DEFAULT_HOME) / "comminsight" / "02_archives"


def test_an_archive_the_agent_wrote_on_defaults_is_discovered_without_configuration(personas, settings, tmp_path):
    home = tmp_path / "home"
    settings.DEFAULT_ARCHIVE_PATH = str(home)  # what COMMINSIGHT_HOME=<home> gives both sides
    config = load_config(env={"COMMINSIGHT_WORKLOAD_ID": "job-7"}, home=home)
    assert discovery_root(SystemSettings.load()) == config.archive_root
    path = valid_archive(tmp_path)
    data = path.read_bytes()
    entry = SpoolEntry(
        path=path, sha256=hashlib.sha256(data).hexdigest(), size=len(data), created_ns=0, workload_id="job-7", node="n1"
    )
    FilesystemProvider(config.archive_root, config.workload_id, config.node).deliver(entry)
    scan = discovery_scan()
    assert scan.problem == ""
    assert [p.name for p in scan.queued] == [path.name]
