"""One simulated rank: a separate OS process that loads the plugin itself and plays NCCL for it.

The main thread is the training loop (compute phases are real sleeps; launches go through the
driver up to "enqueued"); a second thread is the GPU stream: it takes launches in order, starts
their kernels, publishes its arrival on the board, waits for the last member of every
rendezvous (really waiting, as a GPU kernel does), sleeps until the modelled end and stops the
kernels with GPU times in ``pTimer``. Compute phases that consume communication results wait for
the stream first, so a slow or missing rank delays its peers the way it does on GPUs.

Every rank appends a journal (JSON lines, one ``os.write`` per line on an O_APPEND descriptor, so
a crash or SIGKILL leaves every complete line) that the parent turns into the ground truth.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from comminsight_inject.hook import empty_table, write_table

from comminsight import lifeline
from comminsight.simulator.abi import load_plugin
from comminsight.simulator.board import RENDEZVOUS_POLL_S, Aborted, Board, RankStatus
from comminsight.simulator.driver import ProfilerDriver
from comminsight.simulator.plan import (
    SETUP_STEP,
    Compute,
    Crash,
    Hang,
    Launch,
    Pause,
    Plan,
    build_plan,
    compute_durations,
)
from comminsight.simulator.spec import EXIT_ABORTED, EXIT_FAILED, RankSpec

# Megatron's descriptions of the groups the simulator's layouts build.
GROUP_DESCS = {
    "world": "default_pg",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP",
    "mp": "MODEL_PARALLEL_GROUP",
}


class _Journal:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, **event: Any) -> None:
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        os.close(self._fd)


class RankProcess:
    """The training loop and GPU stream of one rank (see the module docstring)."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.plan: Plan = build_plan(spec.config, check=False)  # the parent checked it
        self.schedule = self.plan.schedules[self.rank]
        self.board = Board(Path(spec.board), spec.config.ranks, int(self.plan.rendezvous_offsets[-1]))
        self.journal = _Journal(spec.journal)
        self.driver = ProfilerDriver(load_plugin(spec.plugin, spec.config.abi))
        self.comms: dict[int, Any] = {}
        self.stream: queue.Queue = queue.Queue()
        self.completed = 0
        self.completed_cv = threading.Condition()
        # Pacing (see _run_actions): the modelled GPU end of every completed launch, in order, and
        # the time the training loop's last compute phase is due to end.
        self.launch_ends_ns: list[int] = []
        self.due_ns = 0
        self.gpu_error: BaseException | None = None
        self.stop_at = {
            (f.step, f.op_index): f for f in spec.config.faults if isinstance(f, Hang | Crash) and f.rank == self.rank
        }
        self.pause_at = {(f.step, f.op_index): f.seconds for f in spec.config.faults if isinstance(f, Pause)}

    # ------------------------------------------------------------------ main thread

    def run(self) -> int:
        """Run the whole rank; returns the process exit code."""
        board, rank = self.board, self.rank
        self.journal.write(ev="start", rank=rank, pid=os.getpid(), t=time.time_ns())
        if not self.spec.config.comm_names:
            self._record_process_groups()
        for comm in self.plan.communicators_of(rank):
            name = comm.name if self.spec.config.comm_names else None
            stream = 0x5500_0000_0000 + (rank << 20) + (comm.index << 4)
            self.comms[comm.index] = self.driver.init_communicator(
                comm.comm_hash, comm.nranks, comm.nnodes, comm.comm_rank(rank), name, stream
            )
        gpu = threading.Thread(target=self._gpu_stream, name=f"gpu-stream-{rank}", daemon=True)
        gpu.start()
        outcome, code = "completed", 0
        try:
            # Communicator creation is collective: nobody starts training before every rank is ready.
            board.set_status(rank, RankStatus.READY)
            board.wait(lambda: bool((board.status >= RankStatus.READY).all()))
            board.set_status(rank, RankStatus.RUNNING)
            self.due_ns = time.time_ns()
            # Where this rank's modelled clock starts (model.py replays the run from it).
            self.journal.write(ev="origin", t=self.due_ns)
            durations = compute_durations(self.spec.config, rank, self.schedule.steps)
            self._run_actions(SETUP_STEP, self.schedule.setup, [])
            for step, actions in enumerate(self.schedule.steps):
                cpu0 = time.thread_time_ns()
                self.journal.write(ev="step_start", step=step, t=time.time_ns())
                self._run_actions(step, actions, durations[step])
                # What the training loop really did in the step beside its model: its own CPU time.
                self.journal.write(ev="step_end", step=step, t=time.time_ns(), cpu=time.thread_time_ns() - cpu0)
                board.steps_done[rank] = step + 1
                board.beat(rank)
        except Aborted:
            outcome, code = "aborted", EXIT_ABORTED
        self.stream.put(None)
        gpu.join(timeout=None if outcome == "completed" else 5.0)
        if self.gpu_error is not None and outcome == "completed":
            raise self.gpu_error
        # ncclCommDestroy / ncclCommAbort: the plugin sees everything still in flight at finalize.
        for comm in reversed(list(self.comms.values())):
            self.driver.finalize(comm)
        self.journal.write(ev="exit", outcome=outcome, t=time.time_ns())
        board.set_status(rank, RankStatus.DONE if outcome == "completed" else RankStatus.ABORTED)
        return code

    def _record_process_groups(self) -> None:
        """What the import hook writes at level 2 (NCCL gets no commName): this rank's process groups."""
        groups = [
            {
                "name": str(comm.index),
                "desc": GROUP_DESCS.get(comm.kind, comm.kind),
                "ranks": list(comm.ranks),
                "size": comm.nranks,
                "creation_index": i,
                "backend": "nccl",
            }
            for i, comm in enumerate(self.plan.communicators_of(self.rank))
        ]
        table = {
            **empty_table(),
            "rank": self.rank,
            "world_size": self.spec.config.ranks,
            "level": 2,
            "reason": "simulated job without commName",
            "groups": groups,
        }
        write_table(table, Path(self.spec.home))

    def _run_actions(self, step: int, actions: tuple, durations: list[float]) -> None:
        launch_index = 0
        compute_index = 0
        for action in actions:
            if isinstance(action, Compute):
                self._wait_completed(action.after)
                # Against a deadline, not for a duration: the phase starts when the launch it consumes
                # ended on the modelled GPU clock (or when the previous phase was due), not when this
                # thread got to run again, so the machine's wake-up delays do not add up along the
                # rank's program (the modelled clock's rule, model.py). Set-up phases take no time.
                ready = self.launch_ends_ns[action.after - 1] if action.after else 0
                self.due_ns = max(self.due_ns, ready) + (int(durations[compute_index] * 1e6) if durations else 0)
                if durations:
                    _sleep_until(self.due_ns)
                compute_index += 1
                self.board.beat(self.rank)
                continue
            assert isinstance(action, Launch)
            pause = self.pause_at.get((step, launch_index))
            if pause:
                self.journal.write(ev="pause", step=step, launch=launch_index, seconds=pause, t=time.time_ns())
                time.sleep(pause)  # outside NCCL, on every rank at once
                self.due_ns = max(self.due_ns, time.time_ns())
                self.board.beat(self.rank)
            fault = self.stop_at.get((step, launch_index))
            if fault is not None:
                self._stop_here(fault, step, launch_index)
            self._launch(step, launch_index, action)
            launch_index += 1

    def _stop_here(self, fault: Hang | Crash, step: int, launch_index: int) -> None:
        if isinstance(fault, Crash):
            self.journal.write(ev="crash", step=step, launch=launch_index, t=time.time_ns())
            self.board.set_status(self.rank, RankStatus.CRASHED)
            os._exit(fault.exit_code)  # abrupt: no finalize, no flush, no atexit
        self.journal.write(ev="hung", step=step, launch=launch_index, t=time.time_ns())
        self.board.set_status(self.rank, RankStatus.HUNG)
        # Stuck outside NCCL (a dataloader, a deadlock in user code) until the job is ended.
        self.board.wait(lambda: False, poll_s=0.01)

    def _launch(self, step: int, launch_index: int, action: Launch) -> None:
        comm = self.comms[action.ops[0].comm]
        t0 = time.time_ns()
        items = self.driver.enqueue(comm, action.ops)
        t1 = time.time_ns()
        # ``due``: when the launch was due on the modelled clock (the deadline of the compute phase before
        # it, given the completions the rank received). The GPU stream reaches the launch at ``t1``, so
        # t1 - due is what the machine (a late wake-up, the plugin's enqueue calls) added to this rank.
        self.journal.write(
            ev="enq",
            step=step,
            launch=launch_index,
            t0=t0,
            t1=t1,
            due=self.due_ns,
            seq=[item.seq for item in items],
        )
        self.stream.put((items, t1))
        self.board.beat(self.rank)

    def _wait_completed(self, count: int) -> None:
        with self.completed_cv:
            while self.completed < count:
                if self.board.aborted:
                    raise Aborted
                if self.gpu_error is not None:
                    raise self.gpu_error
                self.completed_cv.wait(timeout=0.05)

    # ------------------------------------------------------------------ GPU stream thread

    def _gpu_stream(self) -> None:
        try:
            while True:
                launch = self.stream.get()
                if launch is None:
                    return
                self._run_kernels(*launch)
        except Aborted:
            return  # kernels stay started: NCCL aborts communicators with operations in flight
        except BaseException as error:  # surfaced to the main thread
            self.gpu_error = error
            with self.completed_cv:
                self.completed_cv.notify_all()

    def _run_kernels(self, items: list, enqueued_ns: int) -> None:
        plan, board = self.plan, self.board
        # A GPU stream reaches a launch once it is enqueued and the previous launch ended (modelled):
        # how late this thread woke up to play it is no part of the GPU's time.
        start = max(enqueued_ns, self.launch_ends_ns[-1]) if self.launch_ends_ns else enqueued_ns
        for item in items:
            self.driver.kernels_start(item, start)
        for item in items:
            rv = item.op.rendezvous
            if rv >= 0:
                board.arrivals[plan.rendezvous_offsets[rv] + self._slot(item.op)] = start
        ends = []
        for item in items:
            rv = item.op.rendezvous
            if rv < 0:  # one-rank communicator: a device-local copy
                ends.append(start + 2_000 + item.op.bytes // 1000)
                continue
            first = int(plan.rendezvous_offsets[rv])
            members = board.arrivals[first : first + len(plan.rendezvous_members[rv])]
            board.wait(partial(_all_arrived, members), max_poll_s=RENDEZVOUS_POLL_S)
            ends.append(int(members.max()) + int(plan.transfer_ns[rv]))
        remaining = max(ends) - time.time_ns()
        if remaining > 0:
            time.sleep(remaining / 1e9)
        for item, end in zip(items, ends, strict=True):
            self.driver.kernels_stop(item, end)
        self.journal.write(ev="done", gpu=[[start, end] for end in ends], t=time.time_ns())
        with self.completed_cv:
            self.launch_ends_ns.append(max(ends))
            self.completed += 1
            self.completed_cv.notify_all()
        board.beat(self.rank)

    def _slot(self, op: Any) -> int:
        if op.is_p2p:
            return 0 if op.func == "Send" else 1
        return self.plan.communicators[op.comm].comm_rank(self.rank)


def _sleep_until(deadline_ns: int) -> None:
    remaining = deadline_ns - time.time_ns()
    if remaining > 0:
        time.sleep(remaining / 1e9)


def _all_arrived(members: Any) -> bool:
    return bool((members != 0).all())


def main(argv: list[str] | None = None) -> None:
    """Entry point of a rank process: ``python -m comminsight.simulator.rank SPEC.json``.

    The parent has already put the launcher environment (RANK, LOCAL_RANK, COMMINSIGHT_HOME ...) in
    this process's environment, so the plugin sees it from its first call.
    """
    lifeline.watch_parent()  # ends with the runner, even when the runner is killed outright
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m comminsight.simulator.rank SPEC.json\n")
        os._exit(2)
    try:
        spec = RankSpec.from_json(Path(args[0]).read_text())
    except (OSError, ValueError, TypeError, KeyError) as error:
        sys.stderr.write(f"invalid rank spec {args[0]}: {error}\n")
        os._exit(2)
    try:
        code = RankProcess(spec).run()
    except Exception as error:
        sys.stderr.write(f"simulated rank {spec.rank} failed: {error!r}\n")
        with contextlib.suppress(Exception):  # the parent sees the exit code either way
            Board(Path(spec.board), spec.config.ranks, 0).set_status(spec.rank, RankStatus.FAILED)
        code = EXIT_FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: the plugin's threads were joined in its last finalize


if __name__ == "__main__":
    main()
