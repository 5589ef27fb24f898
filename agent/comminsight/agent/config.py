"""The agent's configuration: parsed once, at start, into a frozen typed ``AgentConfig``.

Precedence (DESIGN §3): environment ``COMMINSIGHT_*`` > ``<home>/etc/comminsight.conf`` (plain
``key = value`` lines; ``#`` comments; keys with or without the ``COMMINSIGHT_`` prefix, any case) >
built-in defaults. A bad value gives one warning and the default; an unknown key in the file gives one
warning. Nothing here reads the environment after ``load_config`` returns, and the environment and
the home are parameters, so tests build configurations without touching the process.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_HOME = "/opt/comminsight"
CONF_RELATIVE = Path("etc/comminsight.conf")
# A conf file larger than this is not a configuration file; refuse it rather than read it.
MAX_CONF_BYTES = 1 << 20

# Launcher variables that identify a job identically on every node, in order of preference.
WORKLOAD_ENV_VARS = (
    "SLURM_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "LSB_JOBID",
    "PBS_JOBID",
    "JOB_ID",
    "KUBEFLOW_JOB_NAME",
    "PET_RDZV_ID",
    "MLP_TASK_ID",
)


# Keys of the shared conf file that the profiler reads (native/profiler/src/config.c); not unknown to us.
PROFILER_KEYS = frozenset(
    f"COMMINSIGHT_{k.upper()}"
    for k in (
        "pool_size",
        "ring_capacity",
        "log_segment_bytes",
        "log_segment_age_s",
        "hang_timeout_s",
        "writer_interval_ms",
        "agent_autostart",
        "ring_enable",
        "log_enable",
        "clock",
    )
)


class ConfigError(ValueError):
    """A value that cannot be parsed (the caller warns and keeps the default)."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError("must be a positive number")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ConfigError("must be a number >= 0")
    return value


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError("must be true or false (1/0, yes/no, on/off)")


def _positive_int(text: str) -> int:
    value = int(text.replace("_", ""), 0)
    if value <= 0:
        raise ConfigError("must be a positive integer")
    return value


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if not match:
        raise ConfigError("must be a size such as 1048576, 512M or 4G")
    value = int(match.group(1)) * 1024 ** " KMGT".index(match.group(2).upper() or " ")
    if value <= 0:
        raise ConfigError("must be positive")
    return value


def _listen(text: str) -> str:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError("must be HOST:PORT")
    return f"{host}:{int(port)}"


def _url(text: str) -> str:
    text = text.strip()
    if not text:
        return ""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError("must be an http(s) URL")
    return text.rstrip("/")


def _mode(text: str) -> str:
    value = text.strip().lower()
    if value not in ("master", "slave"):
        raise ConfigError("must be master or slave")
    return value


def _threshold(text: str) -> float:
    """Hang threshold: ``auto`` (0.0: adaptive) or seconds."""
    if text.strip().lower() in ("auto", "adaptive", ""):
        return 0.0
    return _positive_float(text)


# The seed's name for the shared-filesystem provider (a 3FS mount is one such filesystem).
PROVIDER_ALIASES = {"3fs": "filesystem"}


def _providers(text: str) -> tuple[str, ...]:
    names = tuple(name.strip().lower() for name in text.split(",") if name.strip())
    names = tuple(PROVIDER_ALIASES.get(name, name) for name in names)
    if not names or any(not re.fullmatch(r"[a-z0-9_.-]{1,64}", name) for name in names):
        raise ConfigError("must be 'auto' or a comma-separated list of provider names")
    return names


def _log_level(text: str) -> str:
    value = text.strip().upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError("must be DEBUG, INFO, WARNING or ERROR")
    return value


def _text(text: str) -> str:
    return text.strip()


def _opt(env: str, parse: Callable[[str], Any], doc: str, secret: bool = False) -> Any:
    return {"env": env, "parse": parse, "doc": doc, "secret": secret}


