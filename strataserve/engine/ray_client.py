"""``RayCoreClient``: an engine core hosted in a Ray actor, on whatever node of the Ray cluster has its resources.

Why the actor hosts the same zmq step loop as the engine-core process (``core_proc.serve_core``) instead of
being driven by actor-method calls: a method call costs a task submission and an object-store round trip, and
the engine streams one output batch per step (hundreds per second) to the front. Over zmq the actor pushes each
step's msgpack batch as it is made, exactly as a local core does, and the front's ``AsyncLLM`` cannot tell the
two apart. Ray is used for what it is good at: placing the actor (its CPUs and GPUs; a placement group when one
replica needs several GPUs, so they are on one node), and telling us when it dies -- the actor's long-running
``serve`` call resolves with an error the moment Ray notices, which the front watches like a process sentinel.

Addresses: the front binds; the actor connects. On the front's own node that is two ipc:// paths; on another
node, two tcp:// ports on the front's node address (Ray already requires the nodes to reach each other).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from typing import Any, Callable

import msgspec

from strataserve.config import EngineConfig
from strataserve.engine.core_client import CoreInfo
from strataserve.engine.core_proc import ReadyInfo, core_ready_info, build_core, serve_core
from strataserve.startup import freeze_startup_heap
from strataserve.types.errors import EngineStartupError
from strataserve.engine.zmq_client import ZmqCoreClient

#: the Ray namespace of the engine actors (``ray.get_actor(name, namespace=NAMESPACE)`` finds them)
NAMESPACE = "strataserve"
RAY_MISSING = "placement: ray needs Ray, which is not installed: pip install 'strataserve[ray]'"


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(RAY_MISSING) from None
    return ray


def ensure_ray(address: str | None) -> Any:
    """``ray.init`` once per process: ``address`` None lets Ray find a cluster (``RAY_ADDRESS``, else a new local
    one); "auto" means the cluster ``ray start`` joined this machine to; else the head's ``HOST:PORT``.
    A process that already called ``ray.init`` (a test, a benchmark) keeps its cluster."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
    return ray


class _CoreHost:
    """The actor: loads the model in ``__init__`` (a failure there surfaces at ``ready``), then ``serve`` runs
    the step loop until the front sends SHUTDOWN."""

    def __init__(self, config: EngineConfig, core_factory: Callable[[EngineConfig], Any] | None) -> None:
        self.core = build_core(config, core_factory)
        self.info = core_ready_info(self.core, config)

    def ready(self) -> tuple[bytes, str, list]:
        import ray

        return (msgspec.msgpack.encode(self.info), ray.get_runtime_context().get_node_id(),
                [str(g) for g in ray.get_gpu_ids()])

    def serve(self, input_addr: str, output_addr: str) -> None:
        # Never orphaned: Ray kills a (non-detached) actor when the process that made it dies.
        serve_core(self.core, input_addr, output_addr, lambda: False, freeze_startup_heap)  # a worker of its own


def _short(exc: BaseException) -> str:
    """The last meaningful line of a Ray error (they carry the remote traceback)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


class RayCoreClient(ZmqCoreClient):
    """Starts one engine actor (``num_cpus`` CPUs, ``num_gpus`` GPUs) and talks to it over zmq. Construct from
    synchronous code: it blocks until the model is loaded (``EngineStartupError`` if it fails or times out)."""

    def __init__(self, config: EngineConfig, *, name: str, num_gpus: float = 0.0, num_cpus: float = 1.0,
                 startup_timeout_s: float | None = None,
                 core_factory: Callable[[EngineConfig], Any] | None = None) -> None:
        super().__init__()
        ray = require_ray()
        self.name = f"{name}-{uuid.uuid4().hex[:6]}"  # unique in the namespace, also across restarts
        self._pg: Any = None
        self._actor: Any = None
        self._serve: concurrent.futures.Future | None = None
        try:
            self._actor = ray.remote(_CoreHost).options(**self._placement(ray, num_gpus, num_cpus)).remote(
                config, core_factory)
            try:
                raw, node, self.gpu_ids = ray.get(self._actor.ready.remote(), timeout=startup_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise EngineStartupError(f"engine actor {self.name} did not finish loading within "
                                         f"{startup_timeout_s:.0f}s (is the cluster short of resources?)") from None
            except ray.exceptions.RayActorError as exc:
                raise EngineStartupError(f"engine actor {self.name} failed to load the model: {_short(exc)}") from None
            self.ready_info = msgspec.msgpack.decode(raw, type=ReadyInfo)
            self.node_id = node
            local = node == ray.get_runtime_context().get_node_id()
            addrs = self._bind(None if local else ray.util.get_node_ip_address())
            self._serve = self._actor.serve.remote(*addrs).future()
            self._wait_connected()
        except BaseException:
            self.shutdown()
            raise
        self.info = CoreInfo(max_model_len=self.ready_info.max_model_len, num_blocks=self.ready_info.num_blocks,
                             block_size=self.ready_info.block_size)

    def _placement(self, ray: Any, num_gpus: float, num_cpus: float) -> dict[str, Any]:
        opts: dict[str, Any] = dict(name=self.name, namespace=NAMESPACE, num_cpus=num_cpus, num_gpus=num_gpus,
                                    max_restarts=0)  # the router restarts it: new sockets, new actor
        if num_gpus > 1:
            # One bundle holds every GPU of the replica (its tensor-parallel ranks are processes the core spawns),
            # STRICT_PACK keeps them on one node; the group is released with the replica.
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = {k: v for k, v in (("CPU", num_cpus), ("GPU", num_gpus)) if v}  # Ray refuses 0 amounts
            self._pg = placement_group([bundle], strategy="STRICT_PACK", name=f"{self.name}-pg")
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
        return opts

    # ------------------------------------------------------------------ the actor
    def _core_alive(self) -> bool:
        return self._serve is not None and not self._serve.done()

    def _exit_reason(self) -> str:
        f = self._serve
        if f is None or not f.done():
            return f"engine actor {self.name} is gone"
        exc = None if f.cancelled() else f.exception()
        return f"engine actor {self.name} died: {_short(exc)}" if exc else f"engine actor {self.name} stopped"

    def _watch_exit(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        def fired(_: Any) -> None:  # on a Ray thread
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(on_exit)
                except RuntimeError:  # the loop closed in between
                    pass

        if self._serve is not None:
            self._serve.add_done_callback(fired)

    def _stop_core(self, timeout_s: float) -> None:
        import ray

        if self._serve is not None:
            try:
                self._serve.result(timeout=timeout_s)  # SHUTDOWN was sent: the loop returns
            except Exception:  # noqa: BLE001 -- dead, or slow to stop: killed below either way
                pass
        if self._actor is not None:
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:  # noqa: BLE001 -- already gone
                pass
        if self._pg is not None:
            try:
                ray.util.remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
