"""Drives the profiler .so through its NCCL ABI with cffi, as NCCL would; run as a subprocess by the tests.

Each scenario prints one JSON line on stdout. The ABI declarations are the NCCL_ABI_CDEF region of
native/profiler/include/nccl_profiler_abi.h, fed to cffi as they stand.

    python driver.py LIB.so ops --threads 8 --ops 2000
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from pathlib import Path

import cffi

ABI_HEADER = Path(__file__).resolve().parents[2] / "native/profiler/include/nccl_profiler_abi.h"
TYPES = {
    "Group": 1 << 0,
    "Coll": 1 << 1,
    "P2p": 1 << 2,
    "ProxyOp": 1 << 3,
    "ProxyStep": 1 << 4,
    "ProxyCtrl": 1 << 5,
    "KernelCh": 1 << 6,
    "NetPlugin": 1 << 7,
    "GroupApi": 1 << 8,
    "CollApi": 1 << 9,
    "P2pApi": 1 << 10,
    "KernelLaunch": 1 << 11,
}
KERNEL_CH_STOP = 22


def make_ffi() -> cffi.FFI:
    """An FFI with the ABI region of the header and the two exported tables."""
    text = ABI_HEADER.read_text()
    region = re.search(r"/\* NCCL_ABI_CDEF_BEGIN \*/(.*?)/\* NCCL_ABI_CDEF_END \*/", text, re.S)
    ffi = cffi.FFI()
    ffi.cdef(region.group(1))
    ffi.cdef("extern ncclProfiler_v5_t ncclProfiler_v5; extern ncclProfiler_v4_t ncclProfiler_v4;")
    return ffi


class Plugin:
    """One loaded copy of the library and the strings its descriptors point to (kept alive)."""

    def __init__(self, ffi: cffi.FFI, path: str, abi: int) -> None:
        self.ffi, self.abi = ffi, abi
        self.lib = ffi.dlopen(path)
        self.table = ffi.addressof(self.lib, f"ncclProfiler_v{abi}")
        self.descr = f"ncclProfilerEventDescr_v{abi}_t*"
        self.args = f"ncclProfilerEventStateArgs_v{abi}_t*"
        self._strings: dict[bytes, object] = {}

    def s(self, text: str | None) -> object:
        if text is None:
            return self.ffi.NULL
        key = text.encode()
        if key not in self._strings:
            self._strings[key] = self.ffi.new("char[]", key)
        return self._strings[key]

    def init(self, name: str | None, comm_hash: int, nranks: int, rank: int) -> tuple[object, int]:
        ctx, mask = self.ffi.new("void**"), self.ffi.new("int*")
        if self.abi == 5:
            rc = self.table.init(ctx, comm_hash, mask, self.s(name), 1, nranks, rank, self.ffi.NULL)
        else:
            rc = self.table.init(ctx, mask, self.s(name), comm_hash, 1, nranks, rank, self.ffi.NULL)
        assert rc == 0
        return ctx[0], mask[0]

    def start(self, ctx: object, type_name: str, parent: object = None, **fields: object) -> object:
        d = self.ffi.new(self.descr)
        d.type = TYPES[type_name]
        d.parentObj = parent if parent is not None else self.ffi.NULL
        for dotted, value in fields.items():
            target, attr = d, dotted.split("__")
            for part in attr[:-1]:
                target = getattr(target, part)
            setattr(target, attr[-1], self.s(value) if isinstance(value, str) else value)
        h = self.ffi.new("void**")
        assert self.table.startEvent(ctx, h, d) == 0
        return h[0]

    def kernel_stop(self, handle: object, ptimer: int) -> None:
        a = self.ffi.new(self.args)
        a.kernelCh.pTimer = ptimer
        self.table.recordEventState(handle, KERNEL_CH_STOP, a)

    def collective(self, ctx: object, seq: int, nch: int = 2, func: str = "AllReduce", complete: bool = True) -> bool:
        """One collective as NCCL reports it; returns False when the plugin dropped it (NULL handle)."""
        api = self.start(ctx, "CollApi", collApi__stream=self.ffi.cast("void*", 0x7000)) if self.abi == 5 else None
        h = self.start(
            ctx,
            "Coll",
            api,
            coll__seqNumber=seq,
            coll__func=func,
            coll__datatype="ncclFloat32",
            coll__count=1024,
            coll__root=0,
            coll__nChannels=nch,
            coll__algo="Ring",
            coll__proto="Simple",
        )
        if api is not None:
            self.table.stopEvent(api)
        self.table.stopEvent(h)
        if h == self.ffi.NULL:
            return False
        if complete:
            for ch in range(nch):
                k = self.start(ctx, "KernelCh", h, kernelCh__channelId=ch, kernelCh__pTimer=1_000_000 + seq)
                self.kernel_stop(k, 2_000_000 + seq)
                self.table.stopEvent(k)
        return True


def scenario_ops(p: Plugin, args: argparse.Namespace) -> dict:
    ctx, mask = p.init(None if args.null_name else args.name, args.comm_hash, args.nranks, args.rank)
    dropped = [0] * args.threads

    def run(t: int) -> None:
        for i in range(args.ops):
            if not p.collective(ctx, t * 1_000_000 + i, nch=args.nch):
                dropped[t] += 1

    threads = [threading.Thread(target=run, args=(t,)) for t in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(args.leave_open):  # enqueued, kernel never seen: in flight at finalize
        p.collective(ctx, 900_000_000 + i, nch=1, complete=False)
    p.table.finalize(ctx)
    return {"mask": mask, "ops": args.ops * args.threads, "dropped": sum(dropped)}


def scenario_every_type(p: Plugin, args: argparse.Namespace) -> dict:
    ctx, mask = p.init(args.name, args.comm_hash, args.nranks, args.rank)
    types = list(TYPES) if p.abi == 5 else [t for t in TYPES if TYPES[t] <= TYPES["NetPlugin"]]
    handles = {}
    coll = p.start(
        ctx, "Coll", None, coll__func="AllReduce", coll__datatype="ncclFloat32", coll__count=8, coll__nChannels=1
    )
    p2p = p.start(
        ctx, "P2p", None, p2p__func="Send", p2p__datatype="ncclInt8", p2p__count=8, p2p__peer=1, p2p__nChannels=1
    )
    for name in types:
        if name in ("Coll", "P2p"):  # started above, with real descriptors
            handles[name] = coll if name == "Coll" else p2p
            continue
        parent = coll if name in ("KernelCh", "ProxyOp", "ProxyStep") else None
        handles[name] = p.start(ctx, name, parent)
    for name, h in handles.items():
        if name in ("Coll", "P2p"):
            continue
        for state in range(8, 25):
            p.kernel_stop(h, 5) if state == KERNEL_CH_STOP else p.table.recordEventState(h, state, p.ffi.NULL)
        p.table.stopEvent(h)
    # the Coll's announced channel and the P2p's: one KernelCh each completes them
    for parent in (coll, p2p):
        p.table.stopEvent(parent)
    k = p.start(ctx, "KernelCh", p2p, kernelCh__pTimer=10)
    p.kernel_stop(k, 20)
    p.table.stopEvent(k)
    p.table.finalize(ctx)
    return {"mask": mask, "null_handles": sorted(n for n, h in handles.items() if h == p.ffi.NULL)}


def scenario_hold(p: Plugin, args: argparse.Namespace) -> dict:
    """Completes collectives forever, reporting progress, until the test kills the process."""
    ctx, _ = p.init(args.name, args.comm_hash, args.nranks, args.rank)
    i = 0
    while True:
        p.collective(ctx, i, nch=1)
        i += 1
        if i % 500 == 0:
            print(json.dumps({"completed": i}), flush=True)
            time.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("library")
    parser.add_argument("scenario", choices=["ops", "every-type", "hold", "reload"])
    parser.add_argument("--abi", type=int, default=5, choices=[4, 5])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--nch", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--leave-open", type=int, default=0)
    parser.add_argument("--name", default="test-comm")
    parser.add_argument("--null-name", action="store_true")
    parser.add_argument("--comm-hash", type=lambda v: int(v, 0), default=0xC0FFEE)
    parser.add_argument("--nranks", type=int, default=8)
    parser.add_argument("--rank", type=int, default=3)
    args = parser.parse_args()
    ffi = make_ffi()
    if args.scenario == "reload":
        results = []
        for _ in range(args.cycles):
            plugin = Plugin(ffi, args.library, args.abi)
            results.append(scenario_ops(plugin, args))
            ffi.dlclose(plugin.lib)
        print(json.dumps({"cycles": results}))
        return
    plugin = Plugin(ffi, args.library, args.abi)
    handler = {"ops": scenario_ops, "every-type": scenario_every_type, "hold": scenario_hold}[args.scenario]
    print(json.dumps(handler(plugin, args)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