@dataclass(frozen=True)
class AgentConfig:
    """Effective agent configuration. ``sources`` says where each value came from."""

    home: Path = field(default=Path(DEFAULT_HOME), metadata=_opt("COMMINSIGHT_HOME", Path, "Runtime home"))
    listen: str = field(
        default="127.0.0.1:19102",
        metadata=_opt("COMMINSIGHT_AGENT_LISTEN", _listen, "HTTP listen address (healthz, metrics, API)"),
    )
    poll_interval: float = field(
        default=0.2, metadata=_opt("COMMINSIGHT_AGENT_POLL_INTERVAL", _positive_float, "Seconds between ring polls")
    )
    checkpoint_interval: float = field(
        default=1.0,
        metadata=_opt("COMMINSIGHT_AGENT_CHECKPOINT_INTERVAL", _positive_float, "Seconds between offset checkpoints"),
    )
    batch_records: int = field(
        default=65536, metadata=_opt("COMMINSIGHT_AGENT_BATCH_RECORDS", _positive_int, "Records per ring read")
    )
    archive_interval: float = field(
        default=60.0,
        metadata=_opt("COMMINSIGHT_ARCHIVE_INTERVAL", _positive_float, "Seconds between archive seals"),
    )
    orphan_grace: float = field(
        default=5.0,
        metadata=_opt(
            "COMMINSIGHT_AGENT_ORPHAN_GRACE",
            _non_negative_float,
            "Seconds an unsealed segment of a dead writer stays untouched before the agent seals it",
        ),
    )
    hang_threshold: float = field(
        default=0.0,
        metadata=_opt("COMMINSIGHT_AGENT_HANG_THRESHOLD", _threshold, "Hang threshold in seconds, or auto"),
    )
    hang_floor: float = field(
        default=10.0,
        metadata=_opt("COMMINSIGHT_AGENT_HANG_FLOOR", _positive_float, "Smallest adaptive hang threshold (s)"),
    )
    hang_factor: float = field(
        default=20.0,
        metadata=_opt(
            "COMMINSIGHT_AGENT_HANG_FACTOR",
            _positive_float,
            "Adaptive threshold = factor x the op's normal enqueue-to-completion time",
        ),
    )
    hang_cold: float = field(
        default=60.0,
        metadata=_opt(
            "COMMINSIGHT_AGENT_HANG_COLD",
            _positive_float,
            "Threshold (s) for an op with no completed history on its communicator yet",
        ),
    )
    sample_interval: float = field(
        default=5.0,
        metadata=_opt(
            "COMMINSIGHT_AGENT_SAMPLE_INTERVAL",
            _non_negative_float,
            "Seconds between GPU (NVML) and NIC (sysfs) counter samples; 0 = off",
        ),
    )
    sysfs_root: Path = field(
        default=Path("/sys"),
        metadata=_opt("COMMINSIGHT_AGENT_SYSFS_ROOT", Path, "Root of sysfs (InfiniBand/RoCE port counters)"),
    )
    steps_enabled: bool = field(
        default=True,
        metadata=_opt("COMMINSIGHT_AGENT_STEPS", _bool, "Run the semantic engine live (per-GPU Step summaries)"),
    )
    archive_mount_path: str = field(
        default="",
        metadata=_opt(
            "COMMINSIGHT_COMMON_ARCHIVE_MOUNT_PATH", _text, "Shared path; archives go to <it>/comminsight/02_archives/"
        ),
    )
    archive_providers: tuple[str, ...] = field(
        default=("auto",),
        metadata=_opt(
            "COMMINSIGHT_COMMON_ARCHIVE_TYPE",
            _providers,
            "Archive providers: auto (filesystem, plus site when a server URL is set) or a list",
        ),
    )
    server_url: str = field(
        default="", metadata=_opt("COMMINSIGHT_AGENT_SERVER_URL", _url, "Site base URL for uploads and live reports")
    )
    token: str = field(
        default="", metadata=_opt("COMMINSIGHT_AGENT_TOKEN", _text, "Agent token for the site", secret=True)
    )
    spool_max_bytes: int = field(
        default=4 << 30, metadata=_opt("COMMINSIGHT_AGENT_SPOOL_MAX_BYTES", _size, "Spool size cap")
    )
    spool_max_age: float = field(
        default=7 * 86400.0,
        metadata=_opt("COMMINSIGHT_AGENT_SPOOL_MAX_AGE", _positive_float, "Spool age cap (seconds)"),
    )
    upload_chunk_bytes: int = field(
        default=8 << 20, metadata=_opt("COMMINSIGHT_AGENT_UPLOAD_CHUNK", _size, "Upload chunk size")
    )
    upload_timeout: float = field(
        default=30.0, metadata=_opt("COMMINSIGHT_AGENT_UPLOAD_TIMEOUT", _positive_float, "HTTP timeout (s)")
    )
    backoff_initial: float = field(
        default=1.0, metadata=_opt("COMMINSIGHT_AGENT_BACKOFF_INITIAL", _positive_float, "First retry delay (s)")
    )
    backoff_max: float = field(
        default=300.0, metadata=_opt("COMMINSIGHT_AGENT_BACKOFF_MAX", _positive_float, "Longest retry delay (s)")
    )
    mode: str = field(default="master", metadata=_opt("COMMINSIGHT_AGENT_MODE", _mode, "master or slave"))
    master_url: str = field(
        default="", metadata=_opt("COMMINSIGHT_AGENT_MASTER_URL", _url, "Master agent URL (slave mode)")
    )
    advertise_url: str = field(
        default="", metadata=_opt("COMMINSIGHT_AGENT_ADVERTISE_URL", _url, "This agent's URL as others reach it")
    )
    live_interval: float = field(
        default=5.0,
        metadata=_opt("COMMINSIGHT_AGENT_LIVE_INTERVAL", _positive_float, "Seconds between live progress reports"),
    )
    workload_id: str = field(
        default="", metadata=_opt("COMMINSIGHT_WORKLOAD_ID", _text, "Workload id (else from the launcher)")
    )
    log_level: str = field(default="INFO", metadata=_opt("COMMINSIGHT_AGENT_LOG_LEVEL", _log_level, "Log level"))
    # Derived, not configurable by key: node identity and host name.
    node: str = ""
    node_ip: str = ""
    host: str = ""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    warnings: tuple[str, ...] = ()

    # Paths under the home (injectable as a whole by pointing ``home`` at a temp dir).
    @property
    def shms_dir(self) -> Path:
        return self.home / "shms"

    @property
    def logs_dir(self) -> Path:
        return self.home / "inspector_logs"

    @property
    def hang_dir(self) -> Path:
        return self.home / "hang_detection"

    @property
    def spool_dir(self) -> Path:
        return self.home / "spool"

    @property
    def state_dir(self) -> Path:
        return self.home / "metadata" / "agent"

    @property
    def steps_dir(self) -> Path:
        return self.home / "semantics" / "step"

    @property
    def lock_path(self) -> Path:
        # The profiler's autostart takes the same lock (native/profiler/src/autostart.c).
        return self.home / "agent.lock"

    @property
    def archive_root(self) -> Path:
        """Where the filesystem provider writes: <mount>/comminsight/02_archives, the home standing in for an
        unset mount — the site's discovery looks there by default (COMMINSIGHT_SERVER_ARCHIVE_PATH)."""
        return Path(self.archive_mount_path or self.home) / "comminsight" / "02_archives"

    @property
    def listen_host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def effective_providers(self) -> tuple[str, ...]:
        if self.archive_providers == ("auto",):
            return ("filesystem", "site") if self.server_url else ("filesystem",)
        return self.archive_providers

    def describe(self) -> list[tuple[str, str, str, str]]:
        """(env name, value as text, source, doc) for every key; secrets are masked."""
        rows = []
        for f in fields(self):
            if "env" not in f.metadata:
                continue
            value = getattr(self, f.name)
            text = ",".join(value) if isinstance(value, tuple) else str(value)
            if f.metadata["secret"] and text:
                text = "****"
            if f.name == "hang_threshold" and value == 0.0:
                text = "auto"
            rows.append((f.metadata["env"], text, self.sources.get(f.name, "default"), f.metadata["doc"]))
        for name in ("node", "node_ip", "host"):
            rows.append((name, getattr(self, name), self.sources.get(name, "derived"), "derived"))
        return rows


