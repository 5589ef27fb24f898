"""Peak memory and CPU of the straggler analysis against a baseline revision, at two trace lengths.

The traces are those of ``bench/straggler_speed.py`` (128 ranks, DP32 x PP2 x CP2, compute rows, backward of
stage 1 x1.4) at ``--steps`` (default 45 and 90), generated once into ``--cache``. The baseline is the
analysis at another git revision (``--baseline REV``): that revision's whole ``agent`` tree (``git archive``) is put
first on the child's path, so the baseline runs with its own replay and preparation. Each (implementation, trace)
runs in a fresh child process, which reads the trace, then
measures its peak resident memory growth over the analysis alone (``ru_maxrss``: numpy and polars allocate
outside tracemalloc's view) and its CPU seconds; the reports are compared in the same run (equal up to the
last bits of polars' float sums, which vary from run to run in the baseline alone).

    POLARS_MAX_THREADS=1 OPENBLAS_NUM_THREADS=1 taskset -c 1 .venv/bin/python bench/straggler_memory.py
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "2a8a220"  # main before the replay's windows were planned one at a time and spilled (issue 16)

CHILD = """
import json, resource, sys, time
path, tree = sys.argv[1], sys.argv[2]
if tree:
    sys.path.insert(0, tree)
import polars as pl
from comminsight.importers import load
from comminsight.analysis.stragglers import analyse_stragglers as analyse
table = pl.from_arrow(load(path))
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.process_time()
report = analyse(table).to_dict()
cpu = time.process_time() - t0
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"cpu": cpu, "peak_mib": (rss1 - rss0) / 1024, "rows": table.height, "report": report}))
"""


def close(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        assert isinstance(b, float)
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
    return a == b


def measure(path: Path, source: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), source], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[45, 90])
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the implementation to compare with")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from straggler_speed import trace

    baseline = Path(tempfile.mkdtemp())
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", args.baseline, "agent"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive.stdout, check=True)
    rows = []
    for steps in args.steps:
        path = trace(args.cache, steps)
        old = measure(path, str(baseline / "agent"))
        now = measure(path, "")
        same = close(old["report"], now["report"])
        rows.append((steps, old, now, same))
        print(
            f"128 ranks x {steps} steps ({old['rows']} rows): {args.baseline} {old['cpu']:.2f} s CPU, "
            f"+{old['peak_mib']:.0f} MiB; now {now['cpu']:.2f} s CPU, +{now['peak_mib']:.0f} MiB; "
            f"memory x{now['peak_mib'] / old['peak_mib']:.2f}, CPU x{now['cpu'] / old['cpu']:.2f}; "
            f"reports {'equal' if same else 'DIFFER'}",
            flush=True,
        )
    if len(rows) > 1:
        (s0, w0, v0, _), (s1, w1, v1, _) = rows[0], rows[-1]
        print(
            f"{s0} -> {s1} steps: {args.baseline} peak x{w1['peak_mib'] / w0['peak_mib']:.2f}, "
            f"now x{v1['peak_mib'] / v0['peak_mib']:.2f}; per added operation: {args.baseline} "
            f"{(w1['peak_mib'] - w0['peak_mib']) * 2**20 / (w1['rows'] - w0['rows']):.0f} bytes, now "
            f"{(v1['peak_mib'] - v0['peak_mib']) * 2**20 / (v1['rows'] - v0['rows']):.0f} bytes"
        )


if __name__ == "__main__":
    main()
