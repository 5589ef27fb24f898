"""Configuration: env > conf file > defaults, bad values warn and fall back, identity rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from comminsight.agent.config import AgentConfig, load_config
from comminsight.cli import app


def write_conf(home: Path, text: str | bytes) -> None:
    (home / "etc").mkdir(parents=True, exist_ok=True)
    path = home / "etc" / "comminsight.conf"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def test_environment_beats_conf_file_beats_defaults(tmp_path: Path) -> None:
    write_conf(tmp_path, "archive_interval = 30\nCOMMINSIGHT_AGENT_LISTEN = 0.0.0.0:9000\n# comment\n")
    config = load_config(env={"COMMINSIGHT_ARCHIVE_INTERVAL": "5"}, home=tmp_path)
    assert config.archive_interval == 5.0
    assert config.sources["archive_interval"] == "env"
    assert config.listen == "0.0.0.0:9000"
    assert config.sources["listen"].startswith("file")
    assert config.poll_interval == AgentConfig().poll_interval
    assert "poll_interval" not in config.sources


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("COMMINSIGHT_ARCHIVE_INTERVAL", "-1"),
        ("COMMINSIGHT_ARCHIVE_INTERVAL", "nan"),
        ("COMMINSIGHT_AGENT_LISTEN", "no-port"),
        ("COMMINSIGHT_AGENT_MODE", "boss"),
        ("COMMINSIGHT_AGENT_SERVER_URL", "ftp://site"),
        ("COMMINSIGHT_AGENT_SPOOL_MAX_BYTES", "lots"),
        ("COMMINSIGHT_AGENT_BATCH_RECORDS", "0"),
    ],
)
def test_bad_value_warns_once_and_keeps_the_default(tmp_path: Path, key: str, value: str) -> None:
    config = load_config(env={key: value}, home=tmp_path)
    default = load_config(env={}, home=tmp_path)
    matching = [w for w in config.warnings if key in w]
    assert len(matching) == 1
    assert "using the default" in matching[0]
    assert config.describe() == default.describe() or config == default


def test_token_value_never_appears_in_warnings_or_description(tmp_path: Path) -> None:
    config = load_config(env={"COMMINSIGHT_AGENT_TOKEN": "s3cret"}, home=tmp_path)
    assert "s3cret" not in str(config.describe())
    assert ("COMMINSIGHT_AGENT_TOKEN", "****", "env", "Agent token for the site") in config.describe()


def test_conf_file_garbage_and_unknown_keys_give_warnings_not_errors(tmp_path: Path) -> None:
    write_conf(tmp_path, b"\xff\xfe not a line\nfoo_bar = 1\nagent_mode = slave\n")
    config = load_config(env={}, home=tmp_path)
    assert any("not a 'key = value' line" in w for w in config.warnings)
    assert any("unknown key COMMINSIGHT_FOO_BAR" in w for w in config.warnings)
    # slave without a master URL cannot work: it says so and runs as master
    assert config.mode == "master"
    assert any("without COMMINSIGHT_AGENT_MASTER_URL" in w for w in config.warnings)


def test_oversized_conf_file_is_ignored_with_a_warning(tmp_path: Path) -> None:
    write_conf(tmp_path, "archive_interval = 5\n" + "#" * (2 << 20))
    config = load_config(env={}, home=tmp_path)
    assert config.archive_interval == 60.0
    assert any("larger than" in w for w in config.warnings)


def test_workload_comes_from_the_launcher_when_not_set(tmp_path: Path) -> None:
    assert load_config(env={"SLURM_JOB_ID": "4242"}, home=tmp_path).workload_id == "4242"
    assert load_config(env={"TORCHELASTIC_RUN_ID": "te-1"}, home=tmp_path).workload_id == "te-1"
    both = load_config(env={"SLURM_JOB_ID": "4242", "COMMINSIGHT_WORKLOAD_ID": "mine"}, home=tmp_path)
    assert both.workload_id == "mine"


def test_node_is_node_ip_never_pod_ip(tmp_path: Path) -> None:
    config = load_config(env={"POD_IP": "172.16.0.9", "POD_NAME": "trainer-0", "HOST_IP": "10.1.1.1"}, home=tmp_path)
    assert config.node == "10.1.1.1"
    config = load_config(env={"POD_IP": "172.16.0.9", "NODE_IP": "10.2.2.2", "HOST_IP": "10.1.1.1"}, home=tmp_path)
    assert config.node == "10.2.2.2"
    config = load_config(env={"POD_IP": "172.16.0.9"}, home=tmp_path)
    assert config.node != "172.16.0.9"


def test_providers_default_to_filesystem_plus_site_when_a_server_is_set(tmp_path: Path) -> None:
    assert load_config(env={}, home=tmp_path).effective_providers == ("filesystem",)
    with_site = load_config(env={"COMMINSIGHT_AGENT_SERVER_URL": "http://site:8000/"}, home=tmp_path)
    assert with_site.effective_providers == ("filesystem", "site")
    assert with_site.server_url == "http://site:8000"
    explicit = load_config(env={"COMMINSIGHT_COMMON_ARCHIVE_TYPE": "site"}, home=tmp_path)
    assert explicit.effective_providers == ("site",)


def test_archive_root_follows_the_common_mount_path(tmp_path: Path) -> None:
    config = load_config(env={"COMMINSIGHT_COMMON_ARCHIVE_MOUNT_PATH": "/mnt/shared"}, home=tmp_path)
    assert config.archive_root == Path("/mnt/shared/comminsight/02_archives")


def test_without_a_mount_path_archives_go_under_the_home_in_the_shared_layout(tmp_path: Path) -> None:
    config = load_config(env={}, home=tmp_path)
    assert config.archive_root == tmp_path / "comminsight" / "02_archives"


def test_the_seeds_3fs_provider_name_means_the_shared_filesystem(tmp_path: Path) -> None:
    config = load_config(env={"COMMINSIGHT_COMMON_ARCHIVE_TYPE": "3fs,site"}, home=tmp_path)
    assert config.effective_providers == ("filesystem", "site")
    assert config.warnings == ()


def test_a_server_url_without_a_token_is_reported_at_start(tmp_path: Path) -> None:
    config = load_config(env={"COMMINSIGHT_AGENT_SERVER_URL": "http://site:8000"}, home=tmp_path)
    assert any("COMMINSIGHT_AGENT_TOKEN is not" in warning for warning in config.warnings)
    with_token = load_config(
        env={"COMMINSIGHT_AGENT_SERVER_URL": "http://site:8000", "COMMINSIGHT_AGENT_TOKEN": "ci_x"}, home=tmp_path
    )
    assert with_token.warnings == ()


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load_config(env={}, home=tmp_path)
    with pytest.raises(AttributeError):
        config.listen = "x"  # type: ignore[misc]


def test_agent_config_command_prints_values_and_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_conf(tmp_path, "archive_interval = 30\n")
    monkeypatch.setenv("COMMINSIGHT_AGENT_LISTEN", "127.0.0.1:19999")
    result = CliRunner().invoke(app, ["agent", "config", "--home", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert '"COMMINSIGHT_ARCHIVE_INTERVAL": {\n  "value": "30.0",\n  "source": "file' in result.output
    assert '"value": "127.0.0.1:19999",\n  "source": "env"' in result.output
