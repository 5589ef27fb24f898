"""The straggler analysis' references (lower quartile and median per operation) taken from windows by counting
passes (``comminsight.analysis.keyed_quantiles``) equal polars' quantile over every value at once, to the bit."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import polars as pl
import pytest

from comminsight.analysis import keyed_quantiles as kq

QS = (0.25, 0.5)


def _polars(key: np.ndarray, values: np.ndarray, n_keys: int) -> np.ndarray:
    frame = pl.DataFrame({"k": key, "v": values}).filter(pl.col("v").is_not_nan())
    out = np.full((n_keys, len(QS)), np.nan)
    for i, q in enumerate(QS):
        got = frame.group_by("k").agg(pl.col("v").quantile(q, "linear"))
        out[got.get_column("k").to_numpy(), i] = got.get_column("v").to_numpy()
    return out


def _in_parts(key: np.ndarray, values: np.ndarray, parts: int, seed: int) -> tuple[kq.Parts, list[int]]:
    cuts = np.sort(np.random.default_rng(seed).integers(0, key.size, parts - 1))
    pieces = list(zip(np.split(key, cuts), np.split(values, cuts), strict=True))
    reads: list[int] = []

    def read() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        reads.append(1)
        yield from pieces

    return read, reads


def _straggler_like(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    # Durations in ns, rounded (ties), a slow member now and then 1,000 times longer: the healthy values crowd
    # the bottom of each key's range, where the quartile is.
    n_keys, n = 12, 300_000
    key = rng.integers(0, n_keys, n)
    values = np.round(rng.gamma(2.0, 1e6, n))
    values[::997] *= 1000.0
    values[::101] = np.nan
    return key, values, n_keys + 2  # two keys without values


def _small(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    key = rng.integers(0, 40, 2_000)
    return key, rng.standard_normal(2_000), 40


def _equal_and_adjacent(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    # One key of equal values, one of consecutive floats (no bin can split an interval of two adjacent floats).
    equal = np.full(5_000, 7.0)
    adjacent = 1.0 + np.arange(5_000) * np.finfo(float).eps
    key = np.r_[np.zeros(5_000, np.int64), np.ones(5_000, np.int64)]
    order = rng.permutation(key.size)
    return key[order], np.r_[equal, adjacent][order], 2


@pytest.mark.parametrize("data", [_straggler_like, _small, _equal_and_adjacent])
def test_quantiles_from_parts_equal_polars_over_every_value(data) -> None:  # type: ignore[no-untyped-def]
    key, values, n_keys = data(np.random.default_rng(3))
    parts, reads = _in_parts(key, values, 17, seed=4)
    got = kq.keyed_quantiles(parts, n_keys, QS)
    assert np.array_equal(got, _polars(key, values, n_keys), equal_nan=True)
    assert len(reads) >= 2  # read in passes, not held


def test_no_pass_collects_more_than_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    key, values, n_keys = _straggler_like(np.random.default_rng(5))
    parts, reads = _in_parts(key, values, 9, seed=6)
    monkeypatch.setattr(kq, "COLLECT", 64)
    concatenated: list[int] = []
    real = np.concatenate

    def counting(arrays, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(arrays, *args, **kwargs)
        concatenated.append(out.size)
        return out

    monkeypatch.setattr(kq.np, "concatenate", counting)
    got = kq.keyed_quantiles(parts, n_keys, QS)
    monkeypatch.undo()
    assert np.array_equal(got, _polars(key, values, n_keys), equal_nan=True)
    # The last pass collects, per key and wanted rank, one interval of at most COLLECT values (plus its ties).
    assert max(concatenated) <= n_keys * 64 * 2
    assert len(reads) > 3  # refined in several passes
