"""Install, inspect and remove the hook in a workload's Python environment (a venv or a user site).

``install(python)`` asks the target interpreter where its packages live: a virtual environment's
``purelib``, else the user site (``python -m site --user-site``). There it writes

* ``comminsight_inject/`` — a copy of this package, unless the interpreter already imports one
  (the wheel installed with pip);
* ``comminsight_inject.pth`` — one ``import comminsight_inject.autoload`` line, so every later
  process of that environment (``python``, ``torchrun`` and the workers it starts) loads the hook;
* ``comminsight_inject.installed.json`` — the record of exactly what was written, which
  ``uninstall`` removes (files, the byte-code Python compiled next to them, and the directories
  the install created), leaving the environment as it was.

A target that is not writable is refused before anything is written, with the directory named.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from comminsight_inject import __version__

PTH_NAME = "comminsight_inject.pth"
RECORD_NAME = "comminsight_inject.installed.json"
PACKAGE = "comminsight_inject"
PTH_LINE = "import comminsight_inject.autoload\n"
_PACKAGE_DIR = Path(__file__).resolve().parent
_MODULES = ("__init__.py", "__main__.py", "autoload.py", "hook.py", "installer.py")

# Run inside the target interpreter; prints where its packages go (venv purelib, else the user site).
_PROBE = r"""
import importlib.util, json, site, sys, sysconfig
venv = sys.prefix != sys.base_prefix
spec = importlib.util.find_spec("comminsight_inject")
print(json.dumps({
    "executable": sys.executable,
    "version": "%d.%d.%d" % sys.version_info[:3],
    "venv": venv,
    "purelib": sysconfig.get_paths()["purelib"],
    "user_site": site.getusersitepackages(),
    "user_site_enabled": bool(site.ENABLE_USER_SITE),
    "package": (spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None),
}))
"""

_LEVEL_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from comminsight_inject.hook import naming_level
try:
    import torch
    version = torch.__version__
except Exception as exc:
    version = None
level, why = naming_level()
print(json.dumps({"torch": version, "level": level, "reason": why}))
"""


class InstallError(RuntimeError):
    """The target cannot take the hook (not writable, user site disabled, not a Python); says why."""


@dataclass
class Target:
    python: str
    executable: str
    version: str
    kind: str  # "venv" or "user site"
    site_dir: Path
    package: str | None  # where the interpreter imports comminsight_inject from today, if anywhere

    @property
    def pth(self) -> Path:
        return self.site_dir / PTH_NAME

    @property
    def record(self) -> Path:
        return self.site_dir / RECORD_NAME


@dataclass
class Installed:
    target: dict[str, Any]
    files: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)  # created by the install, removed by uninstall when empty
    copied_package: bool = False
    version: str = __version__


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env["COMMINSIGHT_INJECT"] = "0"  # the probe must not load a hook installed earlier
    env.pop("PYTHONPATH", None)
    return env


def target_of(python: str | None = None) -> Target:
    """Where ``python`` (default: this interpreter) keeps its packages."""
    python = python or sys.executable
    try:
        out = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=60, env=_clean_env(), check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"{python}: cannot run it as a Python interpreter ({exc})") from exc
    if out.returncode != 0:
        raise InstallError(f"{python}: not a usable Python interpreter: {out.stderr.strip()[-400:]}")
    try:
        facts = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise InstallError(f"{python}: unexpected answer from the interpreter") from exc
    if facts["venv"]:
        kind, site_dir = "venv", Path(facts["purelib"])
    else:
        if not facts["user_site_enabled"]:
            raise InstallError(
                f"{python} is not in a virtual environment and its user site is disabled "
                "(PYTHONNOUSERSITE, -s or a different effective user): install into a venv instead"
            )
        kind, site_dir = "user site", Path(facts["user_site"])
    return Target(python, facts["executable"], facts["version"], kind, site_dir, facts["package"])


