"""The site's one storage layer behaves the same on the local data directory and on a real S3 server."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from django.core.exceptions import ImproperlyConfigured

from comminsight_site.objectstore import ObjectStoreError, object_store, parse_storage_url


@pytest.fixture(params=["local", "s3"])
def store(request, settings, data_dir):
    if request.param == "s3":
        request.getfixturevalue("s3_storage")
    else:
        settings.STORAGE_URL = ""
    return object_store()


def test_a_file_put_in_the_store_reads_back_identically_and_its_location_names_the_backend(store, tmp_path):
    source = tmp_path / "archive.tar.zst"
    payload = os.urandom(3 << 20) + b"tail"
    source.write_bytes(payload)
    location = store.put_file(source, "archives/ab/abcdef")
    assert not source.exists()  # moved, not copied
    assert location.startswith("s3://") == store.remote
    assert store.exists(location)
    assert store.size(location) == len(payload)
    assert store.read_bytes(location) == payload
    with store.local_file(location, scratch=tmp_path / "scratch") as local:
        assert local.read_bytes() == payload
    assert not list((tmp_path / "scratch").glob("*"))  # a remote object's temporary copy is gone


def test_an_object_larger_than_one_chunk_streams_into_the_store(store, tmp_path):
    source = tmp_path / "big.bin"
    with open(source, "wb") as out:
        for i in range(20):  # 20 MiB: several multipart parts on S3
            out.write(bytes([i]) * (1 << 20))
    location = store.put_file(source, "archives/big.bin", move=False)
    assert source.exists()
    with store.open_input(location) as handle:
        handle.seek(19 << 20)
        assert handle.read(4) == bytes([19]) * 4
    assert store.size(location) == 20 << 20


def test_parquet_objects_read_as_one_dataset_and_a_prefix_deletes_as_one(store, tmp_path):
    for rank in range(3):
        path = tmp_path / f"rank-{rank}.parquet"
        pq.write_table(pa.table({"rank": [rank] * 4, "seq": list(range(4))}), path)
        store.put_file(path, f"store/workload-7/node-a/rank-{rank}/sha.parquet")
    store.write_bytes("store/workload-8/node-a/rank-0/other.parquet", b"not read")
    locations = store.list("store/workload-7", suffix=".parquet")
    assert len(locations) == 3
    table = store.dataset(locations).to_table()
    assert sorted(table["rank"].to_pylist()) == [0] * 4 + [1] * 4 + [2] * 4
    store.delete_prefix("store/workload-7")
    assert store.list("store/workload-7") == []
    assert len(store.list("store/workload-8")) == 1  # the neighbour is untouched
    store.delete_prefix("store/workload-7")  # deleting what is gone is not an error


def test_a_missing_object_is_a_clear_error_and_deleting_it_is_harmless(store):
    location = store.location("archives/none")
    assert not store.exists(location)
    with pytest.raises(ObjectStoreError, match="archives/none"):
        store.read_bytes(location)
    store.delete(location)


@pytest.mark.parametrize("key", ["", "../escape", "a/../../b", "a//b", "./a"])
def test_keys_that_would_leave_the_store_are_refused(store, key):
    with pytest.raises(ObjectStoreError, match="not an object key"):
        store.location(key)


@pytest.mark.parametrize("key", ["archives/a.tar.zst", "exports/trace.json.gz"])
def test_keys_named_like_compressed_files_are_refused_because_some_servers_rewrite_them(store, key):
    with pytest.raises(ObjectStoreError, match="compression suffix"):
        store.location(key)


@pytest.mark.parametrize(
    "url",
    [
        "ftp://bucket/x",
        "s3://",
        "s3:///prefix",
        "/var/data",
        "s3://bucket/a?endpoint=http://evil",
        "s3://bucket/a/../b",
    ],
)
def test_a_storage_url_that_is_not_a_bucket_prefix_fails_at_start(url):
    with pytest.raises(ImproperlyConfigured, match="COMMINSIGHT_STORAGE_URL"):
        parse_storage_url(url)


def test_a_bucket_prefix_url_names_its_bucket_and_prefix():
    assert parse_storage_url("s3://traces/site-a/") == ("traces", "site-a")
    assert parse_storage_url("s3://traces") == ("traces", "")
