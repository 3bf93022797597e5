"""Tensor parallelism's processes: rank 0 is the engine (scheduler, sampler, its own shard); ranks
1..N-1 are worker processes (multiprocessing spawn) that hold their shard and cache and run the steps
rank 0 broadcasts to them. One torch.distributed group joins them: gloo on CPU, NCCL on CUDA. It is
the process's default group, so one engine at a time holds it; shutdown(), dropping the engine, or
the interpreter's exit frees it for the next.

Per step rank 0 broadcasts the scheduler's plan first (torch.distributed.broadcast_object_list: the
same StepPlan its own runner receives, less the sampling state, and which logit rows the step
computes); each rank's runner applies it to its own state of the requests, prepares its inputs and
runs the same forward, with the all-reduces and the logits gather inside the model
(distributed/parallel.py). Only rank 0 samples and answers. Each rank has its own paged cache with
the same block ids, so the scheduler does not know tensor parallelism exists.

Two ways to start the ranks: rank 0 spawns the others on this machine (the default), or every rank
is started from outside with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), one machine or several, each running the same `twostep serve` command:
rank 0 serves, the others become workers (launched_rank()), join the group, and receive from
rank 0 what to build.

Failures: a worker that cannot load reports its error before the group forms; a worker that dies
later is named (rank, pid, exit code) by the next step, and one that hangs ends the step with the
group's timeout. Workers die with their parent (PR_SET_PDEATHSIG) and are stopped by shutdown().
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import logging
import multiprocessing
import os
import signal
import socket
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from twostep.config.engine import EngineConfig
from twostep.core.execution.model_builder import CacheSpec, ModelSpec, build_model_instance
from twostep.core.step_outputs import StepPlan
from twostep.distributed.parallel import TensorParallel
from twostep.sample.sampler import Sampler

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed: which rank, and how."""


@dataclass(slots=True)
class WorkerSpec:
    """What a worker needs to build its shard (picklable; the platform is rebuilt in the worker)."""

    model: ModelSpec
    cache: CacheSpec
    device: str
    config: EngineConfig            # the engine's options (the platform reads its cpu_* ones)
    backend: str                    # gloo | nccl
    init_method: str
    timeout_s: float
    cpus: list[int] | None = None   # cores this rank is pinned to
    num_threads: int | None = None


def default_init_method() -> str:
    """MASTER_ADDR / MASTER_PORT when set (torchrun's variables), else a free port here."""
    addr = os.environ.get("MASTER_ADDR")
    if addr and os.environ.get("MASTER_PORT"):
        return f"tcp://{addr}:{os.environ['MASTER_PORT']}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def launched_rank(world_size: int) -> int | None:
    """This process's rank when torchrun (or the like) started every rank, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"WORLD_SIZE {os.environ['WORLD_SIZE']} but --tensor-parallel-size {world_size}")
    return int(os.environ["RANK"])


def cores_for(rank: int, world_size: int, cores: list[int] | None = None) -> list[int] | None:
    """This rank's share of these cores (default: those this process may use), or None when there
    are too few to give each rank one."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    per = len(cores) // world_size
    return cores[rank * per:(rank + 1) * per] if per else None


class TPGroup:
    """Rank 0's side: the workers, and the broadcast of each step to them."""

    def __init__(self, spec: WorkerSpec, world_size: int, cores: list[int]) -> None:
        self.world_size, self.timeout_s = world_size, spec.timeout_s
        self.procs: list[multiprocessing.Process] = []
        _claim_default_group(self)
        # stops the workers and frees the group when shutdown() is called, when the engine is
        # dropped without it, or at interpreter exit: never a reference to self
        self._finalizer = weakref.finalize(self, _stop, self.procs)
        if launched_rank(world_size) is not None:
            self._join_launched(spec)
            return
        ctx = multiprocessing.get_context("spawn")
        pipes = []
        for rank in range(1, world_size):
            parent, child = ctx.Pipe(duplex=False)
            worker = _with_rank(spec, rank, world_size, cores)
            proc = ctx.Process(target=worker_main, args=(rank, world_size, worker, child),
                               name=f"twostep-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            pipes.append(parent)
        try:
            self._wait_ready(pipes)
            dist.init_process_group(spec.backend, init_method=spec.init_method, rank=0, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=spec.timeout_s))
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallelism: %d ranks (%s, %s); workers %s", world_size, spec.backend,
                    spec.init_method, ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self.procs, 1)))

    def _join_launched(self, spec: WorkerSpec) -> None:
        """The workers were started from outside: form the group, send them the spec, collect
        each one's load status."""
        dist.init_process_group(spec.backend, init_method="env://", rank=0, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
        dist.broadcast_object_list([spec], src=0)
        statuses = [None] * self.world_size
        dist.all_gather_object(statuses, "ready")
        bad = [f"rank {r}: {st}" for r, st in enumerate(statuses) if st != "ready"]
        if bad:
            self.shutdown()
            raise WorkerError(f"tensor-parallel workers failed to load: {'; '.join(bad)}")
        logger.info("tensor parallelism: %d ranks started from outside (%s, %s:%s)", self.world_size,
                    spec.backend, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))

    def _wait_ready(self, pipes) -> None:
        for rank, (pipe, proc) in enumerate(zip(pipes, self.procs), 1):
            while not pipe.poll(0.2):
                if not proc.is_alive():
                    raise WorkerError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with "
                                      f"code {proc.exitcode} while loading")
            status = pipe.recv()
            if status != "ready":
                raise WorkerError(f"tensor-parallel worker rank {rank} failed to load: {status}")

    @contextlib.contextmanager
    def step(self, plan: StepPlan, rows: str):
        """Broadcast the step, then run rank 0's part in the with-block: a collective that fails
        or times out names the worker that is gone, or says that none answered in time."""
        self.check()
        try:
            dist.broadcast_object_list([(plan.for_workers(), rows)], src=0)
            yield
        except RuntimeError as e:
            self.check()
            if not (isinstance(e, dist.DistError) or "gloo" in str(e).lower() or "timed out" in str(e).lower()):
                raise                 # rank 0's own failure, not the group's
            raise WorkerError(f"tensor-parallel step failed: no answer from the other ranks within "
                              f"{self.timeout_s:.0f} s (a worker hung?): {e}") from e

    def check(self) -> None:
        """Raise WorkerError naming the first worker that is gone."""
        for rank, proc in enumerate(self.procs, 1):
            if not proc.is_alive():
                raise WorkerError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died "
                                  f"(exit code {proc.exitcode})")

    def shutdown(self) -> None:
        """Tell the workers to stop; whatever does not stop in time is killed. No orphans."""
        global _owner
        self._finalizer()
        if _live_owner() is self:
            _owner = None


