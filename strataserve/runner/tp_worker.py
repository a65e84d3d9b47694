"""Tensor-parallel ranks: rank 0 is the engine core's own ``ModelRunner``; ranks 1..N-1 are worker processes.

Start-up (``setup``, called by every rank's runner): rank 0 checks the model can be split, starts the workers and
joins the process group with them (NCCL on CUDA, one GPU per rank, ``cuda:rank``; gloo on CPU). A second, gloo
group carries the control messages: before every step rank 0 broadcasts the step's ``SchedulerOutput`` once (one
pickled object); each worker runs the same step on its shard (the same collectives in the same order: forward,
logits) without sampling, and waits for the next one. ``None`` ends the loop; every rank then leaves the group.

Why ``subprocess`` and not ``multiprocessing``: in ``strata serve`` the engine core is itself a daemonic
multiprocessing child, and those may not start children. A worker is ``python -m strataserve.runner.tp_worker``
with its job pickled on stdin (the same fresh interpreter a ``spawn`` start gives). Workers exit with rank 0:
on ``None``, when the control group's connection drops, or when their parent process is gone.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from strataserve.config import EngineConfig
from strataserve.startup import freeze_startup_heap, leave_stopping_to_the_parent
from strataserve.models.parallel import SINGLE, TensorParallel, check_tensor_parallel

# the control group waits for the next step as long as the server idles; the rendezvous only this long
_IDLE_TIMEOUT = timedelta(days=365)
_INIT_TIMEOUT = timedelta(seconds=300)
_JOIN_SECONDS = 30.0


@dataclass(frozen=True)
class _Job:
    config: EngineConfig
    rank: int
    size: int
    port: int
    async_scheduling: bool


class TPControl:
    """The control channel of one rank (gloo): the per-step broadcast and start-up agreements."""

    def __init__(self, rank: int, group: Any) -> None:
        self.rank, self.group = rank, group

    def broadcast_step(self, step: Any = None) -> Any:
        """Rank 0 sends ``step`` (a SchedulerOutput, or None to stop); the others receive and return it."""
        import torch.distributed as dist

        if step is not None and getattr(step, "structured", None) is not None:
            step = dataclasses.replace(step, structured=None)  # a grammar future: only rank 0 samples
        box = [step]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. KV blocks: every rank's pool must hold the same blocks)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


class TPWorkers:
    """Rank 0's handle on the worker processes."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, control: TPControl | None) -> None:
        """Tell the workers to stop, leave the group, and wait for them (killing any that hang)."""
        import torch.distributed as dist

        if control is not None:
            try:
                control.broadcast_step(None)
            except Exception:  # noqa: BLE001 — a worker already gone: it is reaped below
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + _JOIN_SECONDS
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_workers(config: EngineConfig, size: int, port: int, async_scheduling: bool) -> TPWorkers:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the strataserve package
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    procs = []
    for rank in range(1, size):
        p = subprocess.Popen([sys.executable, "-m", "strataserve.runner.tp_worker"], stdin=subprocess.PIPE, env=env)
        assert p.stdin is not None
        p.stdin.write(pickle.dumps(_Job(config, rank, size, port, async_scheduling)))
        p.stdin.close()
        procs.append(p)
    return TPWorkers(procs)


