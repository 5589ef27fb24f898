"""Site ingest on loopback: upload throughput, server memory and API latency under 50 agents, streaming vs buffering.

Starts the real site (`manage.py serve --workers N`: uvicorn, or what COMMINSIGHT_SERVER_HTTP names) twice on one
temporary data directory, in the same run: first as the baseline (COMMINSIGHT_SERVER_STREAM_BODIES=0: stock Daphne
buffers each body, Django copies it, the view writes it), then with bodies streamed to disk ahead of Django and upload
create, HEAD and heartbeats answered ahead of it (the default). Against each:
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

With --baseline REV the baseline is instead the streamed server of this repository's commit REV (unpacked by `git
archive` into the temporary directory), with --baseline-tree DIR that of another checkout, both run with this tree's
Python and database: old code against new, alternating, in the same run. With --baseline-env NAME=VALUE (repeatable)
the baseline is this tree's streamed server with those environment variables set: a setting's two values.

Server CPU per kind (--per-kind, the default): after the mixed rounds, the same agents send as many rounds of each
kind alone (heartbeats only, then HEADs, creates, chunks); the agents and the main thread meet at a barrier between
phases, where the workers' CPU clocks (and PostgreSQL's) are read, so each phase's CPU is its own requests' and
nothing else's (the agents' opening create and first heartbeat come before the first reading). BENCH_LOG_LEVEL
(default WARNING) is the servers' LOG_LEVEL: INFO logs an access line per request, as the site does by default.

Where the latency goes: besides the server workers' CPU, the bench reports the agents' CPU per crowd request (threads
of this process, or of the --client-processes processes, on the same cores) and, on PostgreSQL, the CPU of the
database's backends; and once per run the crowd runs against a server that answers every request at once
(`--echo-server`, no work at all), which is the latency floor of the client side and the loopback on this machine at
its current load.

With --storage s3 the comparison is by storage instead (issue 12): the streamed server stores into the local
data directory, then into an S3 bucket (COMMINSIGHT_STORAGE_URL, multipart upload) on a real SeaweedFS started
for the run (the tests' tests/s3server.py), alternating; it prints the one-agent upload MB/s of each, the ratio
S3 / local and the server CPU per GB (the crowd is skipped).

With --client-processes P the crowd's agents are spread over P processes of their own (threads in each), as real
agents run on machines of their own: one process's agents share one interpreter lock, so on a machine of many cores
that process, not the server, can be what the latency measures (the echo-server floor uses the same layout).

Run: .venv/bin/python bench/site_ingest.py [--size-mib 256] [--chunk-mib 8] [--workers 2] [--clients 50]
     [--rounds 10] [--crowd-chunk-kib 256] [--alternations 2] [--client-processes 1] [--storage s3]
     [--baseline REV | --baseline-tree DIR | --baseline-env NAME=VALUE] [--no-per-kind]
Uses SQLite in the temporary data directory unless BENCH_DATABASE_URL is set (a database it may migrate), and no
Redis (each worker its own cache and channel layer) unless BENCH_REDIS_URL is set (a Redis database it may use: the
shared rate-limit cache, the channel layer the heartbeats publish to, and the queue finalized uploads are sent to,
as a deployment of several workers has them).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import itertools
import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

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
    response = client.post(base + "uploads/", json=body)
    if response.status_code >= 300 or not response.headers.get("content-type", "").startswith("application/json"):
        raise RuntimeError(f"upload create answered {response.status_code}: {response.text[:300]!r}")
    created = response.json()
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


KINDS = ("heartbeat", "head", "create", "chunk")
# The crowd's phases: the mixed rounds (each round one request of every kind, the latency figures), then, with
# --per-kind, the same number of rounds of one kind at a time, so the server's CPU can be told per kind.
MIXED = "mixed"


def agent_rounds(
    base: str,
    token: str,
    rounds: int,
    workload: str,
    node: str,
    chunk_bytes: int,
    phases: tuple[str, ...],
    barrier: Any,
    latencies: list,
    errors: list[str],
) -> None:
    """One closed-loop agent (one node of ``workload``): opens its upload and sends its first heartbeat, then
    for each of ``phases`` waits at ``barrier`` twice (all agents done; the main thread read the CPU clocks)
    and sends ``rounds`` rounds: in the mixed phase a heartbeat, an upload HEAD, a create (resume) and one
    chunk each, in a kind's phase one request of that kind. Latencies are kept for the mixed phase only."""
    payload = os.urandom(chunk_bytes)
    chunk_headers = {"Content-Type": "application/offset+octet-stream"}
    chunk_headers["Upload-Checksum"] = f"sha256 {hashlib.sha256(payload).hexdigest()}"
    chunks = rounds * sum(1 for p in phases if p in (MIXED, "chunk"))
    try:
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
            sha = hashlib.sha256(node.encode()).hexdigest()
            create = {"sha256": sha, "size": chunk_bytes * (chunks + 1), "filename": "ci-x.tar.zst"}
            upload_id = client.post(base + "uploads/", json=create).json()["upload_id"]
            url = f"{base}uploads/{upload_id}/"
            beat = {"workload_id": workload, "node": node, "sent_ns": 0, "communicators": []}
            client.post(base + "live/", json=beat)  # the node exists before the clock starts
            offset = 0
            for phase in (*phases, None):
                barrier.wait()  # everyone done with the previous phase (or with opening)
                barrier.wait()  # the main thread has read the clocks
                if phase is None:
                    break
                kinds = KINDS if phase == MIXED else (phase,)
                for _ in range(rounds):
                    for kind in kinds:
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
                        if phase == MIXED:
                            latencies.append((kind, time.perf_counter() - started))
                        if response.status_code >= 400:
                            errors.append(f"{kind} {response.status_code} {response.text[:80]}")
                        elif kind == "chunk":
                            offset += chunk_bytes
    except BaseException:
        barrier.abort()  # an agent that failed must not leave the others (or the main thread) waiting
        raise


