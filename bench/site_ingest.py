"""Site ingest on loopback: upload throughput, server memory and API latency under 50 agents, streaming vs buffering.

Starts the real site (`manage.py serve --workers N`, Daphne) twice on one temporary data directory, in the same
run: first as the baseline (COMMINSIGHT_SERVER_STREAM_BODIES=0: stock Daphne buffers each body, Django copies it,
the view writes it), then with bodies streamed to disk ahead of Django and upload create, HEAD and heartbeats
answered ahead of it (the default). Against each:
  - upload:  one resumable upload of --size-mib MiB in PATCH chunks of min(--chunk-mib, the site's max_chunk),
             as the agent sends them (checksums computed before the clock starts); MB/s, and the peak resident
             memory of the server workers (VmHWM summed over them);
  - latency: --clients closed-loop agents (threads, one HTTP connection each), each sending --rounds of
             heartbeat POST + upload HEAD + upload create (resume) + one PATCH chunk of --crowd-chunk-kib KiB
             (at most 8 MiB); p50/p99 over all requests and per kind.
Prints each figure for both servers and the ratio streaming / baseline, and the server workers' CPU time per GB
uploaded and per crowd request (PostgreSQL's not included): on a machine shared with other work, wall-clock
figures follow the neighbours' load, CPU time per unit of work much less.
Targets (DESIGN §9, issue 13): one agent >= 200 MB/s; p99 <= 100 ms with 50 agents, each request <= 8 MiB.

With --storage s3 the comparison is by storage instead (issue 12): the streamed server stores into the local
data directory, then into an S3 bucket (COMMINSIGHT_STORAGE_URL, multipart upload) on a real SeaweedFS started
for the run (the tests' tests/s3server.py), alternating; it prints the one-agent upload MB/s of each, the ratio
S3 / local and the server CPU per GB (the crowd is skipped).

Run: .venv/bin/python bench/site_ingest.py [--size-mib 256] [--chunk-mib 8] [--workers 2] [--clients 50]
     [--rounds 10] [--crowd-chunk-kib 256] [--alternations 2] [--storage s3]
Uses SQLite in the temporary data directory unless BENCH_DATABASE_URL is set (a database it may migrate).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manage(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def upload(client: httpx.Client, base: str, data: bytes, chunk: int) -> tuple[float, float, int]:
    """(seconds appending all chunks, seconds finalizing, chunk size used); create and checksums are excluded."""
    body = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "filename": "ci-bench-n1-0-1.tar.zst"}
    created = client.post(base + "uploads/", json=body).json()
    upload_id = created["upload_id"]
    chunk = min(chunk, int(created["max_chunk"]))  # the agent's rule (comminsight.agent.uploader)
    url = f"{base}uploads/{upload_id}/"
    view = memoryview(data)
    chunks = [
        (o, view[o : o + chunk], hashlib.sha256(view[o : o + chunk]).hexdigest()) for o in range(0, len(data), chunk)
    ]
    started = time.perf_counter()
    for offset, piece, digest in chunks:
        response = client.patch(
            url,
            content=bytes(piece),
            headers={
                "Content-Type": "application/offset+octet-stream",
                "Upload-Offset": str(offset),
                "Upload-Checksum": f"sha256 {digest}",
            },
        )
        response.raise_for_status()
    elapsed = time.perf_counter() - started
    started = time.perf_counter()
    client.post(url + "finalize/").raise_for_status()
    return elapsed, time.perf_counter() - started, chunk


def agent_rounds(
    base: str,
    token: str,
    rounds: int,
    workload: str,
    node: str,
    chunk_bytes: int,
    latencies: list,
    errors: list[str],
) -> None:
    """One closed-loop agent (one node of ``workload``): each round a heartbeat, an upload HEAD, a create
    (resume) and one chunk."""
    payload = os.urandom(chunk_bytes)
    chunk_headers = {"Content-Type": "application/offset+octet-stream"}
    chunk_headers["Upload-Checksum"] = f"sha256 {hashlib.sha256(payload).hexdigest()}"
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
        sha = hashlib.sha256(node.encode()).hexdigest()
        create = {"sha256": sha, "size": chunk_bytes * (rounds + 1), "filename": "ci-x.tar.zst"}
        upload_id = client.post(base + "uploads/", json=create).json()["upload_id"]
        url = f"{base}uploads/{upload_id}/"
        beat = {"workload_id": workload, "node": node, "sent_ns": 0, "communicators": []}
        offset = 0
        for _ in range(rounds):
            for kind in ("heartbeat", "head", "create", "chunk"):
                started = time.perf_counter()
                if kind == "heartbeat":
                    response = client.post(base + "live/", json=beat)
                elif kind == "head":
                    response = client.head(url)
                elif kind == "create":
                    response = client.post(base + "uploads/", json=create)
                else:
                    response = client.patch(
                        url, content=payload, headers={**chunk_headers, "Upload-Offset": str(offset)}
                    )
                latencies.append((kind, time.perf_counter() - started))
                if response.status_code >= 400:
                    errors.append(f"{kind} {response.status_code} {response.text[:80]}")
                elif kind == "chunk":
                    offset += chunk_bytes


def run_clients(
    base: str, token: str, clients: int, rounds: int, chunk_bytes: int, tag: str
) -> tuple[list[tuple[str, float]], list[str]]:
    latencies: list[tuple[str, float]] = []
    errors: list[str] = []
    # One job of --clients nodes per run: each heartbeat reads its job's nodes, so runs must not share a job.
    job = f"bench-{tag}-{os.getpid()}-{time.monotonic_ns()}"
    threads = [
        threading.Thread(
            target=agent_rounds,
            args=(
                base,
                token,
                rounds,
                job,
                f"node-{tag}-{os.getpid()}-{time.monotonic_ns()}-{i}",
                chunk_bytes,
                latencies,
                errors,
            ),
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, errors


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def peak_rss_mib(pids: list[int]) -> float:
    """Summed VmHWM (peak resident set) of ``pids``, MiB."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
    return total / 1024


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of ``pids`` so far (all their threads), seconds."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(
    env: dict[str, str], args: argparse.Namespace, token: str, data: bytes, streaming: bool, crowd: bool = True
) -> dict:
    """Start the site (streaming on or off), run the upload and (unless ``crowd`` is off) the crowd against it,
    stop it."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            *("manage.py", "serve", "--no-migrate", "--listen", f"127.0.0.1:{port}"),
            *("--workers", str(args.workers)),
        ],
        cwd=ROOT,
        env={**env, "COMMINSIGHT_SERVER_STREAM_BODIES": "1" if streaming else "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}/api/v1/ingest/"
        for _ in range(150):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        workers = children_of(server.pid) or [server.pid]
        rss_idle = peak_rss_mib(workers)
        cpu_start = cpu_seconds(workers)
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=300) as client:
            upload_s, finalize_s, chunk = upload(client, base, data, args.chunk_mib << 20)
        rss_upload = peak_rss_mib(workers)
        cpu_upload = cpu_seconds(workers)
        tag = "stream" if streaming else "buffer"
        requests, errors = (
            run_clients(base, token, args.clients, args.rounds, args.crowd_chunk_kib << 10, tag) if crowd else ([], [])
        )
        cpu_crowd = cpu_seconds(workers)
        return {
            # Server CPU (all workers; PostgreSQL not included): what the figures would be on idle cores.
            "cpu_s_per_gb": (cpu_upload - cpu_start) / (len(data) / 1e9),
            "cpu_ms_per_request": (cpu_crowd - cpu_upload) * 1e3 / max(len(requests), 1),
            "mbps": len(data) / 1e6 / upload_s,
            "finalize_s": finalize_s,
            "chunk": chunk,
            "rss_idle": rss_idle,
            "rss_upload": rss_upload,
            "crowd": requests,
            "errors": errors,
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--chunk-mib", type=int, default=8, help="client chunk (the agent's default is 8 MiB)")
    parser.add_argument("--workers", type=int, default=2, help="server processes (manage.py serve --workers)")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--crowd-chunk-kib", type=int, default=256, help="the crowd's PATCH chunk (<= 8192)")
    parser.add_argument("--alternations", type=int, default=2, help="buffered/streamed pairs of runs")
    parser.add_argument(
        "--storage", choices=["local", "s3"], default="local", help="s3: streamed uploads, local vs S3 storage"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(
            COMMINSIGHT_SERVER_DATA_DIR=str(data_dir),
            COMMINSIGHT_INGEST_RATE="1000000/min",
            LOG_LEVEL="WARNING",
            DJANGO_SETTINGS_MODULE="comminsight_site.settings",
        )
        if os.environ.get("BENCH_DATABASE_URL"):
            env["DATABASE_URL"] = os.environ["BENCH_DATABASE_URL"]
        manage(env, "serve", "--prepare-only")
        manage(
            env, "shell", "-c", "from apps.accounts.models import User; User.objects.get_or_create(username='bench')"
        )
        token = manage(env, "agent_token", "create", "--owner", "bench", "--name", f"bench-{os.getpid()}").split()[-1]
        if args.storage == "s3":
            storage_runs(env, args, token, Path(tmp) / "s3")
            return
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.alternations):  # alternating, so a busy neighbour hurts both servers alike
            for streaming in (False, True):
                data = os.urandom(args.size_mib << 20)  # new bytes: each run stores its own archive
                runs[streaming].append(measure(env, args, token, data, streaming))
        report(args, runs)


def storage_runs(env: dict[str, str], args: argparse.Namespace, token: str, s3_dir: Path) -> None:
    """One-agent uploads through the streamed path into the local data directory and into S3, alternating."""
    sys.path.insert(0, str(ROOT))
    from tests import s3server

    server = s3server.start(s3_dir)
    try:
        s3_env = {
            **env,
            "COMMINSIGHT_STORAGE_URL": f"s3://{s3server.BUCKET}/bench-{os.getpid()}",
            "AWS_ENDPOINT_URL": server.endpoint,
            "AWS_ACCESS_KEY_ID": s3server.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": s3server.SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }
        runs: dict[str, list[dict]] = {"local": [], "s3": []}
        for _ in range(args.alternations):
            for name, run_env in (("local", env), ("s3", s3_env)):
                data = os.urandom(args.size_mib << 20)
                runs[name].append(measure(run_env, args, token, data, streaming=True, crowd=False))
    finally:
        server.stop()
    print(
        f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end; serve --workers {args.workers}; "
        f"{args.size_mib} MiB in {runs['s3'][0]['chunk'] >> 20} MiB chunks; S3: SeaweedFS on loopback; "
        f"{args.alternations} alternations"
    )
    for name in runs:
        for run in runs[name]:
            print(
                f"  {name:5s}: upload {run['mbps']:6.1f} MB/s (finalize {run['finalize_s']:.2f} s), "
                f"server CPU {run['cpu_s_per_gb']:.2f} s/GB"
            )
    local = statistics.median(r["mbps"] for r in runs["local"])
    s3 = statistics.median(r["mbps"] for r in runs["s3"])
    print(f"upload   local {local:7.1f} MB/s   S3 {s3:7.1f} MB/s   ratio S3 / local {s3 / local:.2f}x")


def report(args: argparse.Namespace, runs: dict[bool, list[dict]]) -> None:
    """Per-run figures, then the median run of each server and the ratio streamed / buffered."""
    label = {False: "buffered", True: "streamed"}
    print(
        f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end; serve --workers {args.workers}; "
        f"{args.size_mib} MiB in {runs[True][0]['chunk'] >> 20} MiB chunks; {args.clients} agents x {args.rounds} "
        f"rounds (crowd chunk {args.crowd_chunk_kib} KiB); {args.alternations} alternations"
    )
    summary: dict[bool, dict[str, float]] = {}
    for streaming in (False, True):
        rows = []
        for run in runs[streaming]:
            times = [t for _, t in run["crowd"]]
            rows.append(
                {
                    "mbps": run["mbps"],
                    "rss": run["rss_upload"] - run["rss_idle"],
                    "p50": statistics.median(times),
                    "p99": percentile(times, 0.99),
                    "chunk_p99": percentile([t for k, t in run["crowd"] if k == "chunk"], 0.99),
                    "errors": len(run["errors"]),
                    "cpu_gb": run["cpu_s_per_gb"],
                    "cpu_req": run["cpu_ms_per_request"],
                }
            )
            print(
                f"  {label[streaming]}: upload {rows[-1]['mbps']:6.1f} MB/s, "
                f"peak RSS growth {rows[-1]['rss']:6.1f} MiB; "
                f"{args.clients} agents p50 {rows[-1]['p50'] * 1e3:6.1f} ms p99 {rows[-1]['p99'] * 1e3:7.1f} ms "
                f"(chunk p99 {rows[-1]['chunk_p99'] * 1e3:7.1f} ms), errors {rows[-1]['errors']}; "
                f"server CPU {rows[-1]['cpu_gb']:.2f} s/GB uploaded, {rows[-1]['cpu_req']:.2f} ms per crowd request"
            )
        summary[streaming] = {k: statistics.median([r[k] for r in rows]) for k in rows[0]}
    old, new = summary[False], summary[True]
    print(
        f"upload   buffered {old['mbps']:7.1f} MB/s   streamed {new['mbps']:7.1f} MB/s   "
        f"ratio {new['mbps'] / old['mbps']:.2f}x   (target >= 200 MB/s)"
    )
    print(
        f"memory   server peak RSS growth during the upload, all workers: buffered {old['rss']:6.1f} MiB   "
        f"streamed {new['rss']:6.1f} MiB"
    )
    print(
        f"latency  {args.clients} agents, all requests: buffered p50 {old['p50'] * 1e3:6.1f} ms p99 "
        f"{old['p99'] * 1e3:7.1f} ms   streamed p50 {new['p50'] * 1e3:6.1f} ms p99 {new['p99'] * 1e3:7.1f} ms   "
        f"ratio p99 {new['p99'] / old['p99']:.2f}x   (target p99 <= 100 ms)"
    )
    print(
        f"  chunk requests only: buffered p99 {old['chunk_p99'] * 1e3:7.1f} ms   "
        f"streamed p99 {new['chunk_p99'] * 1e3:7.1f} ms"
    )
    print(
        f"server CPU (all workers, load-independent): upload buffered {old['cpu_gb']:.2f} s/GB   streamed "
        f"{new['cpu_gb']:.2f} s/GB   ratio {new['cpu_gb'] / old['cpu_gb']:.2f}x;  per crowd request buffered "
        f"{old['cpu_req']:.2f} ms   streamed {new['cpu_req']:.2f} ms   ratio {new['cpu_req'] / old['cpu_req']:.2f}x"
    )
    for streaming in (False, True):
        errors = [e for run in runs[streaming] for e in run["errors"]]
        for error in sorted(set(errors))[:3]:
            print(f"  error ({label[streaming]}): {error}")


if __name__ == "__main__":
    main()
