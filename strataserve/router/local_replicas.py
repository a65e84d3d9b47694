"""Replicas of one local model: K engine cores (processes on this host, or Ray actors anywhere on a cluster),
one ``AsyncLLM`` front per core, behind one object that the OpenAI routes use like a single ``AsyncLLM``.

Choice: the router's ``ReplicaSet`` (least outstanding requests, prefix affinity on the prompt's leading token
ids while the load is even), so requests sharing a prompt prefix meet that replica's prefix cache.

Failure: a replica whose core died is skipped at once (its health is read at every choice: a process sentinel
or an actor's finished ``serve`` call, no probe round trip). Its requests in flight fail with the 503
``engine_dead`` error; a request that had not produced any output yet is sent to another replica instead. One
``EngineSupervisor`` per replica (``router/supervisor.py``) starts a replacement; meanwhile ``/health`` reports
the model as degraded and the other replicas serve.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from array import array
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from strataserve.config import EngineConfig
from strataserve.types.errors import EngineDeadError
from strataserve.engine.input_processor import load_tokenizer
from strataserve.types.protocol import SchedulerStats
from strataserve.router.replicas import Replica, ReplicaSet


@dataclass(frozen=True)
class ReplicaPlan:
    """How many engine cores serve one model and where they run; ``num_gpus`` is per replica (resolved)."""

    count: int
    placement: Literal["local", "ray"]
    num_gpus: float = 0.0
    ray_address: str | None = None


def tensor_parallel_size(config: EngineConfig) -> int:
    """GPUs one engine of this config spans."""
    return config.parallel.tensor_parallel_size


def resolve_gpus(requested: float | None, config: EngineConfig, gpus_available: float) -> float:
    """GPUs per replica: the config's ``num_gpus_per_replica``, else the tensor-parallel size, else 1 on CUDA
    and 0 on CPU (``device: auto`` means CUDA when GPUs are there)."""
    if requested is not None:
        return requested
    device = config.model.device
    on_cuda = device.startswith("cuda") or (device == "auto" and gpus_available > 0)
    return float(tensor_parallel_size(config)) if on_cuda else 0.0


def check_gpus(name: str, plan: ReplicaPlan, gpus_available: float, where: str) -> None:
    need = plan.count * plan.num_gpus
    if need > gpus_available:
        raise ValueError(f"model {name}: {plan.count} replicas x {plan.num_gpus:g} GPUs (num_gpus_per_replica) "
                         f"need {need:g} GPUs but {where} has {gpus_available:g}; lower replicas or "
                         "num_gpus_per_replica")


class ReplicaLauncher:
    """Starts replica ``i`` of one model: an engine core (``MPCoreClient`` or ``RayCoreClient``) and its
    ``AsyncLLM`` front. Blocking (the core loads the model); the supervisor calls it on a worker thread."""

    def __init__(self, name: str, config: EngineConfig, plan: ReplicaPlan,
                 startup_timeout_s: float | None = None) -> None:
        self.name, self.config, self.plan = name, config, plan
        self.startup_timeout_s = startup_timeout_s
        self.tokenizer: Any = None  # shared by the replicas (None: each loads its own)

    def _local_env(self, i: int) -> dict[str, str]:
        """Replica ``i``'s share of this host's GPUs (whole GPUs only), as ``CUDA_VISIBLE_DEVICES``."""
        g = int(self.plan.num_gpus)
        if g < 1:
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [d.strip() for d in visible.split(",") if d.strip()]
        else:
            import torch

            ids = [str(d) for d in range(torch.cuda.device_count())]
        mine = ids[i * g:(i + 1) * g]
        if len(mine) < g:
            raise ValueError(f"model {self.name}: replica {i} needs GPUs {i * g}..{(i + 1) * g - 1} but this host "
                             f"shows {len(ids)}; lower replicas or num_gpus_per_replica")
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}

    def start_core(self, i: int) -> Any:
        """Replica ``i``'s core client: a Ray actor with its model loaded, or a local process still loading
        (``front`` waits for it)."""
        if self.plan.placement == "ray":
            from strataserve.engine.ray_client import RayCoreClient

            return RayCoreClient(self.config, name=f"{self.name}-r{i}", num_gpus=self.plan.num_gpus,
                                 startup_timeout_s=self.startup_timeout_s)
        from strataserve.engine.mp_client import MPCoreClient

        config = self.config
        if self.plan.num_gpus >= 1 and config.model.device.startswith("cuda:"):
            # the child sees only its own GPUs, numbered from 0
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, device="cuda"))
        return MPCoreClient(config, self.startup_timeout_s, env=self._local_env(i), wait=False)

    def front(self, client: Any) -> Any:
        """The ``AsyncLLM`` over a started core client (waits for a local process's model to load)."""
        from strataserve.engine.async_llm import AsyncLLM

        try:
            if hasattr(client, "wait_ready"):
                client.wait_ready()
            engine = AsyncLLM(self.config, core_client=client, tokenizer=self.tokenizer)
        except BaseException:
            client.shutdown()
            raise
        self.tokenizer = engine.tokenizer
        return engine

    def __call__(self, i: int) -> Any:
        return self.front(self.start_core(i))


def _affinity_key(prompt: Any, chars: int) -> bytes | str | None:
    """What prefix affinity hashes: the leading token ids (4 bytes each) or the leading characters."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return array("I", prompt[: max(1, chars // 4)]).tobytes()
    return None


class ReplicatedEngine:
    """``AsyncLLM``'s serving surface (``generate``, ``check_health``, ``stats``, ``tokenizer``, ``max_model_len``,
    ``vocab_size``, ``shutdown``) over several replicas of one model. Invariant: ``engines[i]`` is replica
    ``i``'s live front, replaced in place by its supervisor after a crash."""

    def __init__(self, name: str, engines: list[Any], *, affinity_chars: int = 256, slack: int = 2) -> None:
        if not engines:
            raise ValueError(f"model {name}: replicas must be at least 1")
        self.name = name
        self.engines = list(engines)
        self.set = ReplicaSet(name, [f"{name}[{i}]" for i in range(len(engines))], affinity_chars=affinity_chars,
                              slack=slack)
        first = engines[0]
        self.config = first.config
        self.tokenizer = first.tokenizer
        self.vocab_size = first.vocab_size
        self._max_model_len = first.max_model_len
        self.launcher: ReplicaLauncher | None = None  # starts a replacement for replica i (the supervisors')

    # ------------------------------------------------------------------ replicas
    def replace(self, i: int, engine: Any) -> None:
        self.engines[i] = engine

    def _refresh(self) -> None:
        for r, engine in zip(self.set.replicas, self.engines):
            try:
                engine.check_health()
            except EngineDeadError as exc:
                if r.healthy:
                    r.mark_down(str(exc))
            else:
                r.mark_up()

    def alive(self) -> list[bool]:
        self._refresh()
        return [r.healthy for r in self.set.replicas]

    def describe(self) -> list[dict[str, Any]]:
        """One entry per replica for ``/v1/models``: health, load, and where its core runs."""
        self._refresh()
        rows = []
        for i, (r, engine) in enumerate(zip(self.set.replicas, self.engines)):
            core = engine.core
            row: dict[str, Any] = {"replica": i, "healthy": r.healthy, "outstanding": r.outstanding,
                                   "served": r.served}
            for attr in ("name", "node_id", "gpu_ids", "pid"):
                v = getattr(core, attr, None)
                if v is not None:
                    row["actor" if attr == "name" else attr] = v
            rows.append(row)
        return rows

    # ------------------------------------------------------------------ AsyncLLM's surface
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def dead_error(self) -> BaseException | None:
        if any(self.alive()):
            return None
        return EngineDeadError(self._unavailable())

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def _unavailable(self) -> str:
        n = len(self.engines)
        errs = "; ".join(f"{r.url}: {r.last_error or 'down'}" for r in self.set.replicas)
        return f"{'its replica is' if n == 1 else f'all {n} replicas are'} down ({errs})"

    def check_health(self) -> None:
        err = self.dead_error
        if err is not None:
            raise err

    @property
    def stats(self) -> SchedulerStats | None:
        """The replicas' stats added up (KV usage: used blocks over all blocks)."""
        parts = [s for s in (getattr(e, "stats", None) for e in self.engines) if s is not None]
        if not parts:
            return None
        total = SchedulerStats()
        for s in parts:
            for key in SchedulerStats.__struct_fields__:
                if key != "kv_cache_usage":
                    setattr(total, key, getattr(total, key) + getattr(s, key))
        used = sum(s.num_total_blocks - s.num_free_blocks for s in parts)
        total.kv_cache_usage = used / total.num_total_blocks if total.num_total_blocks else 0.0
        return total

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       priority: int = 0) -> AsyncIterator[Any]:
        """Stream one request from the replica the router picks; retried on another replica when the chosen
        one dies before the request produced anything (nothing was streamed, so nothing is repeated)."""
        key = _affinity_key(prompt, self.set.affinity_chars)
        tried: tuple[Replica, ...] = ()
        while True:
            self._refresh()
            r = self.set.choose(key, exclude=tried)
            if r is None:
                raise EngineDeadError(self._unavailable())
            engine = self.engines[self.set.replicas.index(r)]
            streamed = False
            r.outstanding += 1
            agen = engine.generate(prompt, sampling_params, request_id, priority=priority)
            try:
                async for out in agen:
                    streamed = True
                    yield out
                r.served += 1
                return
            except EngineDeadError as exc:
                r.mark_down(str(exc))
                if streamed:
                    raise
                tried += (r,)
            finally:
                r.outstanding -= 1
                await agen.aclose()  # aborts the request in that core when we stop early

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()


