"""``python -m comminsight_inject install|status|uninstall [--python PATH]`` (also ``comminsight inject ...``)."""

from __future__ import annotations

import argparse
import json
import sys

from comminsight_inject import installer

LEVELS = {
    1: "1 (NCCL receives '<group_desc>:<group_name>' as commName)",
    2: "2 (process-group table in <home>/metadata/, joined by the agent)",
    3: "3 (names unavailable)",
}


def describe_status(facts: dict) -> str:
    lines = [f"python:      {facts['python']} ({facts['python_version']}, {facts['environment']})"]
    if facts["installed"]:
        lines.append(f"installed:   yes, {facts['pth']}")
    else:
        lines.append(f"installed:   no (would go to {facts['site_dir']})")
    lines.append(f"torch:       {facts['torch'] or 'not importable'}")
    level = facts["level"]
    lines.append(f"level:       {LEVELS.get(level, level)}")
    lines.append(f"why:         {facts['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="comminsight-inject", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("install", "put the .pth file and the hook into the environment of --python"),
        ("status", "where the hook is installed and which naming level applies"),
        ("uninstall", "remove exactly what install put there"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--python", default=None, help="the workload's interpreter (default: this one)")
        if name == "status":
            command.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            target, installed = installer.install(args.python)
            print(f"installed into {target.site_dir} ({target.kind} of {target.executable}):")
            for path in installed.files:
                print(f"  {path}")
        elif args.command == "uninstall":
            target, removed = installer.uninstall(args.python)
            if not removed:
                print(f"nothing to remove: not installed in {target.site_dir}")
            for path in removed:
                print(f"removed {path}")
        else:
            facts = installer.status(args.python)
            print(json.dumps(facts, indent=1) if args.json else describe_status(facts))
    except installer.InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