# torch.distributed has one default group a process, and the TPGroup that formed it (weakly: an
# engine dropped without shutdown() must not keep it from being freed)
_owner: weakref.ref | None = None


def _live_owner() -> TPGroup | None:
    return None if _owner is None else _owner()


def _claim_default_group(group: TPGroup) -> None:
    """Make `group` the owner of the process's default group, freeing one that a dropped engine left."""
    global _owner
    if _live_owner() is not None:
        gc.collect()            # a dropped engine may wait in a reference cycle: its finalizer frees it
    if _live_owner() is not None:
        raise RuntimeError("another tensor-parallel engine in this process holds torch.distributed's "
                           "group: shut it down first (LLM.shutdown(), `with LLM(...)`, or del)")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed's default group is already initialized in this process "
                           "(by other code): tensor parallelism needs it")
    _owner = weakref.ref(group)


def _stop(procs: list[multiprocessing.Process]) -> None:
    """Tell the workers to stop and free the group; whatever does not stop in time is killed."""
    if dist.is_initialized():
        if all(p.is_alive() for p in procs):
            try:
                dist.broadcast_object_list([None], src=0)
            except RuntimeError:
                pass
        dist.destroy_process_group()
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.1))
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    procs.clear()


def _with_rank(spec: WorkerSpec, rank: int, world_size: int, cores: list[int]) -> WorkerSpec:
    """The rank's share of the machine's cores (all of them, unpinned, when there are too few):
    never the affinity it would inherit from rank 0, which has pinned itself already."""
    import dataclasses

    cpus = cores_for(rank, world_size, cores) or cores
    return dataclasses.replace(spec, cpus=cpus, num_threads=spec.num_threads or len(cpus))


def worker_main(rank: int, world_size: int, spec: WorkerSpec, ready) -> None:
    """A worker process: build this rank's shard, join the group, run steps until told to stop."""
    _die_with_parent()
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    try:
        instance = _build(rank, world_size, spec)
    except Exception as e:  # reported to rank 0, which names it
        ready.send(f"{type(e).__name__}: {e}")
        return
    ready.send("ready")
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))
    _serve_steps(instance.runner)
    dist.destroy_process_group()


def run_launched_worker(world_size: int, backend: str, timeout_s: float) -> int:
    """A rank > 0 started from outside (torchrun): join, get the spec from rank 0, build, report,
    run steps until rank 0 says stop."""
    import dataclasses

    rank = launched_rank(world_size)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    box = [None]
    dist.broadcast_object_list(box, src=0)
    local = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cpus = cores_for(*local)
    spec = dataclasses.replace(box[0], cpus=cpus, num_threads=box[0].num_threads or (len(cpus) if cpus else None))
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    try:
        instance, status = _build(rank, world_size, spec), "ready"
    except Exception as e:
        instance, status = None, f"{type(e).__name__}: {e}"
    dist.all_gather_object([None] * world_size, status)
    if instance is not None:
        _serve_steps(instance.runner)
    dist.destroy_process_group()
    return 0 if instance is not None else 1


def _serve_steps(runner) -> None:
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            plan, rows = box[0]
            runner.run_worker(plan, rows)


def _build(rank: int, world_size: int, spec: WorkerSpec):
    from twostep.platforms import get_platform

    device = torch.device(spec.device)
    if device.type == "cuda":      # one GPU per rank on its machine (untested here: no GPUs)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    platform = get_platform(device, spec.config)
    import dataclasses

    model = dataclasses.replace(spec.model, platform=platform, tp=TensorParallel(rank, world_size))
    return build_model_instance(model, spec.cache, Sampler(torch.Generator()))


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGTERM to this process when its parent exits (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)           # PR_SET_PDEATHSIG
    except OSError:
        pass
