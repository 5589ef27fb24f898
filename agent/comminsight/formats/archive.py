"""Archive format v1: one ``tar`` stream compressed with zstd, holding ``manifest.json`` and sealed segments.

Written by the agent (``write_archive``), read by the site's ingest and by the ``archive`` importer
(``read_archive``). Spec: docs/formats/archive.md (agreed in PROTOCOLS.md). The archive's identity
is the sha256 of the whole file.

Reading treats every archive as hostile: members are streamed one at a time (never extracted to
disk), ``manifest.json`` must come first, names must match the allow-list, only regular files are
accepted, and caps bound the member count, the bytes of each member and of all members, and the
ratio of uncompressed to compressed bytes (zip bombs). Each member's size and sha256 must match the
manifest; a member the manifest does not list is an error.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import zstandard

from .boundedjson import JSONLimitError, loads_bounded

SCHEMA_VERSION = 1
KIND = "comminsight.archive"
ZSTD_LEVEL = 3
MEMBER_NAME = re.compile(
    r"^(manifest\.json|segments/[A-Za-z0-9._-]{1,200}|hang/[A-Za-z0-9._-]{1,200}\.json"
    r"|metadata/process_groups-[A-Za-z0-9._-]{1,180}\.json"
    r"|steps/[A-Za-z0-9._-]{1,200}\.jsonl|metrics/[A-Za-z0-9._-]{1,200}\.parquet)$"
)
_FILE_PART = re.compile(r"[^A-Za-z0-9._-]+")
MANIFEST_MAX_DEPTH = 16  # the format nests 4 levels (manifest > communicators > entry > positions)


def member_name_allowed(name: object) -> bool:
    """A name the format allows: on the allow-list, and no component made of dots only (``segments/..``)."""
    if not isinstance(name, str) or not MEMBER_NAME.match(name):
        return False
    return all(part.strip(".") for part in name.split("/"))


def _is_int(value: object) -> bool:
    """An integer in JSON's sense: ``true`` is not one, although Python's bool is an int."""
    return isinstance(value, int) and not isinstance(value, bool)


class ArchiveError(ValueError):
    """An archive that is malformed, hostile or over a limit; the message says which and why."""


@dataclass(frozen=True)
class ArchiveLimits:
    """Caps applied while reading. Defaults suit one node's archive interval with room to spare."""

    max_members: int = 10_000
    max_member_bytes: int = 1 << 30
    max_total_bytes: int = 8 << 30
    max_ratio: float = 200.0  # uncompressed / compressed; raw records compress ~10x
    max_manifest_bytes: int = 8 << 20
    ratio_slack_bytes: int = 1 << 20  # tiny archives legitimately exceed the ratio; allow this much regardless


@dataclass(frozen=True)
class ArchiveMember:
    """One member to write: its archive name, its bytes (from ``path`` or ``data``) and its record count."""

    name: str
    path: Path | None = None
    data: bytes | None = None
    records: int = 0


@dataclass(frozen=True)
class WrittenArchive:
    path: Path
    sha256: str
    size: int
    manifest: dict[str, Any] = field(default_factory=dict)


def archive_filename(workload_id: str, node: str, first_ns: int, last_ns: int) -> str:
    """``ci-<workload>-<node>-<first_ns>-<last_ns>.tar.zst`` with unsafe characters replaced by ``_``."""
    workload = _FILE_PART.sub("_", workload_id or "unknown")[:80]
    node_part = _FILE_PART.sub("_", node or "unknown")[:80]
    return f"ci-{workload}-{node_part}-{int(first_ns)}-{int(last_ns)}.tar.zst"


def _member_bytes(member: ArchiveMember) -> bytes:
    if member.data is not None:
        return member.data
    if member.path is None:
        raise ArchiveError(f"member {member.name!r} has neither path nor data")
    return Path(member.path).read_bytes()