def run_clients(
    base: str,
    token: str,
    clients: int,
    rounds: int,
    chunk_bytes: int,
    tag: str,
    job: str,
    phases: tuple[str, ...],
    barrier: Any,
) -> tuple[list[tuple[str, float]], list[str]]:
    latencies: list[tuple[str, float]] = []
    errors: list[str] = []
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
                phases,
                barrier,
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


def crowd_part(
    base: str,
    token: str,
    clients: int,
    rounds: int,
    chunk_bytes: int,
    tag: str,
    job: str,
    phases: tuple[str, ...],
    barrier: Any,
) -> tuple[list[tuple[str, float]], list[str], float]:
    """One process's share of the crowd; also returns this process's CPU seconds for it."""
    cpu_start = own_cpu_seconds()
    latencies, errors = run_clients(base, token, clients, rounds, chunk_bytes, tag, job, phases, barrier)
    return latencies, errors, own_cpu_seconds() - cpu_start


def phase_boundaries(barrier: Any, phases: tuple[str, ...], clock: Any) -> list[Any]:
    """The main thread's part of the crowd: at each phase boundary (all agents done), ``clock()`` is read before
    the agents go on. Returns the readings, one more than there are phases."""
    readings = []
    for _ in range(len(phases) + 1):
        barrier.wait()
        readings.append(clock())
        barrier.wait()
    return readings


def run_crowd(
    base: str, token: str, args: argparse.Namespace, tag: str, phases: tuple[str, ...], clock: Any
) -> tuple[list[tuple[str, float]], list[str], float, list[Any]]:
    """The crowd (--clients agents of --rounds rounds per phase): threads of this process, or spread over
    --client-processes processes. Returns the latencies (mixed phase), the errors, the agents' CPU seconds (all
    phases) and ``clock()`` read at each phase boundary (wall-clock time is one of its readings, or not)."""
    chunk_bytes = args.crowd_chunk_kib << 10
    # One job of --clients nodes per run, whatever the processes: each heartbeat reads its job's nodes, so runs
    # must not share a job.
    job = f"bench-{tag}-{os.getpid()}-{time.monotonic_ns()}"
    processes = max(1, min(args.client_processes, args.clients))
    if processes == 1:
        barrier = threading.Barrier(args.clients + 1)
        with concurrent.futures.ThreadPoolExecutor(1) as main_part:
            part = main_part.submit(
                crowd_part, base, token, args.clients, args.rounds, chunk_bytes, tag, job, phases, barrier
            )
            readings = phase_boundaries(barrier, phases, clock)
            latencies, errors, client_cpu = part.result()
        return latencies, errors, client_cpu, readings
    shares = [args.clients // processes + (i < args.clients % processes) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    with (
        context.Manager() as manager,
        concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool,
    ):
        barrier = manager.Barrier(args.clients + 1)
        parts = [
            pool.submit(crowd_part, base, token, share, args.rounds, chunk_bytes, f"{tag}-p{i}", job, phases, barrier)
            for i, share in enumerate(shares)
        ]
        readings = phase_boundaries(barrier, phases, clock)
        results = [part.result() for part in parts]
    return (
        [t for part in results for t in part[0]],
        [e for part in results for e in part[1]],
        sum(part[2] for part in results),
        readings,
    )


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


