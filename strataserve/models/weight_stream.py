"""Checkpoint bytes from disk to GPU parameters through pinned host buffers, several reads in flight.

Why: reading a tensor through safetensors' memory map and ``param.copy_(tensor)`` is two serial copies per tensor
(page cache -> a pageable CPU tensor, then pageable -> GPU, which the driver stages through its own small pinned
buffer), one tensor at a time: ~5 GB/s, 3.1-3.6 s of the 8B shape's 16 GB at ``strata serve`` start-up (run 20).
Here each worker thread reads a chunk straight from the file into a pinned buffer with ``os.preadv`` (one copy out
of the page cache, no page faults, the GIL released) and queues its copy to the GPU on the worker's own stream,
while it reads the next chunk into its second buffer. Reads of different chunks overlap each other and the copies.

What it needs: the tensor stored whole, in the parameter's dtype, into a contiguous destination (a parameter or a
row range of a fused one). Anything else (a dtype cast, a tensor-parallel slice) stays on the safetensors path.
The safetensors header (8-byte little-endian length, JSON with each tensor's dtype, shape and byte range after
the header) is read here; the format is fixed by the safetensors specification.
"""
from __future__ import annotations

import json
import os
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

#: safetensors dtype names -> torch dtypes (those our models load)
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
                      "I32": torch.int32, "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes live in its file."""

    dtype: torch.dtype | None  # None: a dtype not in SAFETENSORS_DTYPES
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_header(path: str | Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file by name (its ``__metadata__`` left out); ValueError on a bad header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:
            raise ValueError(f"{path}: safetensors header length {n} exceeds the file ({size} bytes)")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header ({exc})") from None
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= size - 8 - n:
            raise ValueError(f"{path}: tensor {name!r} lies outside the file (bytes {begin}-{end})")
        out[name] = StoredTensor(SAFETENSORS_DTYPES.get(info["dtype"]), tuple(info["shape"]), 8 + n + begin,
                                 end - begin)
    return out


class WeightStreamer:
    """Copies stored tensors into destination tensors on ``device``: ``add`` queues, ``finish`` waits.

    ``threads`` workers, each with two pinned buffers of ``chunk_bytes`` and its own CUDA stream; a tensor larger
    than a chunk is cut into chunks that different workers take. On a CPU device the buffers are plain memory
    and the copies synchronous (the same code path, for tests)."""

    def __init__(self, device: torch.device, threads: int = 4, chunk_bytes: int = 32 << 20) -> None:
        if threads < 1 or chunk_bytes < 1:
            raise ValueError(f"threads={threads}, chunk_bytes={chunk_bytes}: both must be >= 1")
        self.device, self.threads, self.chunk = device, threads, chunk_bytes
        self._cuda = device.type == "cuda"
        self._tasks: list[tuple[str, int, int, torch.Tensor]] = []  # (file, offset, nbytes, destination bytes)

    def accepts(self, stored: StoredTensor, dst: torch.Tensor) -> bool:
        """Whether ``stored`` can go straight into ``dst`` (same dtype and element count, ``dst`` contiguous)."""
        return (stored.dtype is not None and stored.dtype == dst.dtype and dst.is_contiguous()
                and dst.device.type == self.device.type and stored.nbytes == dst.numel() * dst.element_size()
                and stored.shape == tuple(dst.shape))

    def add(self, path: str | Path, stored: StoredTensor, dst: torch.Tensor) -> None:
        """Queue ``stored`` (of file ``path``) into ``dst``; ``accepts`` must hold."""
        if not self.accepts(stored, dst):
            raise ValueError(f"cannot stream a {stored.dtype} {stored.shape} tensor into a {dst.dtype} "
                             f"{tuple(dst.shape)} destination")
        if stored.nbytes == 0:
            return
        flat = dst.view(-1).view(torch.uint8)
        for start in range(0, stored.nbytes, self.chunk):
            n = min(self.chunk, stored.nbytes - start)
            self._tasks.append((str(path), stored.offset + start, n, flat[start:start + n]))

    def finish(self) -> int:
        """Run every queued copy and wait for them; returns the bytes copied. OSError if a read comes up short."""
        tasks, self._tasks = self._tasks, []
        if not tasks:
            return 0
        fds = {p: os.open(p, os.O_RDONLY) for p in sorted({t[0] for t in tasks})}
        queue = deque(tasks)  # the workers' shared to-do list, in file order (popleft is thread-safe)

        def take():
            try:
                return queue.popleft()
            except IndexError:
                return None

        size = max(t[2] for t in tasks)  # (no bigger than the chunk: a small model pins only what it needs)
        ready = None
        if self._cuda:  # the destinations' allocation and any fill queued before must come first
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        try:
            workers = min(self.threads, len(tasks))
            with ThreadPoolExecutor(workers, thread_name_prefix="strata-weights") as pool:
                for f in [pool.submit(self._work, take, fds, size, ready) for _ in range(workers)]:
                    f.result()
        finally:
            for fd in fds.values():
                os.close(fd)
        return sum(t[2] for t in tasks)

    def _work(self, take, fds: dict[str, int], size: int, ready) -> None:
        bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(2)]
        views = [memoryview(b.numpy()) for b in bufs]
        stream = torch.cuda.Stream(self.device) if self._cuda else None
        if stream is not None:
            stream.wait_event(ready)
        done = [None, None]  # the event after each buffer's last copy
        k = 0
        while (task := take()) is not None:
            path, offset, n, dst = task
            if done[k] is not None:
                done[k].synchronize()  # that buffer's previous copy has left it
            _read_exact(fds[path], views[k][:n], offset, path)
            if stream is None:
                dst.copy_(bufs[k][:n])
            else:
                with torch.cuda.stream(stream):
                    dst.copy_(bufs[k][:n], non_blocking=True)
                    done[k] = torch.cuda.Event()
                    done[k].record(stream)
            k ^= 1
        if stream is not None:
            stream.synchronize()  # every copy landed before finish returns (and before the buffers are freed)


def _read_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"{path}: file ended {len(view) - got} bytes early at offset {offset + got}")
        got += n