class OneShotAllReduce:
    """PyTorch's one-shot symmetric-memory all-reduce (``STRATA_TP_ALLREDUCE=symm_mem``) for tensors up to
    ``max_bytes``: each rank copies its partial sum into a buffer every rank can read over NVLink and sums all
    of them itself; one kernel, no NCCL protocol, which is what a decode step's few-KB all-reduces want. The
    buffer is made (a collective) at the first eager call; calls before that, and larger tensors, use NCCL."""

    def __init__(self, group: Any, max_bytes: int = 4 << 20) -> None:
        self.group_name, self.max_bytes = group.group_name, max_bytes
        self.buf: torch.Tensor | None = None

    def fits(self, x: torch.Tensor) -> bool:
        if x.numel() * x.element_size() > self.max_bytes or not x.is_contiguous():
            return False
        if self.buf is None:
            if torch.cuda.is_current_stream_capturing():
                return False
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
                symm_mem.enable_symm_mem_for_group(self.group_name)
            self.buf = symm_mem.empty(self.max_bytes // x.element_size(), dtype=x.dtype, device=x.device)
            symm_mem.rendezvous(self.buf, self.group_name)
        return x.dtype == self.buf.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert self.buf is not None
        src = self.buf[: x.numel()]
        src.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(src, "sum", self.group_name, out=x.view(-1))
        return x


def _join_group(rank: int, size: int, port: int, cuda: bool) -> tuple[TensorParallel, TPControl]:
    import torch.distributed as dist

    from strataserve import envs

    if cuda:
        torch.cuda.set_device(rank)
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:  # every rank is on this host: gloo need not guess an interface from the hostname
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=_INIT_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    small = OneShotAllReduce(dist.group.WORLD) if cuda and envs.STRATA_TP_ALLREDUCE == "symm_mem" else None
    return TensorParallel(rank, size, dist.group.WORLD, small), TPControl(rank, control)


@dataclass
class RankSetup:
    tp: TensorParallel
    device: torch.device
    control: TPControl | None = None
    workers: TPWorkers | None = None


def setup(config: EngineConfig, cfg: Any, device: torch.device, rank: int = 0, port: int = 0,
          async_scheduling: bool = False) -> RankSetup:
    """This rank's tensor-parallel place and device (rank 0 also starts the workers, telling them whether steps
    are scheduled asynchronously; the others join rank 0's ``port``); ``cfg``: the model's ``DecoderConfig``.
    Size 1: nothing to set up."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return RankSetup(SINGLE, device)
    check_tensor_parallel(cfg, size)
    cuda = device.type == "cuda"
    if cuda:
        if device.index not in (None, 0) and rank == 0:
            raise ValueError(f"device={config.model.device!r} with tensor_parallel_size={size}: rank r runs on "
                             "cuda:r; give device 'cuda' or 'auto'")
        if torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this host has "
                             f"{torch.cuda.device_count()}")
        device = torch.device("cuda", rank)
    import torch.distributed as dist

    if rank == 0 and dist.is_initialized():
        raise ValueError("a tensor-parallel engine is already running in this process; shut it down first "
                         "(one tensor-parallel engine per process)")
    workers = None
    if rank == 0:
        port = _free_port()
        workers = _start_workers(config, size, port, async_scheduling)
        try:
            tp, control = _join_group(0, size, port, cuda)
        except BaseException:
            workers.stop(None)
            raise
    else:
        tp, control = _join_group(rank, size, port, cuda)
    return RankSetup(tp, device, control, workers)


def _watch_parent(parent: int) -> None:
    """Exit when rank 0's process is gone (its death may leave a collective waiting forever)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="strata-tp-parent-watch", daemon=True).start()


def main() -> None:
    """A worker rank: build the runner on this rank's shard, then run every broadcast step until ``None``."""
    job: _Job = pickle.load(sys.stdin.buffer)
    leave_stopping_to_the_parent()  # rank 0 stops us with its last broadcast
    _watch_parent(os.getppid())
    from strataserve.models.hf_config import load_decoder_config
    from strataserve.models.loader import resolve_device
    from strataserve.runner.model_runner import ModelRunner

    device = resolve_device(job.config.model.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.size))  # the ranks share the host's cores
    rank = setup(job.config, load_decoder_config(job.config.model.model), device, job.rank, job.port)
    runner = ModelRunner(job.config, async_scheduling=job.async_scheduling, tp=rank)
    if runner.cpu_pool is not None:
        runner.cpu_pool.hold_torch()  # this process only steps the model: its matmuls run on the pool
    control = rank.control
    assert control is not None
    freeze_startup_heap()  # as the engine core does: its model and runner need no collecting
    try:
        while True:
            try:
                step = control.broadcast_step()
            except RuntimeError as exc:  # the control connection dropped: rank 0 is gone, nothing to clean up
                print(f"strata tensor-parallel rank {job.rank}: rank 0 went away ({str(exc).splitlines()[0][:160]}); "
                      "exiting", file=sys.stderr, flush=True)
                os._exit(1)
            if step is None:
                break
            runner.launch(step)
    finally:
        runner.shutdown()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