def own_cpu_seconds() -> float:
    """User + system CPU time of this process (the crowd's agents are its threads), seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def database_cpu_seconds(env: dict[str, str]) -> float | None:
    """CPU time so far of the PostgreSQL backends connected to the bench's database (None without PostgreSQL)."""
    url = env.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        return None
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        pids = [pid for (pid,) in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")]
        own = conn.info.backend_pid
    try:
        return cpu_seconds([pid for pid in pids if pid != own and Path(f"/proc/{pid}").exists()])
    except OSError:  # a backend ended meanwhile, or PostgreSQL runs elsewhere
        return None


def measure(
    env: dict[str, str],
    args: argparse.Namespace,
    token: str,
    data: bytes,
    streaming: bool,
    crowd: bool = True,
    tree: Path = ROOT,
) -> dict:
    """Start the site of ``tree`` (streaming on or off), run the upload and (unless ``crowd`` is off) the crowd
    against it, stop it."""
    port = free_port()
    with tempfile.TemporaryFile() as log:  # the server's messages, shown if the run fails
        return _measure(env, args, token, data, streaming, crowd, tree, port, log)


def _measure(
    env: dict[str, str],
    args: argparse.Namespace,
    token: str,
    data: bytes,
    streaming: bool,
    crowd: bool,
    tree: Path,
    port: int,
    log: Any,
) -> dict:
    server = subprocess.Popen(
        [
            sys.executable,
            *("manage.py", "serve", "--no-migrate", "--listen", f"127.0.0.1:{port}"),
            *("--workers", str(args.workers)),
        ],
        cwd=tree,
        env={**env, "COMMINSIGHT_SERVER_STREAM_BODIES": "1" if streaming else "0"},
        stdout=subprocess.DEVNULL,
        stderr=log,
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
        tag = f"{'stream' if streaming else 'buffer'}-{abs(hash(tree))}"
        phases = (MIXED, *KINDS) if args.per_kind else (MIXED,)

        def clock() -> tuple[float, float, float | None]:
            return time.time(), cpu_seconds(workers), database_cpu_seconds(env)

        if crowd:
            requests, errors, client_cpu, readings = run_crowd(base, token, args, tag, phases, clock)
        else:
            requests, errors, client_cpu, readings = [], [], 0.0, [(0.0, 0.0, None)] * (len(phases) + 1)
        per_phase = {}
        for phase, (before, after) in zip(phases, itertools.pairwise(readings), strict=True):
            count = max(1, args.clients * args.rounds * (len(KINDS) if phase == MIXED else 1))
            per_phase[phase] = {
                "wall_s": after[0] - before[0],
                # Server CPU (all workers; PostgreSQL not included): what the figures would be on idle cores.
                "cpu_ms": (after[1] - before[1]) * 1e3 / count,
                "database_ms": (
                    (after[2] - before[2]) * 1e3 / count
                    if before[2] is not None and after[2] is not None
                    else float("nan")
                ),
            }
        total = max(1, args.clients * args.rounds * (len(KINDS) + len(phases) - 1))
        return {
            "cpu_s_per_gb": (cpu_upload - cpu_start) / (len(data) / 1e9),
            "cpu_ms_per_request": per_phase[MIXED]["cpu_ms"],
            "per_phase": per_phase,
            "client_ms_per_request": client_cpu * 1e3 / total,
            "database_ms_per_request": per_phase[MIXED]["database_ms"],
            "mbps": len(data) / 1e6 / upload_s,
            "finalize_s": finalize_s,
            "chunk": chunk,
            "rss_idle": rss_idle,
            "rss_upload": rss_upload,
            "crowd": requests,
            "crowd_s": per_phase[MIXED]["wall_s"],
            "errors": errors,
        }
    except Exception:
        log.seek(0)
        print(f"server log ({tree}):\n" + log.read().decode(errors="replace")[-4000:], file=sys.stderr)
        raise
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
        "--client-processes", type=int, default=1, help="processes the crowd's agents are spread over (threads in each)"
    )
    parser.add_argument(
        "--storage", choices=["local", "s3"], default="local", help="s3: streamed uploads, local vs S3 storage"
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="baseline: the streamed server of this checkout (old code), not buffered",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="baseline: the streamed server of this repository's commit REV (git archive of it; old code)",
    )
    parser.add_argument(
        "--baseline-env",
        metavar="NAME=VALUE",
        action="append",
        type=lambda text: tuple(text.split("=", 1)),
        default=[],
        help="baseline: this tree's streamed server with this environment variable set (a setting's two values)",
    )
    parser.add_argument(
        "--per-kind",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the mixed rounds, as many rounds of each kind alone: server CPU per kind",
    )
    parser.add_argument("--echo-server", type=int, help=argparse.SUPPRESS)  # internal: the client-floor server
    args = parser.parse_args()
    if args.echo_server:
        asyncio.run(echo_server(args.echo_server))
        return

    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            args.baseline_tree = checkout(args.baseline, Path(tmp) / "baseline")
        data_dir = Path(tmp) / "data"
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(
            COMMINSIGHT_SERVER_DATA_DIR=str(data_dir),
            COMMINSIGHT_INGEST_RATE="1000000/min",
            LOG_LEVEL=os.environ.get("BENCH_LOG_LEVEL", "WARNING"),  # INFO: as the site logs by default
            DJANGO_SETTINGS_MODULE="comminsight_site.settings",
        )
        if os.environ.get("BENCH_DATABASE_URL"):
            env["DATABASE_URL"] = os.environ["BENCH_DATABASE_URL"]
        if os.environ.get("BENCH_REDIS_URL"):
            env["REDIS_URL"] = os.environ["BENCH_REDIS_URL"]
        manage(env, "serve", "--prepare-only")
        manage(
            env, "shell", "-c", "from apps.accounts.models import User; User.objects.get_or_create(username='bench')"
        )
        token = manage(env, "agent_token", "create", "--owner", "bench", "--name", f"bench-{os.getpid()}").split()[-1]
        if args.storage == "s3":
            storage_runs(env, args, token, Path(tmp) / "s3")
            return
        # False: the baseline (buffered, or the streamed server of --baseline-tree), True: this tree, streamed.
        runs: dict[bool, list[dict]] = {False: [], True: []}
        floors: list[list[tuple[str, float]]] = []
        for _ in range(args.alternations):  # alternating, so a busy neighbour hurts both servers alike
            for new in (False, True):
                data = os.urandom(args.size_mib << 20)  # new bytes: each run stores its own archive
                if args.baseline_tree is not None and not new:
                    runs[new].append(measure(env, args, token, data, True, tree=args.baseline_tree.resolve()))
                elif args.baseline_env and not new:
                    runs[new].append(measure({**env, **dict(args.baseline_env)}, args, token, data, True))
                else:
                    runs[new].append(measure(env, args, token, data, new))
            floors.append(client_floor(args))
        report(args, runs, floors)


def checkout(rev: str, where: Path) -> Path:
    """The tree of commit ``rev`` of this repository, unpacked at ``where`` (run with this tree's Python)."""
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def echo_server_answer(head: bytes) -> bytes:
    """What the echo server answers: an open upload to every request (the crowd reads ``upload_id`` once)."""
    body = b'{"upload_id": "00000000-0000-4000-8000-000000000000", "offset": 0, "status": "open"}'
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + (b"" if head.startswith(b"HEAD ") else body)
    )


