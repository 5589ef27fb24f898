"""The commented ``etc/comminsight.conf`` that ``make install-node`` ships lists every key with its default."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from comminsight.agent.config import AgentConfig, load_config

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_conf_names_every_key_and_uncommented_changes_nothing(tmp_path):
    text = subprocess.run(
        [sys.executable, str(REPO / "scripts/node_conf.py")], capture_output=True, text=True, check=True
    ).stdout
    assert all(not line or line.startswith("#") for line in text.splitlines())  # as shipped it sets nothing
    keys = dict(re.findall(r"^# (\w+) = (.*)$", text, flags=re.MULTILINE))
    profiler_keys = re.findall(r'\{"(\w+)", K_', (REPO / "native/profiler/src/config.c").read_text())
    assert set(profiler_keys) <= set(keys)
    agent_keys = {
        f.metadata["env"].removeprefix("COMMINSIGHT_").lower()
        for f in fields(AgentConfig)
        if "env" in f.metadata and f.metadata["env"] != "COMMINSIGHT_HOME"
    }
    assert agent_keys <= set(keys)

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/comminsight.conf").write_text("".join(f"{k} = {v}\n" for k, v in keys.items()))
    config = load_config(env={}, home=tmp_path)
    assert config.warnings == ()
    defaults = load_config(env={}, home=tmp_path / "no-conf")
    assert [row[1] for row in config.describe()][1:] == [row[1] for row in defaults.describe()][1:]  # all but the home
