"""The event driver against an in-process fake plugin (a table of cffi callbacks): order, parents, mask."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from comminsight.simulator import abi
from comminsight.simulator.driver import ProfilerDriver
from comminsight.simulator.plan import Op

ALL = 0xFFF
BIT = {name: abi.event_bit(name) for name in ("Group", "Coll", "P2p", "ProxyOp", "ProxyStep", "KernelCh", "GroupApi",
                                              "CollApi", "P2pApi", "KernelLaunch")}  # fmt: skip
NAME = {bit: name for name, bit in BIT.items()}


@dataclass
class Event:
    kind: str
    handle: int
    parent: int
    rank: int
    descr: dict = field(default_factory=dict)


class FakePlugin:
    """Records every call; hands out increasing fake handles, NULL for the types in ``refuse``."""

    def __init__(self, version: int = 5, mask: int = ALL, refuse: tuple[str, ...] = (), init_result: int = 0) -> None:
        self.ffi = abi.ffi()
        self.version = version
        self.calls: list[tuple] = []
        self.events: dict[int, Event] = {}
        self.next_handle = 0x1000
        self.refuse = refuse
        self.mask = mask
        self.init_result = init_result
        self.init_names: list[str | None] = []
        descr_type = f"ncclProfilerEventDescr_v{version}_t*"
        args_type = f"ncclProfilerEventStateArgs_v{version}_t*"
        f = self.ffi
        if version == 5:
            init_sig = "int(void**, uint64_t, int*, const char*, int, int, int, ncclDebugLogger_t)"

            def init(ctx, comm_id, mask_ptr, name, nnodes, nranks, rank, logfn):
                return self._init(ctx, comm_id, mask_ptr, name, nnodes, nranks, rank)
        else:
            init_sig = "int(void**, int*, const char*, uint64_t, int, int, int, ncclDebugLogger_t)"

            def init(ctx, mask_ptr, name, comm_hash, nnodes, nranks, rank, logfn):
                return self._init(ctx, comm_hash, mask_ptr, name, nnodes, nranks, rank)

        self.callbacks = [
            f.callback(init_sig, init),
            f.callback(f"int(void*, void**, {descr_type})", self._start),
            f.callback("int(void*)", self._stop),
            f.callback(f"int(void*, int, {args_type})", self._record),
            f.callback("int(void*)", self._finalize),
        ]
        self.table = f.new(f"ncclProfiler_v{version}_t*")
        (
            self.table.init,
            self.table.startEvent,
            self.table.stopEvent,
            self.table.recordEventState,
            self.table.finalize,
        ) = self.callbacks

    def plugin(self) -> abi.PluginTable:
        return abi.PluginTable(self.table, self.version, keepalive=self)

    def _init(self, ctx, comm_id, mask_ptr, name, nnodes, nranks, rank):
        text = None if name == self.ffi.NULL else self.ffi.string(name).decode()
        self.init_names.append(text)
        self.calls.append(("init", comm_id, nnodes, nranks, rank))
        mask_ptr[0] = self.mask
        ctx[0] = self.ffi.NULL if self.init_result else self.ffi.cast("void*", 0xC0 + len(self.init_names))
        return self.init_result

    def _start(self, ctx, handle_ptr, descr):
        kind = NAME[int(descr.type)]
        parent = int(self.ffi.cast("uintptr_t", descr.parentObj))
        detail = {}
        if kind == "Coll":
            detail = {"seq": descr.coll.seqNumber, "func": self.ffi.string(descr.coll.func).decode(),
                      "count": descr.coll.count, "dtype": self.ffi.string(descr.coll.datatype).decode(),
                      "nChannels": descr.coll.nChannels}  # fmt: skip
            if self.version == 5:
                detail["parentGroup"] = int(self.ffi.cast("uintptr_t", descr.coll.parentGroup))
        elif kind == "P2p":
            detail = {"func": self.ffi.string(descr.p2p.func).decode(), "peer": descr.p2p.peer}
        elif kind == "CollApi":
            detail = {"count": descr.collApi.count, "dtype": self.ffi.string(descr.collApi.datatype).decode()}
        elif kind == "KernelCh":
            detail = {"pTimer": descr.kernelCh.pTimer, "channel": descr.kernelCh.channelId}
        if kind in self.refuse:
            handle = 0
        else:
            self.next_handle += 0x10
            handle = self.next_handle
        self.events[handle] = Event(kind, handle, parent, descr.rank, detail)
        self.calls.append(("start", kind, handle, parent))
        handle_ptr[0] = self.ffi.cast("void*", handle)
        return 0

    def _stop(self, handle):
        value = int(self.ffi.cast("uintptr_t", handle))
        self.calls.append(("stop", self.events[value].kind, value))
        return 0

    def _record(self, handle, state, args):
        value = int(self.ffi.cast("uintptr_t", handle))
        p_timer = None if args == self.ffi.NULL else int(args.kernelCh.pTimer)
        self.calls.append(("record", self.events[value].kind, state, p_timer))
        return 0

    def _finalize(self, ctx):
        self.calls.append(("finalize", int(self.ffi.cast("uintptr_t", ctx))))
        return 0

    def sequence(self) -> list[tuple[str, str]]:
        return [(c[0], c[1]) for c in self.calls if c[0] in ("start", "stop", "record")]

    def started(self, kind: str) -> list[Event]:
        return [self.events[c[2]] for c in self.calls if c[0] == "start" and c[1] == kind]


def _driver(fake: FakePlugin) -> ProfilerDriver:
    return ProfilerDriver(fake.plugin())


def _run_op(driver: ProfilerDriver, comm, op: Op, start: int = 1_000, end: int = 9_000) -> None:
    for item in driver.enqueue(comm, [op]):
        driver.kernels_start(item, start)
        driver.kernels_stop(item, end)


ALLREDUCE = Op("AllReduce", 0, 1 << 20, "ncclFloat32")


def test_v5_collective_events_arrive_in_nccls_order_with_nccls_parents() -> None:
    fake = FakePlugin(version=5)
    driver = _driver(fake)
    comm = driver.init_communicator(0xABC, nranks=4, nnodes=1, rank=2, name="world")
    _run_op(driver, comm, ALLREDUCE)

    assert fake.sequence() == [
        ("start", "GroupApi"), ("record", "GroupApi"), ("start", "CollApi"), ("stop", "CollApi"),
        ("record", "GroupApi"), ("start", "Group"), ("start", "Coll"), ("start", "KernelLaunch"),
        ("stop", "KernelLaunch"), ("stop", "Coll"), ("stop", "Group"), ("stop", "GroupApi"),
        ("start", "KernelCh"), ("start", "KernelCh"), ("record", "KernelCh"), ("stop", "KernelCh"),
        ("record", "KernelCh"), ("stop", "KernelCh"),
    ]  # fmt: skip
    (group_api,), (coll_api,), (group,), (coll,) = (fake.started(k) for k in ("GroupApi", "CollApi", "Group", "Coll"))
    assert coll_api.parent == group_api.handle
    assert coll.parent == coll_api.handle
    assert coll.descr["parentGroup"] == group.handle
    assert all(k.parent == coll.handle for k in fake.started("KernelCh"))
    assert (group_api.rank, coll_api.rank) == (0, 0), "API events always carry rank 0"
    assert coll.rank == 2
    assert fake.calls[0] == ("init", 0xABC, 1, 4, 2)


def test_kernel_channels_carry_gpu_start_and_stop_times_in_ptimer() -> None:
    fake = FakePlugin()
    driver = _driver(fake)
    comm = driver.init_communicator(1, 2, 1, 0, "w")
    _run_op(driver, comm, ALLREDUCE, start=5_000_000, end=7_000_000)

    starts = [e.descr["pTimer"] for e in fake.started("KernelCh")]
    stops = [c[3] for c in fake.calls if c[0] == "record" and c[1] == "KernelCh"]
    assert min(starts) == 5_000_000
    assert max(stops) == 7_000_000
    assert {c[2] for c in fake.calls if c[0] == "record" and c[1] == "KernelCh"} == {abi.event_state("KernelChStop")}
    assert len(starts) == fake.started("Coll")[0].descr["nChannels"], "one KernelCh per announced channel"


def test_v4_has_no_api_events_and_the_coll_parent_is_the_group() -> None:
    fake = FakePlugin(version=4, mask=BIT["Coll"] | BIT["KernelCh"])
    driver = _driver(fake)
    comm = driver.init_communicator(0x77, nranks=2, nnodes=1, rank=1, name="dp")
    _run_op(driver, comm, ALLREDUCE)

    kinds = {kind for _, kind in fake.sequence()}
    assert kinds == {"Group", "Coll", "KernelCh"}
    assert fake.started("Coll")[0].parent == fake.started("Group")[0].handle
    assert fake.calls[0] == ("init", 0x77, 1, 2, 1), "v4 passes commHash as the fourth argument"


def test_a_type_is_emitted_only_when_it_or_a_descendant_is_in_the_mask() -> None:
    fake = FakePlugin(mask=BIT["Coll"] | BIT["KernelCh"])
    driver = _driver(fake)
    comm = driver.init_communicator(1, nranks=4, nnodes=2, rank=0, name="w")  # spans nodes: proxies possible
    _run_op(driver, comm, ALLREDUCE)

    kinds = {kind for _, kind in fake.sequence()}
    # NCCL starts the parents of what was asked for, and nothing else.
    assert kinds == {"GroupApi", "CollApi", "Group", "Coll", "KernelCh"}


def test_a_zero_mask_emits_nothing_but_sequence_numbers_still_advance() -> None:
    fake = FakePlugin(mask=0)
    driver = _driver(fake)
    comm = driver.init_communicator(1, 2, 1, 0, "w")
    _run_op(driver, comm, ALLREDUCE)
    fake.mask = ALL
    driver.init_communicator(2, 2, 1, 0, "other")  # any init may rewrite the process-wide mask
    _run_op(driver, comm, ALLREDUCE)

    assert [e.descr["seq"] for e in fake.started("Coll")] == [1]


def test_proxy_events_come_only_for_communicators_that_span_nodes() -> None:
    fake = FakePlugin()
    driver = _driver(fake)
    local = driver.init_communicator(1, 4, 1, 0, "local")
    spread = driver.init_communicator(2, 4, 2, 0, "spread")
    _run_op(driver, local, ALLREDUCE)
    assert not fake.started("ProxyOp")
    before = len(fake.calls)
    _run_op(driver, spread, ALLREDUCE)

    coll = fake.started("Coll")[-1]
    proxies = fake.started("ProxyOp")
    assert proxies
    assert all(p.parent == coll.handle for p in proxies)
    assert all(s.parent in {p.handle for p in proxies} for s in fake.started("ProxyStep"))
    calls = fake.calls[before:]
    last_proxy_stop = max(i for i, c in enumerate(calls) if c[:2] == ("stop", "ProxyOp"))
    first_kernel_stop = min(i for i, c in enumerate(calls) if c[:2] == ("stop", "KernelCh"))
    assert last_proxy_stop < first_kernel_stop


def test_a_null_handle_is_untracked_and_its_children_get_a_null_parent() -> None:
    fake = FakePlugin(refuse=("Coll", "Group"))
    driver = _driver(fake)
    comm = driver.init_communicator(1, 2, 1, 0, "w")
    _run_op(driver, comm, ALLREDUCE)

    assert all(k.parent == 0 for k in fake.started("KernelCh"))
    assert not [c for c in fake.calls if c[0] == "stop" and c[1] in ("Coll", "Group")], "NULL handles are never stopped"
    assert fake.started("Coll")[0].descr["parentGroup"] == 0


def test_sequence_numbers_count_per_function_and_communicator() -> None:
    fake = FakePlugin()
    driver = _driver(fake)
    a = driver.init_communicator(1, 2, 1, 0, "a")
    b = driver.init_communicator(2, 2, 1, 0, "b")
    for comm, op in [(a, ALLREDUCE), (a, ALLREDUCE), (b, ALLREDUCE), (a, Op("Broadcast", 0, 8, "ncclFloat32", peer=1))]:
        _run_op(driver, comm, op)
    _run_op(driver, a, ALLREDUCE)

    assert [(e.descr["func"], e.descr["seq"]) for e in fake.started("Coll")] == [
        ("AllReduce", 0), ("AllReduce", 1), ("AllReduce", 0), ("Broadcast", 0), ("AllReduce", 2),
    ]  # fmt: skip


def test_a_one_rank_communicator_emits_api_events_but_no_coll() -> None:
    fake = FakePlugin()
    driver = _driver(fake)
    solo = driver.init_communicator(1, nranks=1, nnodes=1, rank=0, name="solo")
    _run_op(driver, solo, ALLREDUCE)

    assert {kind for _, kind in fake.sequence()} == {"GroupApi", "CollApi"}


def test_allgather_counts_bytes_of_int8_while_the_api_event_keeps_the_users_count() -> None:
    fake = FakePlugin()
    driver = _driver(fake)
    comm = driver.init_communicator(1, 2, 1, 0, "w")
    _run_op(driver, comm, Op("AllGather", 0, 1000, "ncclBfloat16"))

    coll = fake.started("Coll")[0].descr
    assert (coll["count"], coll["dtype"]) == (2000, "ncclInt8")
    assert fake.started("CollApi")[0].descr == {"count": 1000, "dtype": "ncclBfloat16"}


def test_p2p_events_carry_the_peer_and_the_p2p_api_parent() -> None:
    fake = FakePlugin()
    driver = _driver(fake)
    comm = driver.init_communicator(1, 2, 1, 0, "pp")
    items = driver.enqueue(comm, [Op("Send", 0, 10, "ncclFloat32", peer=1), Op("Recv", 0, 10, "ncclFloat32", peer=1)])

    p2p = fake.started("P2p")
    assert [(e.descr["func"], e.descr["peer"]) for e in p2p] == [("Send", 1), ("Recv", 1)]
    assert [e.parent for e in p2p] == [e.handle for e in fake.started("P2pApi")]
    assert (len(fake.started("Group")), len(fake.started("GroupApi"))) == (1, 1), "one group for both"
    assert [item.seq for item in items] == [-1, -1]


def test_comm_name_may_be_null_and_the_buffer_is_not_kept_after_init() -> None:
    fake = FakePlugin()
    driver = _driver(fake)
    driver.init_communicator(1, 2, 1, 0, None)
    named = driver.init_communicator(2, 2, 1, 0, "tp0")

    assert fake.init_names == [None, "tp0"]
    assert named.name == "tp0"


def test_an_init_failure_opts_the_communicator_out() -> None:
    fake = FakePlugin(init_result=1)
    driver = _driver(fake)
    comm = driver.init_communicator(1, 2, 1, 0, "w")
    _run_op(driver, comm, ALLREDUCE)
    driver.finalize(comm)

    assert [c[0] for c in fake.calls] == ["init"], "no events and no finalize for a NULL context"


def test_finalize_is_called_once_per_communicator() -> None:
    fake = FakePlugin()
    driver = _driver(fake)
    comm = driver.init_communicator(1, 2, 1, 0, "w")
    driver.finalize(comm)
    driver.finalize(comm)

    assert [c[0] for c in fake.calls].count("finalize") == 1


def test_loading_a_missing_or_foreign_library_fails_clearly(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        abi.load_plugin(tmp_path / "missing.so")
    garbage = tmp_path / "garbage.so"
    garbage.write_bytes(b"\x7fELF not really" * 100)
    with pytest.raises(ValueError, match="cannot load"):
        abi.load_plugin(garbage)
    with pytest.raises(ValueError, match="does not export ncclProfiler_v5"):
        abi.load_plugin("/lib/x86_64-linux-gnu/libc.so.6" if abi.Path("/lib/x86_64-linux-gnu/libc.so.6").exists()
                        else "/lib64/libc.so.6")  # fmt: skip
    with pytest.raises(ValueError, match="unsupported"):
        abi.load_plugin(garbage, version=3)
