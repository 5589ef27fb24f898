"""The event driver: NCCL's side of the profiler ABI, for one process.

``ProfilerDriver`` makes the calls NCCL 2.28 makes, in NCCL's order, through a ``PluginTable``
(a real ``.so`` or an in-process fake):

- ``init`` once per communicator (v5: ``commId`` second; v4: ``commHash`` fourth), with one
  process-wide ``int`` mask that every ``init`` may rewrite; ``commName`` may be NULL, and the
  name buffer is overwritten after ``init`` returns because NCCL does not keep it for the plugin;
- per ncclGroupStart/End (``enqueue``): GroupApi start, state GroupStartApiStop, CollApi/P2pApi
  start and stop per call, state GroupEndApiStart, then Group start, Coll/P2p start (parent: the
  already stopped API event; ``parentGroup``: the Group), KernelLaunch start/stop, Coll/P2p stop
  (= enqueued, not finished), Group stop, GroupApi stop. v4 has no API events and the Coll/P2p
  parent is the Group;
- on the "GPU" side (``kernels_start``/``kernels_stop``, usually from another thread, as NCCL's
  profiler and proxy threads do): per channel KernelCh start with ``pTimer`` = GPU start,
  ProxyOp (and ProxyStep) children for communicators that span nodes, then at the end
  recordEventState(KernelChStop, pTimer = GPU end) and KernelCh stop;
- ``finalize`` once per communicator.

The mask decides, like NCCL: an event type is started when its bit *or the bit of any of its
descendants* is set (asking for KernelCh brings Group, Coll, GroupApi and CollApi too). A NULL
handle back from ``startEvent`` means "not tracked": it is never stopped, and children started
under it get a NULL parent. Coll ``seqNumber`` counts per (communicator, function) whether or not
the profiler tracks it; communicators of one rank emit API events only (NCCL's one-rank shortcut).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from comminsight.simulator import abi

log = logging.getLogger(__name__)

_BIT = {name: abi.event_bit(name) for name in (
    "Group", "Coll", "P2p", "ProxyOp", "ProxyStep", "KernelCh", "NetPlugin", "GroupApi", "CollApi", "P2pApi",
    "KernelLaunch",
)}  # fmt: skip
# Which mask bits make NCCL start each event type (the type itself or any descendant).
_PROXY_STEP = _BIT["ProxyStep"] | _BIT["NetPlugin"]
_PROXY_OP = _BIT["ProxyOp"] | _PROXY_STEP
_TASK_CHILDREN = _PROXY_OP | _BIT["KernelCh"]
ENABLES = {
    "Coll": _BIT["Coll"] | _TASK_CHILDREN,
    "P2p": _BIT["P2p"] | _TASK_CHILDREN,
    "Group": _BIT["Group"] | _BIT["Coll"] | _BIT["P2p"] | _TASK_CHILDREN,
    "CollApi": _BIT["CollApi"] | _BIT["Coll"] | _TASK_CHILDREN,
    "P2pApi": _BIT["P2pApi"] | _BIT["P2p"] | _TASK_CHILDREN,
    "GroupApi": _BIT["GroupApi"] | _BIT["CollApi"] | _BIT["P2pApi"] | _BIT["KernelLaunch"] | _BIT["Group"]
    | _BIT["Coll"] | _BIT["P2p"] | _TASK_CHILDREN,
    "KernelLaunch": _BIT["KernelLaunch"],
    "KernelCh": _BIT["KernelCh"],
    "ProxyOp": _PROXY_OP,
    "ProxyStep": _PROXY_STEP,
}  # fmt: skip

_PROXY_STEPS = 4  # network steps per ProxyOp
_CHUNK_BYTES = 512 * 1024
_LARGE_BYTES = 64 * 1024  # above this a collective spreads over two channels


class OpLike(Protocol):
    """What the driver needs of an operation (``plan.Op`` is one)."""

    @property
    def func(self) -> str: ...

    @property
    def count(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def peer(self) -> int: ...

    @property
    def is_p2p(self) -> bool: ...

    @property
    def bytes(self) -> int: ...

    def coll_count_dtype(self) -> tuple[int, str]: ...


@dataclass
class CommunicatorContext:
    """A communicator as the driver holds it: the plugin's context and NCCL's per-comm counters."""

    comm_hash: int
    nranks: int
    nnodes: int
    rank: int
    name: str | None
    context: Any  # void** filled by init
    stream: int
    seq: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    finalized: bool = False

    @property
    def plugin_context(self) -> Any:
        """The ``void*`` the plugin returned from init (NULL: the plugin opted this communicator out)."""
        return self.context[0]


@dataclass
class Enqueued:
    """One operation after ``enqueue``: its event handle, sequence number and the children started later."""

    op: Any
    comm: CommunicatorContext
    handle: Any  # the Coll/P2p event handle (void*, may be NULL)
    mask: int  # the activation mask NCCL captured for this task
    seq: int  # Coll: seqNumber; P2P: -1
    n_channels: int
    one_rank: bool
    kernel_handles: list[Any] = field(default_factory=list)
    proxy_handles: list[tuple[Any, int]] = field(default_factory=list)  # (handle, isSend)


class ProfilerDriver:
    """Issues NCCL's profiler calls for one process; ``kernels_*`` may run on another thread."""

    def __init__(self, plugin: abi.PluginTable, *, poison_comm_names: bool = True) -> None:
        self.plugin = plugin
        self.ffi = abi.ffi()
        self.version = plugin.version
        self.mask = self.ffi.new("int*")  # NCCL's one process-wide ncclProfilerEventMask
        self.poison_comm_names = poison_comm_names
        self._strings: dict[str, Any] = {}
        self._lock = threading.Lock()  # only for the string cache; plugin calls are not serialised
        self._pid = os.getpid()
        self._logger = self._make_logger()
        self._state_kernel_stop = abi.event_state("KernelChStop")

    # ------------------------------------------------------------------ helpers

    def _make_logger(self) -> Any:
        # NCCL's logger is variadic, which cffi callbacks cannot be; a fixed-argument callback cast to
        # the variadic type receives the fixed arguments correctly on x86-64 and aarch64 (extra
        # arguments are ignored), which is all a simulator needs: the format string.
        def logger(level: int, flags: int, file: Any, line: int, fmt: Any) -> None:
            if fmt != self.ffi.NULL:
                log.debug("plugin log (level %d): %s", level, self.ffi.string(fmt).decode("utf-8", "replace"))

        self._logger_callback = self.ffi.callback("void(int, unsigned long, const char*, int, const char*)", logger)
        return self.ffi.cast("ncclDebugLogger_t", self._logger_callback)

    def cstr(self, text: str) -> Any:
        """A NUL-terminated string that lives as long as the driver (NCCL's strings are static)."""
        with self._lock:
            value = self._strings.get(text)
            if value is None:
                value = self._strings[text] = self.ffi.new("char[]", text.encode())
            return value

    def _descr(self, kind: str, parent: Any, rank: int = 0) -> Any:
        descr = self.ffi.new(f"{self.plugin.descriptor_type()}*")
        descr.type = _BIT[kind]
        descr.parentObj = parent
        descr.rank = rank
        return descr

    def _start(self, comm: CommunicatorContext, descr: Any) -> Any:
        handle = self.ffi.new("void**")
        result = self.plugin.table.startEvent(comm.plugin_context, handle, descr)
        if result != 0:
            log.debug("startEvent returned %d; treating the event as untracked", result)
            return self.ffi.NULL
        return handle[0]

    def _stop(self, handle: Any) -> None:
        if handle != self.ffi.NULL:
            self.plugin.table.stopEvent(handle)

    def _record(self, handle: Any, state: int, p_timer: int | None = None, trans_size: int | None = None) -> None:
        if handle == self.ffi.NULL:
            return
        if p_timer is None and trans_size is None:
            self.plugin.table.recordEventState(handle, state, self.ffi.NULL)
            return
        args = self.ffi.new(f"{self.plugin.state_args_type()}*")
        if p_timer is not None:
            args.kernelCh.pTimer = p_timer
        if trans_size is not None:
            args.proxyStep.transSize = trans_size
        self.plugin.table.recordEventState(handle, state, args)

    # ------------------------------------------------------------------ communicators

    def init_communicator(
        self, comm_hash: int, nranks: int, nnodes: int, rank: int, name: str | None, stream: int = 0
    ) -> CommunicatorContext:
        """Call the plugin's ``init`` for one communicator (``name`` None: commName NULL)."""
        context = self.ffi.new("void**")
        name_buffer = self.ffi.new("char[]", name.encode()) if name is not None else self.ffi.NULL
        if self.version == 5:
            result = self.plugin.table.init(
                context, comm_hash, self.mask, name_buffer, nnodes, nranks, rank, self._logger
            )
        else:
            result = self.plugin.table.init(
                context, self.mask, name_buffer, comm_hash, nnodes, nranks, rank, self._logger
            )
        if result != 0:
            # Newer NCCL continues without the profiler for this communicator.
            log.warning("profiler init returned %d for communicator %#018x; continuing without it", result, comm_hash)
            context[0] = self.ffi.NULL
        if name is not None and self.poison_comm_names:
            # The caller's config (and its commName) may be gone once init returns: a plugin must copy it.
            self.ffi.memmove(name_buffer, b"\xff" * len(name), len(name))
        return CommunicatorContext(comm_hash, nranks, nnodes, rank, name, context, stream)

    def finalize(self, comm: CommunicatorContext) -> None:
        """Call the plugin's ``finalize`` for ``comm`` (once; NULL contexts are skipped as NCCL does)."""
        if comm.finalized:
            return
        comm.finalized = True
        if comm.plugin_context != self.ffi.NULL:
            self.plugin.table.finalize(comm.plugin_context)

    # ------------------------------------------------------------------ the CPU side of a group

    def enqueue(self, comm: CommunicatorContext, ops: Sequence[OpLike]) -> list[Enqueued]:
        """One ncclGroupStart/ops/ncclGroupEnd on ``comm``: API, Group and task events, up to enqueued."""
        if comm.plugin_context == self.ffi.NULL:
            return [self._untracked(comm, op) for op in ops]
        mask = self.mask[0]
        v5 = self.version == 5
        group_api = self.ffi.NULL
        api_handles = [self.ffi.NULL] * len(ops)
        if v5 and mask & ENABLES["GroupApi"]:
            descr = self._descr("GroupApi", self.ffi.NULL)
            descr.groupApi.groupDepth = 1
            group_api = self._start(comm, descr)
            self._record(group_api, abi.event_state("GroupStartApiStop"))
        if v5:
            for i, op in enumerate(ops):
                api_handles[i] = self._api_event(comm, op, group_api, mask)
            self._record(group_api, abi.event_state("GroupEndApiStart"))
        # NCCL's one-rank shortcut runs a collective as a device copy before any task (or Coll event) exists;
        # send/recv to self still become tasks.
        one_rank = [comm.nranks == 1 and not op.is_p2p for op in ops]
        items: list[Enqueued | None] = [
            Enqueued(op, comm, self.ffi.NULL, mask, -1, 0, True) if skip else None
            for op, skip in zip(ops, one_rank, strict=True)
        ]
        if all(one_rank):
            self._stop(group_api)
            return [item for item in items if item is not None]
        group = self.ffi.NULL
        if mask & ENABLES["Group"]:
            group = self._start(comm, self._descr("Group", self.ffi.NULL))
        for i, (op, api_handle) in enumerate(zip(ops, api_handles, strict=True)):
            if items[i] is None:
                items[i] = self._task_event(comm, op, api_handle if v5 else group, group, mask)
        tasks = [item for item in items if item is not None and not item.one_rank]
        if v5 and mask & ENABLES["KernelLaunch"]:
            descr = self._descr("KernelLaunch", group_api)
            descr.kernelLaunch.stream = self.ffi.cast("void*", comm.stream)
            self._stop(self._start(comm, descr))
        for task in tasks:
            self._stop(task.handle)  # enqueued: the operation has not run yet
        self._stop(group)
        self._stop(group_api)
        return [item for item in items if item is not None]

    def _untracked(self, comm: CommunicatorContext, op: OpLike) -> Enqueued:
        seq = -1
        if not op.is_p2p and comm.nranks > 1:
            seq = comm.seq[op.func]
            comm.seq[op.func] += 1
        return Enqueued(op, comm, self.ffi.NULL, 0, seq, 1, comm.nranks == 1 and not op.is_p2p)

    def _api_event(self, comm: CommunicatorContext, op: OpLike, group_api: Any, mask: int) -> Any:
        kind = "P2pApi" if op.is_p2p else "CollApi"
        if not mask & ENABLES[kind]:
            return self.ffi.NULL
        descr = self._descr(kind, group_api)
        member = descr.p2pApi if op.is_p2p else descr.collApi
        member.func = self.cstr(op.func)
        member.count = op.count
        member.datatype = self.cstr(op.dtype)
        member.stream = self.ffi.cast("void*", comm.stream)
        if not op.is_p2p:
            member.root = max(op.peer, 0)
        handle = self._start(comm, descr)
        self._stop(handle)  # the API call returns before ncclGroupEnd launches anything
        return handle

    def _task_event(self, comm: CommunicatorContext, op: OpLike, parent: Any, group: Any, mask: int) -> Enqueued:
        fake_buffer = self.ffi.cast("void*", 0x7F0000000000 + (comm.stream << 8))
        n_channels = 2 if op.bytes > _LARGE_BYTES and not op.is_p2p else 1
        if op.is_p2p:
            item = Enqueued(op, comm, self.ffi.NULL, mask, -1, n_channels, False)
            if mask & ENABLES["P2p"]:
                descr = self._descr("P2p", parent, comm.rank)
                descr.p2p.func = self.cstr(op.func)
                descr.p2p.buff = fake_buffer
                descr.p2p.datatype = self.cstr(op.dtype)
                descr.p2p.count = op.count
                descr.p2p.peer = op.peer
                descr.p2p.nChannels = n_channels
                if self.version == 5:
                    descr.p2p.parentGroup = group
                item.handle = self._start(comm, descr)
            return item
        seq = comm.seq[op.func]
        comm.seq[op.func] += 1  # NCCL counts every collective, tracked or not
        item = Enqueued(op, comm, self.ffi.NULL, mask, seq, n_channels, False)
        if mask & ENABLES["Coll"]:
            count, dtype = op.coll_count_dtype()
            descr = self._descr("Coll", parent, comm.rank)
            descr.coll.seqNumber = seq
            descr.coll.func = self.cstr(op.func)
            descr.coll.sendBuff = fake_buffer
            descr.coll.recvBuff = fake_buffer
            descr.coll.count = count
            descr.coll.root = max(op.peer, 0)
            descr.coll.datatype = self.cstr(dtype)
            descr.coll.nChannels = n_channels
            descr.coll.nWarps = 16
            descr.coll.algo = self.cstr("Ring")
            descr.coll.proto = self.cstr("Simple" if op.bytes > _LARGE_BYTES else "LL")
            if self.version == 5:
                descr.coll.parentGroup = group
            item.handle = self._start(comm, descr)
        return item

    # ------------------------------------------------------------------ the GPU side

    def kernels_start(self, item: Enqueued, gpu_start_ns: int) -> None:
        """The kernel of ``item`` started on the GPU at ``gpu_start_ns``: KernelCh (and ProxyOp) starts."""
        if item.one_rank or item.comm.plugin_context == self.ffi.NULL:
            return
        comm, mask = item.comm, item.mask
        for channel in range(item.n_channels):
            if mask & ENABLES["KernelCh"]:
                descr = self._descr("KernelCh", item.handle, comm.rank)
                descr.kernelCh.channelId = channel
                descr.kernelCh.pTimer = gpu_start_ns + 150 * channel
                item.kernel_handles.append(self._start(comm, descr))
            if comm.nnodes > 1 and mask & ENABLES["ProxyOp"]:
                for is_send in self._proxy_directions(item):
                    descr = self._descr("ProxyOp", item.handle, comm.rank)
                    descr.proxyOp.pid = self._pid
                    descr.proxyOp.channelId = channel
                    descr.proxyOp.peer = self._proxy_peer(item, is_send)
                    descr.proxyOp.nSteps = _PROXY_STEPS
                    descr.proxyOp.chunkSize = _CHUNK_BYTES
                    descr.proxyOp.isSend = is_send
                    item.proxy_handles.append((self._start(comm, descr), is_send))

    def kernels_stop(self, item: Enqueued, gpu_end_ns: int) -> None:
        """The kernel of ``item`` ended at ``gpu_end_ns``: proxy steps, ProxyOp stops, KernelCh stop state and stops."""
        if item.one_rank or item.comm.plugin_context == self.ffi.NULL:
            return
        comm, mask = item.comm, item.mask
        per_step = max(1, item.op.bytes // (_PROXY_STEPS * max(1, item.n_channels)))
        for proxy, is_send in item.proxy_handles:
            if mask & ENABLES["ProxyStep"]:
                for step in range(_PROXY_STEPS):
                    descr = self._descr("ProxyStep", proxy, comm.rank)
                    descr.proxyStep.step = step
                    handle = self._start(comm, descr)
                    if proxy != self.ffi.NULL:
                        first, second = ("SendGPUWait", "SendWait") if is_send else ("RecvWait", "RecvFlushWait")
                        self._record(handle, abi.event_state(f"ProxyStep{first}"), trans_size=per_step * step)
                        self._record(handle, abi.event_state(f"ProxyStep{second}"), trans_size=per_step * (step + 1))
                    self._stop(handle)
            self._record(proxy, abi.event_state("ProxyOpInProgress"))
            self._stop(proxy)
        last = len(item.kernel_handles) - 1
        for channel, handle in enumerate(item.kernel_handles):
            # Channels finish close together; the last one stops at the operation's end.
            self._record(handle, self._state_kernel_stop, p_timer=gpu_end_ns - 100 * (last - channel))
            self._stop(handle)
        item.kernel_handles.clear()
        item.proxy_handles.clear()

    @staticmethod
    def _proxy_directions(item: Enqueued) -> tuple[int, ...]:
        if item.op.is_p2p:
            return (1,) if item.op.func == "Send" else (0,)
        return (1, 0)  # a ring step sends to the next rank and receives from the previous one

    @staticmethod
    def _proxy_peer(item: Enqueued, is_send: int) -> int:
        if item.op.is_p2p:
            return item.op.peer
        n, rank = item.comm.nranks, item.comm.rank
        return (rank + 1) % n if is_send else (rank - 1) % n
