"""Print a commented ``<home>/etc/comminsight.conf`` listing every key of the profiler and the agent.

Every line is commented out, so the file changes nothing until a key is uncommented; the defaults
shown are the built-in ones. Profiler keys come from the plugin's own key table
(native/profiler/src/config.c) with their meaning from docs/profiler.md; agent keys from
``comminsight.agent.config.AgentConfig``. ``make install-node`` writes it when the home has none.

    python scripts/node_conf.py > /opt/comminsight/etc/comminsight.conf
"""

from __future__ import annotations

import re
from pathlib import Path

from comminsight.agent.config import AgentConfig

REPO = Path(__file__).resolve().parent.parent
_KEY = re.compile(r'\{"(\w+)", K_(\w+), [^,]+, [^,]+, ([^,]+), OFF')
_DOC = re.compile(r"^\| `([\w`, ]+)` \| ([^|]*) \| ([^|]*) \|$")


def profiler_keys() -> list[tuple[str, str, str]]:
    docs: dict[str, tuple[str, str]] = {}
    for line in (REPO / "docs/profiler.md").read_text().splitlines():
        match = _DOC.match(line.strip())
        if match:
            for key in re.findall(r"\w+", match.group(1)):
                docs[key] = (match.group(2).strip(), match.group(3).strip())
    keys = []
    for name, kind, default in _KEY.findall((REPO / "native/profiler/src/config.c").read_text()):
        shown, meaning = docs.get(name, ("", ""))
        if kind == "STR":
            value = ""  # empty: the default is derived (see the comment)
        elif kind == "CHOICE" or not shown:
            value = shown or ""
        else:
            value = re.sub(r"[^0-9]", "", default) if kind != "BOOL" else default
            value = shown if shown.isdigit() else value
        keys.append((name, value, meaning))
    return keys


def main() -> None:
    lines = [
        "# CommInsight node configuration: read by the profiler plugin and by the agent.",
        "# Precedence: environment COMMINSIGHT_<KEY> > this file > built-in defaults (shown below).",
        "# Uncomment a line to change it. A bad value gives one warning and the default.",
        "",
        "# ---- profiler plugin (docs/profiler.md) ----",
    ]
    for name, value, meaning in profiler_keys():
        lines += [f"# {meaning}" if meaning else "#", f"# {name} = {value}", ""]
    lines.append("# ---- agent (docs/agent.md) ----")
    shared = {name for name, _, _ in profiler_keys()}
    for env, value, _, doc in AgentConfig().describe():
        key = env.removeprefix("COMMINSIGHT_").lower()
        if not env.startswith("COMMINSIGHT_") or env == "COMMINSIGHT_HOME" or key in shared:
            continue  # derived values; the home is where this file lives; keys both read are listed once
        lines += [f"# {doc}", f"# {key} = {value}", ""]
    print("\n".join(lines).rstrip())


if __name__ == "__main__":
    main()