_KEYS = {f.metadata["env"]: f for f in fields(AgentConfig) if "env" in f.metadata}


def _normalise_key(key: str) -> str:
    key = key.strip().upper().replace("-", "_")
    return key if key.startswith("COMMINSIGHT_") else f"COMMINSIGHT_{key}"


def read_conf_file(path: Path) -> tuple[dict[str, str], list[str]]:
    """``key = value`` pairs of a conf file (keys normalised to COMMINSIGHT_*), and warnings."""
    warnings: list[str] = []
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONF_BYTES + 1)
    except FileNotFoundError:
        return {}, []
    except OSError as exc:
        return {}, [f"{path}: cannot read ({exc.strerror}); using environment and defaults"]
    if len(raw) > MAX_CONF_BYTES:
        return {}, [f"{path}: larger than {MAX_CONF_BYTES} bytes, ignored"]
    text = raw.decode("utf-8", errors="replace")
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            warnings.append(f"{path}:{number}: not a 'key = value' line, ignored")
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[_normalise_key(key)] = value
    return values, warnings


def workload_from_env(env: Mapping[str, str]) -> tuple[str, str]:
    """(workload id, source variable) from COMMINSIGHT_WORKLOAD_ID or a launcher variable."""
    for name in ("COMMINSIGHT_WORKLOAD_ID", *WORKLOAD_ENV_VARS):
        value = env.get(name, "").strip()
        if value:
            return value, name
    return "", ""