def start_replicas(name: str, config: EngineConfig, *, count: int, placement: Literal["local", "ray"],
                   ray_address: str | None = None, num_gpus_per_replica: float | None = None,
                   startup_timeout_s: float | None = None, affinity_chars: int = 256,
                   slack: int = 2) -> ReplicatedEngine:
    """Start ``count`` replicas of one model at once (their models load in parallel) and return them behind one
    ``ReplicatedEngine``; its ``launcher`` starts a replacement. Raises (after stopping those that started) if
    any replica fails to start, or ValueError when the GPUs asked for are not there."""
    if placement == "ray":
        from strataserve.engine.ray_client import ensure_ray

        gpus, where = float(ensure_ray(ray_address).cluster_resources().get("GPU", 0)), "the Ray cluster"
    else:
        import torch

        gpus, where = float(torch.cuda.device_count()), "this host"
    plan = ReplicaPlan(count, placement, resolve_gpus(num_gpus_per_replica, config, gpus), ray_address)
    check_gpus(name, plan, gpus, where)
    launcher = ReplicaLauncher(name, config, plan, startup_timeout_s)
    # Once, here: the replicas share it, and transformers' lazy imports are not safe to race on threads.
    launcher.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model, config.model.skip_tokenizer_init)
    engines: list[Any] = []
    try:
        if placement == "ray":  # the actors load their models in parallel
            with concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix=f"start-{name}") as pool:
                futures = [pool.submit(launcher, i) for i in range(count)]
                concurrent.futures.wait(futures)
            engines = [f.result() for f in futures if f.exception() is None]
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
        else:
            # Spawned from this thread (a child's parent-death signal fires when the *thread* that spawned it
            # exits, so a pool thread would take its engine process down with it); they load side by side.
            clients: list[Any] = []
            try:
                for i in range(count):
                    clients.append(launcher.start_core(i))
                while clients:
                    engines.append(launcher.front(clients.pop(0)))
            except BaseException:
                for c in clients:
                    c.shutdown()
                raise
    except BaseException:
        for e in engines:
            e.shutdown()
        raise
    engine = ReplicatedEngine(name, engines, affinity_chars=affinity_chars, slack=slack)
    engine.launcher = launcher
    return engine