def write_archive(dest: Path | str, manifest: dict[str, Any], members: Sequence[ArchiveMember]) -> WrittenArchive:
    """Write an archive to ``dest`` atomically (temporary file, fsync, rename) and return its identity.

    ``manifest`` carries the descriptive keys (workload_id, node, host, node_ip, created_ns, time_range,
    ranks, communicators, dropped); this function adds schema_version, kind, members and
    record_count. Members are written in the order given, after manifest.json.
    """
    dest = Path(dest)
    entries: list[dict[str, Any]] = []
    payloads: list[bytes] = []
    for member in members:
        if not member_name_allowed(member.name) or member.name == "manifest.json":
            raise ArchiveError(f"member name {member.name!r} is not allowed in an archive")
        data = _member_bytes(member)
        payloads.append(data)
        entries.append(
            {
                "name": member.name,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "records": int(member.records),
            }
        )
    full = {
        **manifest,
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "members": entries,
        "record_count": sum(e["records"] for e in entries),
    }
    manifest_bytes = json.dumps(full, sort_keys=True, indent=1).encode()
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    mtime = int(full.get("created_ns", 0)) // 1_000_000_000

    class _Hashing(io.RawIOBase):
        def __init__(self, raw: IO[bytes]) -> None:
            self.raw = raw
            self.size = 0

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:  # type: ignore[override]
            view = memoryview(b)
            digest.update(view)
            self.size += len(view)
            return self.raw.write(view)

    try:
        with open(tmp, "wb") as raw:
            hashing = _Hashing(raw)
            cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
            names = ["manifest.json", *(e["name"] for e in entries)]
            with (
                cctx.stream_writer(cast(IO[bytes], hashing), closefd=False) as compressed,
                tarfile.open(fileobj=compressed, mode="w|", format=tarfile.PAX_FORMAT) as tar,
            ):
                for name, data in zip(names, [manifest_bytes, *payloads], strict=True):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    info.mtime = mtime
                    info.mode = 0o644
                    tar.addfile(info, io.BytesIO(data))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return WrittenArchive(path=dest, sha256=digest.hexdigest(), size=hashing.size, manifest=full)