def load_config(env: Mapping[str, str] | None = None, home: Path | str | None = None) -> AgentConfig:
    """Build the effective configuration from ``env`` (default ``os.environ``) and the home's conf file."""
    env = dict(os.environ if env is None else env)
    warnings: list[str] = []
    sources: dict[str, str] = {}
    values: dict[str, Any] = {}

    home_text = str(home) if home is not None else env.get("COMMINSIGHT_HOME", "").strip() or DEFAULT_HOME
    values["home"] = Path(home_text)
    sources["home"] = "argument" if home is not None else ("env" if env.get("COMMINSIGHT_HOME") else "default")
    conf_path = values["home"] / CONF_RELATIVE
    conf, conf_warnings = read_conf_file(conf_path)
    warnings += conf_warnings
    for key in conf:
        if key not in _KEYS and key not in PROFILER_KEYS:
            warnings.append(f"{conf_path}: unknown key {key} ignored by the agent")

    for env_name, f in _KEYS.items():
        if f.name == "home":
            continue
        for origin, table in (("env", env), (f"file {conf_path}", conf)):
            if env_name not in table:
                continue
            raw = table[env_name]
            try:
                values[f.name] = f.metadata["parse"](raw)
                sources[f.name] = origin
            except (ValueError, ConfigError) as exc:
                shown = "****" if f.metadata["secret"] else repr(raw)
                warnings.append(f"{env_name}={shown} from {origin}: {exc}; using the default")
                continue
            break

    if "workload_id" not in values:
        workload, origin = workload_from_env(env)
        if workload:
            values["workload_id"] = workload
            sources["workload_id"] = f"env {origin}"
    # The node is the host's address (NODE_IP/HOST_IP), never the pod's (POD_IP/POD_NAME).
    node_ip = env.get("NODE_IP", "").strip() or env.get("HOST_IP", "").strip()
    host = socket.gethostname()
    values["node_ip"] = node_ip
    values["host"] = host
    values["node"] = node_ip or host
    sources["node"] = "env NODE_IP" if env.get("NODE_IP", "").strip() else "env HOST_IP" if node_ip else "host name"
    if values.get("server_url") and not values.get("token"):
        warnings.append(
            "COMMINSIGHT_AGENT_SERVER_URL is set but COMMINSIGHT_AGENT_TOKEN is not: the site will refuse uploads"
            " and live reports (401); create an agent token on the site's Agent tokens page"
        )
    if values.get("mode") == "slave" and not values.get("master_url"):
        warnings.append("COMMINSIGHT_AGENT_MODE=slave without COMMINSIGHT_AGENT_MASTER_URL: running as master")
        values["mode"] = "master"
        sources["mode"] = "default (no master URL)"
    return AgentConfig(**values, sources=sources, warnings=tuple(warnings))