def _writable_or_refuse(directory: Path) -> None:
    """Refuse before writing anything when ``directory`` (or the parent it would be created in) is read-only."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise InstallError(
            f"{directory} is not writable by this user: nothing was installed "
            "(ask the environment's owner, or install into a venv or user site you own)"
        )


def _load_record(target: Target) -> Installed | None:
    try:
        data = json.loads(target.record.read_text())
        return Installed(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise InstallError(f"{target.record}: unreadable install record ({exc}); remove it by hand") from exc


def install(python: str | None = None) -> tuple[Target, Installed]:
    """Install the hook into ``python``'s environment (replacing an earlier install by this tool)."""
    target = target_of(python)
    _writable_or_refuse(target.site_dir)
    if _load_record(target) is not None:
        uninstall(python)
        target = target_of(python)
    installed = Installed(target={"python": target.executable, "kind": target.kind, "site_dir": str(target.site_dir)})
    try:
        missing = []
        probe = target.site_dir
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        for directory in reversed(missing):
            directory.mkdir()
            installed.dirs.append(str(directory))
        own_copy = target.package is None or Path(target.package).resolve() == (target.site_dir / PACKAGE).resolve()
        if own_copy:
            package_dir = target.site_dir / PACKAGE
            if package_dir.exists():
                raise InstallError(f"{package_dir} exists but was not installed by this tool: remove it first")
            package_dir.mkdir()
            installed.dirs.append(str(package_dir))
            installed.copied_package = True
            for module in _MODULES:
                shutil.copyfile(_PACKAGE_DIR / module, package_dir / module)
                installed.files.append(str(package_dir / module))
        target.pth.write_text(PTH_LINE)
        installed.files.append(str(target.pth))
        installed.files.append(str(target.record))
        target.record.write_text(json.dumps(asdict(installed), indent=1))
    except (OSError, InstallError) as exc:
        _remove(installed)
        if isinstance(exc, InstallError):
            raise
        raise InstallError(f"{target.site_dir}: install failed and was rolled back: {exc}") from exc
    return target, installed


def _remove(installed: Installed) -> list[str]:
    removed = []
    for name in installed.files:
        path = Path(name)
        if path.exists():
            path.unlink()
            removed.append(name)
        if path.suffix == ".py":  # the byte-code Python wrote for it
            cache = path.parent / "__pycache__"
            for compiled in cache.glob(f"{path.stem}.*.pyc") if cache.is_dir() else []:
                compiled.unlink()
                removed.append(str(compiled))
    for name in sorted(installed.dirs, key=len, reverse=True):
        path = Path(name)
        cache = path / "__pycache__"
        if cache.is_dir() and not any(cache.iterdir()):
            cache.rmdir()
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
            removed.append(name)
    return removed


def uninstall(python: str | None = None) -> tuple[Target, list[str]]:
    """Remove exactly what ``install`` wrote into ``python``'s environment; returns the paths removed."""
    target = target_of(python)
    installed = _load_record(target)
    if installed is None:
        return target, []
    _writable_or_refuse(target.site_dir)
    return target, _remove(installed)


def status(python: str | None = None) -> dict[str, Any]:
    """Where the hook is installed for ``python`` and which naming level applies to its PyTorch."""
    target = target_of(python)
    installed = _load_record(target)
    package_root = str(Path(target.package).parent) if target.package else str(_PACKAGE_DIR.parent)
    try:
        out = subprocess.run(
            [target.executable, "-c", _LEVEL_PROBE, package_root],
            capture_output=True,
            text=True,
            timeout=300,
            env=_clean_env(),
            check=False,
        )
        level = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        level = {"torch": None, "level": 3, "reason": "could not ask the interpreter which level applies"}
    return {
        "python": target.executable,
        "python_version": target.version,
        "environment": target.kind,
        "site_dir": str(target.site_dir),
        "installed": installed is not None and target.pth.exists(),
        "pth": str(target.pth) if target.pth.exists() else None,
        "package": target.package,
        "files": installed.files if installed else [],
        "torch": level.get("torch"),
        "level": level.get("level"),
        "reason": level.get("reason"),
    }