async def echo_server(port: int) -> None:
    """An HTTP/1.1 server that reads each request and answers at once, doing nothing else (keep-alive)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(echo_server_answer(head))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=512)
    async with server:
        await server.serve_forever()


def client_floor(args: argparse.Namespace) -> list[tuple[str, float]]:
    """The crowd's latencies against the echo server (a process of its own): the client side's share."""
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--echo-server", str(port)])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        base = f"http://127.0.0.1:{port}/api/v1/ingest/"
        requests, _, _, _ = run_crowd(base, "none", args, "floor", (MIXED,), lambda: None)
        return requests
    finally:
        server.terminate()
        server.wait(timeout=30)


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


def ratio(new: float, old: float) -> str:
    return f"{new / old:.2f}x" if old else "n/a"


def report(args: argparse.Namespace, runs: dict[bool, list[dict]], floors: list[list[tuple[str, float]]]) -> None:
    """Per-run figures, then the median run of each server and the ratio new / baseline."""
    compared = args.baseline_tree or args.baseline_env
    label = {False: "before", True: "after"} if compared else {False: "buffered", True: "streamed"}
    print(
        f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end; serve --workers {args.workers}; "
        f"{args.size_mib} MiB in {runs[True][0]['chunk'] >> 20} MiB chunks; {args.clients} agents x {args.rounds} "
        f"rounds (crowd chunk {args.crowd_chunk_kib} KiB, agents in {args.client_processes} process(es)); "
        f"{args.alternations} alternations"
        + (f"; before = {args.baseline or args.baseline_tree}, streamed" if args.baseline_tree else "")
        + (
            "; before = this tree, streamed, with " + " ".join(f"{k}={v}" for k, v in args.baseline_env)
            if args.baseline_env
            else ""
        )
        + ("; with Redis" if os.environ.get("BENCH_REDIS_URL") else "; no Redis")
    )
    summary: dict[bool, dict[str, float]] = {}
    spread: dict[bool, dict[str, tuple[float, float]]] = {}
    for new in (False, True):
        rows = []
        for run in runs[new]:
            times = [t for _, t in run["crowd"]]
            rows.append(
                {
                    "mbps": run["mbps"],
                    "rss": run["rss_upload"] - run["rss_idle"],
                    "rps": len(times) / run["crowd_s"],
                    "p50": statistics.median(times),
                    "p95": percentile(times, 0.95),
                    "p99": percentile(times, 0.99),
                    "chunk_p99": percentile([t for k, t in run["crowd"] if k == "chunk"], 0.99),
                    "errors": len(run["errors"]),
                    "cpu_gb": run["cpu_s_per_gb"],
                    "cpu_req": run["cpu_ms_per_request"],
                    "client_req": run["client_ms_per_request"],
                    "database_req": run["database_ms_per_request"],
                    **{f"cpu_{k}": run["per_phase"][k]["cpu_ms"] for k in KINDS if k in run["per_phase"]},
                    **{f"database_{k}": run["per_phase"][k]["database_ms"] for k in KINDS if k in run["per_phase"]},
                }
            )
            row = rows[-1]
            print(
                f"  {label[new]}: upload {row['mbps']:6.1f} MB/s, peak RSS growth {row['rss']:6.1f} MiB; "
                f"{args.clients} agents {row['rps']:5.0f} requests/s, p50 {row['p50'] * 1e3:6.1f} ms "
                f"p95 {row['p95'] * 1e3:7.1f} ms "
                f"p99 {row['p99'] * 1e3:7.1f} ms (chunk p99 {row['chunk_p99'] * 1e3:7.1f} ms), errors {row['errors']}; "
                f"CPU per crowd request: server {row['cpu_req']:.2f} ms, agents {row['client_req']:.2f} ms, "
                f"PostgreSQL {row['database_req']:.2f} ms; server CPU {row['cpu_gb']:.2f} s/GB uploaded"
            )
            for kind in KINDS:
                kind_times = [t for k, t in run["crowd"] if k == kind]
                alone = (
                    f";  alone: server CPU {row[f'cpu_{kind}']:.2f} ms, PostgreSQL {row[f'database_{kind}']:.2f} ms"
                    if f"cpu_{kind}" in row
                    else ""
                )
                print(
                    f"      {kind:9s} p50 {statistics.median(kind_times) * 1e3:7.1f} ms   "
                    f"p99 {percentile(kind_times, 0.99) * 1e3:7.1f} ms{alone}"
                )
        summary[new] = {k: statistics.median([r[k] for r in rows]) for k in rows[0]}
        spread[new] = {k: (min(r[k] for r in rows), max(r[k] for r in rows)) for k in rows[0]}
    old, new_ = summary[False], summary[True]
    a, b = label[False], label[True]
    print(
        f"upload   {a} {old['mbps']:7.1f} MB/s   {b} {new_['mbps']:7.1f} MB/s   "
        f"ratio {new_['mbps'] / old['mbps']:.2f}x   (target >= 200 MB/s)"
    )
    print(
        f"memory   server peak RSS growth during the upload, all workers: {a} {old['rss']:6.1f} MiB   "
        f"{b} {new_['rss']:6.1f} MiB"
    )
    print(
        f"latency  {args.clients} agents, all requests: {a} p50 {old['p50'] * 1e3:6.1f} p95 {old['p95'] * 1e3:6.1f} "
        f"p99 {old['p99'] * 1e3:7.1f} ms   {b} p50 {new_['p50'] * 1e3:6.1f} p95 {new_['p95'] * 1e3:6.1f} "
        f"p99 {new_['p99'] * 1e3:7.1f} ms   ratio p99 {new_['p99'] / old['p99']:.2f}x   (target p99 <= 100 ms)"
    )
    print(f"  requests/s (all kinds, the crowd's wall clock): {a} {old['rps']:6.0f}   {b} {new_['rps']:6.0f}")
    print(
        f"  chunk requests only: {a} p99 {old['chunk_p99'] * 1e3:7.1f} ms   {b} p99 {new_['chunk_p99'] * 1e3:7.1f} ms"
    )
    print(
        f"server CPU (all workers, load-independent): upload {a} {old['cpu_gb']:.2f} s/GB   {b} "
        f"{new_['cpu_gb']:.2f} s/GB   ratio {new_['cpu_gb'] / old['cpu_gb']:.2f}x;  per crowd request {a} "
        f"{old['cpu_req']:.2f} ms   {b} {new_['cpu_req']:.2f} ms   ratio {new_['cpu_req'] / old['cpu_req']:.2f}x"
    )
    if args.per_kind:
        print(
            "server CPU per request by kind (each kind alone, the same agents; all workers): "
            + ";  ".join(
                f"{k} {a} {old[f'cpu_{k}']:.2f} ms {b} {new_[f'cpu_{k}']:.2f} ms "
                f"({ratio(new_[f'cpu_{k}'], old[f'cpu_{k}'])})"
                for k in KINDS
            )
        )
        print(
            "PostgreSQL CPU per request by kind: "
            + ";  ".join(f"{k} {a} {old[f'database_{k}']:.2f} ms {b} {new_[f'database_{k}']:.2f} ms" for k in KINDS)
        )
    print(
        f"CPU per crowd request besides the server: agents {a} {old['client_req']:.2f} ms   "
        f"{b} {new_['client_req']:.2f} ms;  PostgreSQL backends {a} {old['database_req']:.2f} ms   "
        f"{b} {new_['database_req']:.2f} ms"
    )
    print(
        "spread over runs (min-max): server CPU per crowd request "
        + "   ".join(
            f"{label[n]} {spread[n]['cpu_req'][0]:.2f}-{spread[n]['cpu_req'][1]:.2f} ms" for n in (False, True)
        )
        + ";  p99 "
        + "   ".join(
            f"{label[n]} {spread[n]['p99'][0] * 1e3:.0f}-{spread[n]['p99'][1] * 1e3:.0f} ms" for n in (False, True)
        )
        + ";  upload "
        + "   ".join(f"{label[n]} {spread[n]['mbps'][0]:.1f}-{spread[n]['mbps'][1]:.1f} MB/s" for n in (False, True))
    )
    floor = [t for run in floors for _, t in run]
    print(
        f"client floor (the same crowd against a server that answers at once): p50 "
        f"{statistics.median(floor) * 1e3:6.1f} ms p95 {percentile(floor, 0.95) * 1e3:6.1f} ms "
        f"p99 {percentile(floor, 0.99) * 1e3:7.1f} ms"
    )
    for new in (False, True):
        errors = [e for run in runs[new] for e in run["errors"]]
        for error in sorted(set(errors))[:3]:
            print(f"  error ({label[new]}): {error}")


if __name__ == "__main__":
    main()
