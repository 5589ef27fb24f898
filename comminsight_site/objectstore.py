"""Where the site keeps the bytes every web and worker host needs: stored archives, the Parquet
operations store and analysis artefacts (Perfetto traces).

One storage layer over pyarrow's filesystems, chosen once by ``COMMINSIGHT_STORAGE_URL``:

- empty (the embedded default): the local data directory, ``COMMINSIGHT_SERVER_DATA_DIR``;
- ``s3://bucket/prefix``: any S3-compatible service (AWS S3, MinIO, Ceph, SeaweedFS) through
  ``pyarrow.fs.S3FileSystem``, configured by the standard variables ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` and, for a non-AWS endpoint, ``AWS_ENDPOINT_URL``.

Objects are named by keys (``store/workload-1/node-a/rank-0/<sha256>.parquet``). What the database keeps
for an object is its *location*: the absolute path for the local backend (as before this layer existed,
so old rows stay readable) and ``s3://bucket/prefix/key`` for S3. Writes stream in chunks (S3 multipart
upload under pyarrow), never a whole object in memory; a local "put" of a file already on the data
directory's filesystem is an atomic rename.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.dataset as ds
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from pyarrow import fs

CHUNK_BYTES = 8 << 20
# Some S3-compatible servers (SeaweedFS) take an object named *.gz or *.zst for pre-compressed content and
# hand back other bytes than were stored; keys never end that way (archives are named by sha256 alone).
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd", ".br", ".bz2", ".xz", ".lz4")
S3_SCHEME = "s3://"


class ObjectStoreError(OSError):
    """The object store refused or failed an operation (missing object, unreachable service)."""


@dataclass(frozen=True)
class ObjectStore:
    """One bucket prefix or one local directory, addressed by keys."""

    filesystem: fs.FileSystem
    base: str  # filesystem path of the root: "/abs/data" or "bucket/prefix"
    remote: bool

    # ---- names ----
    def path(self, key: str) -> str:
        key = key.strip("/")
        if not key or any(part in {"", ".", ".."} for part in key.split("/")):
            raise ObjectStoreError(f"not an object key: {key!r}")
        if key.lower().endswith(COMPRESSED_SUFFIXES):
            raise ObjectStoreError(f"object keys must not end in a compression suffix: {key!r}")
        return f"{self.base}/{key}"

    def location(self, key: str) -> str:
        """What the database keeps for ``key``."""
        path = self.path(key)
        return S3_SCHEME + path if self.remote else path

    def _fs_path(self, location: str) -> str:
        if location.startswith(S3_SCHEME):
            if not self.remote:
                raise ObjectStoreError(f"{location} is in object storage, but this site uses a local directory")
            return location[len(S3_SCHEME) :]
        # a local path: this site's directory, or a row written before the site moved to object storage
        return location

    def _fs_for(self, location: str) -> fs.FileSystem:
        return self.filesystem if (location.startswith(S3_SCHEME) or not self.remote) else fs.LocalFileSystem()

    # ---- writes ----
    def put_file(self, source: Path, key: str, *, move: bool = True) -> str:
        """Store the local file ``source`` as ``key``; return its location. ``move`` removes the source."""
        if not self.remote:
            target = Path(self.path(key))
            target.parent.mkdir(parents=True, exist_ok=True)
            if move:
                try:
                    Path(source).replace(target)
                    _fsync_dir(target.parent)  # durable before a database row says the bytes are stored
                    return str(target)
                except OSError:
                    pass  # another filesystem: copy below
            tmp = target.with_name(f".{target.name}.tmp")
            try:
                shutil.copyfile(source, tmp)
                tmp.replace(target)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk must not keep a half copy
                raise
            if move:
                Path(source).unlink(missing_ok=True)
            return str(target)
        try:
            with open(source, "rb") as src, self.filesystem.open_output_stream(self.path(key)) as out:
                while chunk := src.read(CHUNK_BYTES):
                    out.write(chunk)
        except OSError as exc:
            raise ObjectStoreError(f"cannot store {key}: {exc}") from exc
        if move:
            Path(source).unlink(missing_ok=True)
        return self.location(key)

    def move(self, location: str, key: str) -> str:
        """Move the object at ``location`` to ``key`` (quarantine); return the new location."""
        if not location.startswith(S3_SCHEME):
            return self.put_file(Path(location), key, move=True)
        try:
            self.filesystem.move(self._fs_path(location), self.path(key))
        except OSError as exc:
            raise ObjectStoreError(f"cannot move {location}: {exc}") from exc
        return self.location(key)

    def write_bytes(self, key: str, data: bytes) -> str:
        if not self.remote:
            target = Path(self.path(key))
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_bytes(data)
            tmp.replace(target)
            return str(target)
        try:
            with self.filesystem.open_output_stream(self.path(key)) as out:
                out.write(data)
        except OSError as exc:
            raise ObjectStoreError(f"cannot store {key}: {exc}") from exc
        return self.location(key)

    # ---- reads ----
    def exists(self, location: str) -> bool:
        try:
            info = self._fs_for(location).get_file_info(self._fs_path(location))
        except OSError:
            return False
        return info.type == fs.FileType.File

    def size(self, location: str) -> int:
        info = self._fs_for(location).get_file_info(self._fs_path(location))
        if info.type != fs.FileType.File:
            raise ObjectStoreError(f"no object at {location}")
        return int(info.size)

    def open_input(self, location: str) -> pa.NativeFile:
        """A seekable reader (random access for Parquet footers and range reads)."""
        try:
            return self._fs_for(location).open_input_file(self._fs_path(location))
        except (OSError, FileNotFoundError) as exc:
            raise ObjectStoreError(f"cannot read {location}: {exc}") from exc

    def open_stream(self, location: str) -> io.BufferedReader:
        """A plain Python binary stream of the object (for Django's FileResponse, which rebinds ``close``)."""
        return io.BufferedReader(_NativeReader(self.open_input(location)), CHUNK_BYTES)

    def read_bytes(self, location: str) -> bytes:
        with self.open_input(location) as handle:
            return handle.read()

    @contextlib.contextmanager
    def local_file(self, location: str, scratch: Path | None = None) -> Iterator[Path]:
        """The object as a local file for readers that need a path: the file itself when local, else a
        temporary copy streamed in chunks (removed on exit)."""
        if not location.startswith(S3_SCHEME):
            yield Path(location)
            return
        directory = scratch or Path(settings.DATA_DIR) / "tmp"
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, self.open_input(location) as src:
                while chunk := src.read(CHUNK_BYTES):
                    out.write(chunk)
            yield Path(name)
        finally:
            Path(name).unlink(missing_ok=True)

    def list(self, prefix: str, suffix: str = "") -> list[str]:
        """Locations of every object under key ``prefix`` whose name ends with ``suffix``, sorted."""
        selector = fs.FileSelector(self.path(prefix), recursive=True, allow_not_found=True)
        try:
            infos = self.filesystem.get_file_info(selector)
        except OSError as exc:
            raise ObjectStoreError(f"cannot list {prefix}: {exc}") from exc
        paths = sorted(
            i.path
            for i in infos
            if i.type == fs.FileType.File and i.path.endswith(suffix) and not i.base_name.startswith(".")
        )
        return [S3_SCHEME + p if self.remote else p for p in paths]

    def infos(self, locations: list[str]) -> list[tuple[str, int, int]]:
        """(location, size, modification time in ns) of each existing object, in the given order."""
        out = []
        for location in locations:
            try:
                info = self._fs_for(location).get_file_info(self._fs_path(location))
            except OSError:
                continue
            if info.type == fs.FileType.File:
                out.append((location, int(info.size), int(info.mtime_ns or 0)))
        return out

    def total_bytes(self, prefix: str) -> int:
        selector = fs.FileSelector(self.path(prefix), recursive=True, allow_not_found=True)
        try:
            return sum(int(i.size) for i in self.filesystem.get_file_info(selector) if i.type == fs.FileType.File)
        except OSError as exc:
            raise ObjectStoreError(f"cannot list {prefix}: {exc}") from exc

    def dataset(self, locations: list[str], schema: pa.Schema | None = None) -> ds.Dataset:
        """The Parquet objects at ``locations`` as one pyarrow dataset (scanned lazily, column-pruned)."""
        remote = [loc.startswith(S3_SCHEME) for loc in locations]
        if any(remote) and not all(remote):
            raise ObjectStoreError("a dataset cannot mix local files and object storage")
        paths = [self._fs_path(loc) for loc in locations]
        filesystem = self.filesystem if (locations and all(remote)) else fs.LocalFileSystem()
        return ds.dataset(paths, format="parquet", schema=schema, filesystem=filesystem)

    # ---- deletes ----
    def delete(self, location: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            try:
                self._fs_for(location).delete_file(self._fs_path(location))
            except OSError as exc:
                if self.exists(location):
                    raise ObjectStoreError(f"cannot delete {location}: {exc}") from exc

    def delete_prefix(self, prefix: str) -> None:
        """Every object under key ``prefix`` (a workload's store, an export directory)."""
        path = self.path(prefix)
        try:
            if self.filesystem.get_file_info(path).type == fs.FileType.NotFound:
                return
            self.filesystem.delete_dir(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ObjectStoreError(f"cannot delete {prefix}: {exc}") from exc


class _NativeReader(io.RawIOBase):
    """A pyarrow NativeFile as a raw Python stream."""

    def __init__(self, native: pa.NativeFile) -> None:
        self._native = native

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        data = self._native.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._native.close()
        super().close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_storage_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> ("bucket", "prefix"); raises ImproperlyConfigured for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ImproperlyConfigured(
            f"COMMINSIGHT_STORAGE_URL must be empty (the local data directory) or s3://bucket/prefix, not {url!r}"
        )
    if parts.query or parts.fragment:
        raise ImproperlyConfigured("COMMINSIGHT_STORAGE_URL takes no query or fragment: use the AWS_* variables")
    prefix = parts.path.strip("/")
    if prefix and any(part in {"", ".", ".."} for part in prefix.split("/")):
        raise ImproperlyConfigured(f"COMMINSIGHT_STORAGE_URL has an unusable prefix: {parts.path!r}")
    return parts.netloc, prefix


def s3_filesystem(endpoint_url: str, region: str, access_key: str, secret_key: str) -> fs.S3FileSystem:
    options: dict = {"region": region or "us-east-1", "connect_timeout": 5, "request_timeout": 60}
    if endpoint_url:
        endpoint = urlsplit(endpoint_url)
        if endpoint.scheme not in {"http", "https"} or not endpoint.netloc:
            raise ImproperlyConfigured(f"AWS_ENDPOINT_URL must be http(s)://host[:port], not {endpoint_url!r}")
        options["endpoint_override"] = endpoint.netloc
        options["scheme"] = endpoint.scheme
        # S3-compatible services are addressed by path (bucket in the path, not the host name)
        options["force_virtual_addressing"] = False
    if access_key or secret_key:
        options["access_key"] = access_key
        options["secret_key"] = secret_key
    return fs.S3FileSystem(**options)


_cache: dict[tuple, ObjectStore] = {}


def object_store() -> ObjectStore:
    """The site's store, as the settings say now (cached per configuration)."""
    url = settings.STORAGE_URL
    if not url:
        key: tuple = ("local", str(settings.DATA_DIR))
        if key not in _cache:
            _cache[key] = ObjectStore(fs.LocalFileSystem(), str(Path(settings.DATA_DIR).resolve()), remote=False)
        return _cache[key]
    s3 = settings.STORAGE_S3
    key = ("s3", url, s3["endpoint_url"], s3["region"], s3["access_key"])
    if key not in _cache:
        bucket, prefix = parse_storage_url(url)
        filesystem = s3_filesystem(s3["endpoint_url"], s3["region"], s3["access_key"], s3["secret_key"])
        _cache[key] = ObjectStore(filesystem, f"{bucket}/{prefix}" if prefix else bucket, remote=True)
    return _cache[key]


def check_reachable(store: ObjectStore) -> str:
    """'' when the store answers (bucket exists and is listable), else a one-line reason."""
    if not store.remote:
        return ""
    bucket = store.base.split("/", 1)[0]
    try:
        info = store.filesystem.get_file_info(bucket)
    except OSError as exc:
        return f"object storage does not answer: {exc}"
    if info.type == fs.FileType.NotFound:
        return f"bucket {bucket!r} does not exist"
    return ""
