"""Site ingest API on loopback: upload throughput and API latency under 50 concurrent agents.

Starts the real site (`manage.py serve`, Daphne) in a subprocess on a temporary data directory, then:
  - upload:  one resumable upload of --size-mib MiB in PATCH chunks of min(--chunk-mib, the site's max_chunk),
             as the agent sends them (create, append, finalize);
             baseline: a plain file copy of the same bytes in the same run (shutil.copyfile).
  - latency: --clients concurrent agents (threads, one HTTP connection each) each sending --rounds of
             heartbeat POST + upload HEAD + upload create (resume); baseline: one agent alone, same requests.
Prints MB/s and the ratio to the copy, and p50/p99 latency against the single-client baseline.
Targets (DESIGN §9): ingest >= 200 MB/s on loopback; API p99 < 100 ms with 50 agents uploading.

Run: .venv/bin/python bench/site_ingest.py [--size-mib 256] [--chunk-mib 8] [--workers 1] [--clients 50]
     [--rounds 20]
Uses SQLite in the temporary data directory unless BENCH_DATABASE_URL is set (a database it may migrate).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
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


def upload(client: httpx.Client, base: str, path: Path, sha: str, chunk: int) -> tuple[float, float, int]:
    """(seconds appending all chunks, seconds finalizing, chunk size used); create is excluded."""
    size = path.stat().st_size
    body = {"sha256": sha, "size": size, "filename": "ci-bench-n1-0-1.tar.zst"}
    created = client.post(base + "uploads/", json=body).json()
    upload_id = created["upload_id"]
    chunk = min(chunk, int(created["max_chunk"]))  # the agent's rule (comminsight.agent.uploader)
    url = f"{base}uploads/{upload_id}/"
    started = time.perf_counter()
    with path.open("rb") as handle:
        offset = 0
        while offset < size:
            data = handle.read(chunk)
            response = client.patch(
                url,
                content=data,
                headers={
                    "Content-Type": "application/offset+octet-stream",
                    "Upload-Offset": str(offset),
                    "Upload-Checksum": f"sha256 {hashlib.sha256(data).hexdigest()}",
                },
            )
            response.raise_for_status()
            offset += len(data)
    elapsed = time.perf_counter() - started
    started = time.perf_counter()
    client.post(url + "finalize/").raise_for_status()
    return elapsed, time.perf_counter() - started, chunk


def agent_rounds(
    base: str, token: str, rounds: int, node: str, latencies: list[tuple[str, float]], errors: list[str]
) -> None:
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        sha = hashlib.sha256(node.encode()).hexdigest()
        created = client.post(base + "uploads/", json={"sha256": sha, "size": 1 << 20, "filename": "ci-x.tar.zst"})
        upload_id = created.json()["upload_id"]
        beat = {"workload_id": "bench", "node": node, "sent_ns": 0, "communicators": []}
        for _ in range(rounds):
            for kind, send in (
                ("heartbeat", lambda: client.post(base + "live/", json=beat)),
                ("head", lambda: client.head(f"{base}uploads/{upload_id}/")),
                (
                    "create",
                    lambda: client.post(
                        base + "uploads/", json={"sha256": sha, "size": 1 << 20, "filename": "ci-x.tar.zst"}
                    ),
                ),
            ):
                started = time.perf_counter()
                response = send()
                latencies.append((kind, time.perf_counter() - started))
                if response.status_code >= 400:
                    errors.append(f"{response.status_code} {response.text[:80]}")


def run_clients(base: str, token: str, clients: int, rounds: int) -> tuple[list[tuple[str, float]], list[str]]:
    latencies: list[tuple[str, float]] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=agent_rounds, args=(base, token, rounds, f"node-{clients}-{i}", latencies, errors))
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--chunk-mib", type=int, default=8, help="client chunk (the agent's default is 8 MiB)")
    parser.add_argument("--workers", type=int, default=1, help="server processes (manage.py serve --workers)")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        port = free_port()
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
        manage(env, "shell", "-c", "from apps.accounts.models import User; User.objects.create(username='bench')")
        token = manage(env, "agent_token", "create", "--owner", "bench", "--name", "bench").strip()
        server = subprocess.Popen(
            [
                sys.executable,
                *("manage.py", "serve", "--no-migrate", "--listen", f"127.0.0.1:{port}"),
                *("--workers", str(args.workers)),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            base = f"http://127.0.0.1:{port}/api/v1/ingest/"
            for _ in range(100):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            source = Path(tmp) / "payload.bin"
            with source.open("wb") as out:
                for _ in range(args.size_mib):
                    out.write(os.urandom(1 << 20))
            sha = hashlib.sha256(source.read_bytes()).hexdigest()

            started = time.perf_counter()
            shutil.copyfile(source, Path(tmp) / "copy.bin")
            copy_s = time.perf_counter() - started
            (Path(tmp) / "copy.bin").unlink()
            with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=300) as client:
                upload_s, finalize_s, chunk = upload(client, base, source, sha, args.chunk_mib << 20)
            mb = args.size_mib * (1 << 20) / 1e6
            print(
                f"upload   {mb / upload_s:8.1f} MB/s   baseline file copy {mb / copy_s:8.1f} MB/s   "
                f"ratio {copy_s / upload_s:.3f} of copy   (target >= 200 MB/s)   "
                f"{chunk >> 20} MiB chunks; finalize (sha256 + fsync of {args.size_mib} MiB) {finalize_s:.2f} s"
            )

            alone_by_kind, alone_errors = run_clients(base, token, 1, args.rounds)
            crowd_by_kind, crowd_errors = run_clients(base, token, args.clients, args.rounds)
            alone = [t for _, t in alone_by_kind]
            crowd = [t for _, t in crowd_by_kind]
            p99_alone, p99_crowd = percentile(alone, 0.99), percentile(crowd, 0.99)
            crowd_p50 = statistics.median(crowd) * 1e3
            print(
                f"latency  {args.clients} agents: p50 {crowd_p50:7.1f} ms  p99 {p99_crowd * 1e3:7.1f} ms"
                f"   baseline 1 agent: p50 {statistics.median(alone) * 1e3:6.1f} ms  p99 {p99_alone * 1e3:6.1f} ms"
                f"   ratio p99 {p99_crowd / p99_alone:.1f}x   (target p99 < 100 ms)   "
                f"{args.workers} server worker(s)   "
                f"errors {len(alone_errors) + len(crowd_errors)} of {len(alone) + len(crowd)}"
            )
            for kind in ("heartbeat", "head", "create"):
                times = [t for k, t in crowd_by_kind if k == kind]
                print(
                    f"  {kind:9s} {args.clients} agents: p50 {statistics.median(times) * 1e3:7.1f} ms  "
                    f"p99 {percentile(times, 0.99) * 1e3:7.1f} ms"
                )
            for error in sorted(set(alone_errors + crowd_errors))[:5]:
                print(f"  error: {error}")
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