class _CountingReader(io.RawIOBase):
    """Counts compressed bytes read so the decompression ratio can be capped."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:  # type: ignore[override]
        data = self.raw.read(len(b))
        n = len(data)
        b[:n] = data
        self.count += n
        return n


class _CappedStream(io.RawIOBase):
    """The decompressed stream, refusing to produce more than the caps allow."""

    def __init__(self, inner: IO[bytes], counter: _CountingReader, limits: ArchiveLimits) -> None:
        self.inner = inner
        self.counter = counter
        self.limits = limits
        self.produced = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:  # type: ignore[override]
        data = self.inner.read(len(b))
        n = len(data)
        b[:n] = data
        self.produced += n
        # tar framing adds headers and padding: allow 1 MiB plus 2 KiB per possible member over the cap
        if self.produced > self.limits.max_total_bytes + (1 << 20) + 2048 * self.limits.max_members:
            raise ArchiveError(f"archive expands past {self.limits.max_total_bytes} bytes")
        if self.produced > self.limits.ratio_slack_bytes and self.produced > self.limits.max_ratio * max(
            1, self.counter.count
        ):
            raise ArchiveError(f"archive expands more than {self.limits.max_ratio:g}x (a decompression bomb?); refused")
        return n


def _validate_manifest(manifest: Any) -> dict[str, Any]:
    if not isinstance(manifest, dict):
        raise ArchiveError("manifest.json is not a JSON object")
    if manifest.get("kind") != KIND:
        raise ArchiveError(f"manifest.json kind is {manifest.get('kind')!r}, expected {KIND!r}")
    if not _is_int(manifest.get("schema_version")) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArchiveError(f"unsupported archive schema_version {manifest.get('schema_version')!r}")
    members = manifest.get("members")
    if not isinstance(members, list):
        raise ArchiveError("manifest.json has no members list")
    seen = set()
    for entry in members:
        if not isinstance(entry, dict):
            raise ArchiveError("manifest member entry is not an object")
        name, size, sha = entry.get("name"), entry.get("size"), entry.get("sha256")
        if not member_name_allowed(name) or name == "manifest.json":
            raise ArchiveError(f"manifest lists a member with a disallowed name: {name!r}")
        if name in seen:
            raise ArchiveError(f"manifest lists {name!r} twice")
        seen.add(name)
        if not _is_int(size) or size < 0:
            raise ArchiveError(f"manifest member {name!r} has an invalid size")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ArchiveError(f"manifest member {name!r} has an invalid sha256")
        if not _is_int(entry.get("records", 0)) or entry.get("records", 0) < 0:
            raise ArchiveError(f"manifest member {name!r} has an invalid record count")
    for key in ("workload_id", "node"):
        if not isinstance(manifest.get(key), str):
            raise ArchiveError(f"manifest.json {key} is missing or not a string")
    return manifest


def read_archive(
    source: Path | str | IO[bytes], limits: ArchiveLimits | None = None
) -> tuple[dict[str, Any], Iterator[tuple[str, bytes]]]:
    """Open an archive and return ``(manifest, members)``; ``members`` yields ``(name, bytes)`` in order.

    The manifest is read and validated before this returns; members are read lazily, verified
    against the manifest (size and sha256) one at a time, and the iterator raises ArchiveError on
    the first problem (so a consumer that stores as it goes must treat the archive as a whole and
    discard partial results on error). Reading to the end also checks that no listed member is missing.
    """
    limits = limits or ArchiveLimits()
    owned = None
    if isinstance(source, (str, Path)):
        try:
            owned = open(source, "rb")  # noqa: SIM115 - closed by the iterator or on error below
        except OSError as exc:
            raise ArchiveError(f"{source}: cannot open ({exc.strerror})") from exc
        fileobj: IO[bytes] = owned
    else:
        fileobj = source
    counter = _CountingReader(fileobj)
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=1 << 27)
        inner = dctx.stream_reader(io.BufferedReader(counter, 1 << 16), read_across_frames=True)
        capped = io.BufferedReader(_CappedStream(inner, counter, limits), 1 << 16)
        tar = tarfile.open(fileobj=capped, mode="r|")  # noqa: SIM115 - lives as long as the member iterator
        first = _next_member(tar, limits, 0)
        if first is None or first.name != "manifest.json":
            raise ArchiveError("first member is not manifest.json")
        if first.size > limits.max_manifest_bytes:
            raise ArchiveError(f"manifest.json is larger than {limits.max_manifest_bytes} bytes")
        raw_manifest = _read_member(tar, first)
        try:
            manifest = loads_bounded(
                raw_manifest, what="manifest.json", max_bytes=limits.max_manifest_bytes, max_depth=MANIFEST_MAX_DEPTH
            )
        except JSONLimitError as exc:
            raise ArchiveError(str(exc)) from None
        manifest = _validate_manifest(manifest)
        if len(manifest["members"]) + 1 > limits.max_members:
            raise ArchiveError(f"archive lists more than {limits.max_members} members")
    except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError) as exc:
        if owned:
            owned.close()
        raise ArchiveError(f"not a readable tar+zstd archive: {exc}") from exc
    except BaseException:
        if owned:
            owned.close()
        raise

    expected = {entry["name"]: entry for entry in manifest["members"]}

    def members() -> Iterator[tuple[str, bytes]]:
        total = 0
        count = 1
        seen: set[str] = set()
        try:
            while True:
                info = _next_member(tar, limits, count)
                if info is None:
                    break
                count += 1
                entry = expected.get(info.name)
                if entry is None:
                    raise ArchiveError(f"member {info.name!r} is not listed in the manifest")
                if info.name in seen:
                    raise ArchiveError(f"member {info.name!r} appears twice")
                seen.add(info.name)
                if info.size != entry["size"]:
                    raise ArchiveError(f"member {info.name!r} is {info.size} bytes, manifest says {entry['size']}")
                if info.size > limits.max_member_bytes:
                    raise ArchiveError(f"member {info.name!r} is larger than {limits.max_member_bytes} bytes")
                total += info.size
                if total > limits.max_total_bytes:
                    raise ArchiveError(f"members total more than {limits.max_total_bytes} bytes")
                data = _read_member(tar, info)
                if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                    raise ArchiveError(f"member {info.name!r} does not match its sha256 in the manifest")
                yield info.name, data
            missing = set(expected) - seen
            if missing:
                raise ArchiveError(f"archive is missing listed members: {', '.join(sorted(missing))}")
        except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError) as exc:
            raise ArchiveError(f"archive is corrupt or truncated: {exc}") from exc
        finally:
            if owned:
                owned.close()

    return manifest, members()


def _next_member(tar: tarfile.TarFile, limits: ArchiveLimits, count: int) -> tarfile.TarInfo | None:
    info = tar.next()
    if info is None:
        return None
    if count + 1 > limits.max_members:
        raise ArchiveError(f"archive has more than {limits.max_members} members")
    if not member_name_allowed(info.name):
        raise ArchiveError(f"member name {info.name!r} is not allowed")
    if not info.isreg():
        raise ArchiveError(f"member {info.name!r} is not a regular file")
    return info


def _read_member(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(info)
    if handle is None:
        raise ArchiveError(f"member {info.name!r} has no data")
    data = handle.read()
    if len(data) != info.size:
        raise ArchiveError(f"member {info.name!r} is truncated")
    return data


def file_sha256(path: Path | str) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
