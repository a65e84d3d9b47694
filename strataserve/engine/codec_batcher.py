"""Audio windows of many speech streams decoded together: one codec forward per window shape for every window
that waits, on one worker thread.

Each stream asks for its chunks one window at a time (``SpeechStream``). Decoded one window per forward, the codec
thread was the served ceiling: ~280-300 frames/s at 8, 16 and 32 concurrent streams of the 1.7B model, against
1,000-4,000 frames/s from the engine alone (docs/performance.md, "Served Qwen3-TTS at concurrency"). Here the
windows that arrive while a forward runs wait for the next one and go in together, grouped by shape (left context,
frames): rows of one shape stack without padding, so a row's samples are its own. At low load a window finds the
thread idle and goes at once, alone, as before.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAX_ROWS = 32  # windows per forward: bounds the codec's activations (~64k samples per row at 33 frames)


@dataclass(slots=True)
class _Window:
    frames: list[list[int]]  # the left context then the frames to decode, each K codebook ids
    context: int
    future: asyncio.Future


class CodecBatcher:
    """``await decode(frames, start, end)`` -> float32 samples of frames [start, end), decoded with up to
    ``left_context`` earlier frames in front (the codec's ``decode_window``); windows waiting together share a
    forward. ``forwards`` / ``windows`` count what ran."""

    def __init__(self, codec: Any, device: Any, pool: Executor, left_context: int) -> None:
        self.codec, self.device, self.pool, self.left_context = codec, device, pool, left_context
        # its own CUDA stream: on the default one the codec's kernels queued behind the talker's steps (and its
        # copy back to the host waited for them), so the two never overlapped on the device
        self.stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
        self._waiting: list[_Window] = []
        self._drain: asyncio.Task | None = None
        self.forwards = 0
        self.windows = 0

    async def decode(self, frames: list[list[int]], start: int, end: int) -> np.ndarray:
        ctx = min(self.left_context, start)
        loop = asyncio.get_running_loop()
        window = _Window(frames[start - ctx:end], ctx, loop.create_future())
        self._waiting.append(window)
        if self._drain is None or self._drain.done():
            self._drain = loop.create_task(self._run_waiting())
        return await window.future

    async def _run_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_ROWS], self._waiting[MAX_ROWS:]
            batch = [w for w in batch if not w.future.done()]  # a stream that went away while waiting
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self.pool, self._forward, batch)
            except asyncio.CancelledError:
                for w in batch + self._waiting:
                    w.future.cancel()
                raise
            except BaseException as exc:  # noqa: BLE001 - every stream in the batch gets the error
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(exc)
                continue
            for w, pcm in zip(batch, results):
                if not w.future.done():
                    w.future.set_result(pcm)

    def _forward(self, batch: list[_Window]) -> list[np.ndarray]:
        """On the codec thread: one forward per (context, frames) shape."""
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, w in enumerate(batch):
            groups[(w.context, len(w.frames))].append(i)
        out: list[np.ndarray] = [np.empty(0, np.float32)] * len(batch)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for (ctx, length), rows in groups.items():
                codes = torch.tensor([batch[i].frames for i in rows], dtype=torch.long).transpose(1, 2)  # [B,K,T]
                wav = self.codec.decode_window(codes.to(self.device), ctx, length, left_context=ctx).cpu().numpy()
                for j, i in enumerate(rows):
                    out[i] = wav[j].astype(np.float32, copy=False)
                self.forwards += 1
        self.windows += len(batch)
        return out
