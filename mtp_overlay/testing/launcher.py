"""Run a function on N spawned torch.distributed ranks with Megatron model parallelism set up.

``run_ranks(fn, world_size, tp=2)`` spawns ``world_size`` processes; each joins a process group on
127.0.0.1 (gloo on CPU, nccl on CUDA), calls ``parallel_state.initialize_model_parallel(tp, 1, cp)``,
seeds every generator (torch, Python, Megatron's model-parallel RNG tracker), runs
``fn(*args, **kwargs)`` and always tears down (``destroy_model_parallel`` and
``destroy_process_group``), even when ``fn`` raises. On CPU the shims of ``cpu_shims`` are installed
around all of it. A rank that crashes or hangs never hangs the caller: the run is bounded by
``timeout`` and, once one rank failed, the others get ``FAILURE_GRACE_S`` before they are killed.

``fn`` and its arguments must be picklable (a module-level function), as must its return value.
"""

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback

FAILURE_GRACE_S = 10.0
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass
class RankResult:
    """What one rank gave back: ``value`` (fn's return) or ``error`` (traceback text), never both."""

    rank: int
    value: object = None
    error: str | None = None

    @property
    def ok(self):
        return self.error is None


class RanksFailed(RuntimeError):
    """Some ranks failed; the message holds every failed rank's traceback, ``results`` all results."""

    def __init__(self, results):
        self.results = results
        failed = [r for r in results if not r.ok]
        text = "\n".join(f"--- rank {r.rank} ---\n{r.error.rstrip()}" for r in failed)
        super().__init__(f"{len(failed)} of {len(results)} ranks failed:\n{text}")


def run_ranks(
    fn, world_size, *, tp=1, cp=1, args=(), kwargs=None, fixes=None, timeout=300, seed=1234, device="cpu"
):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; one RankResult per rank, by rank.

    tp, cp: tensor / context parallel sizes (``world_size`` must be a multiple of ``tp * cp``; the
    rest is data parallel). fixes: overlay fixes installed in the workers; None leaves what
    ``import mtp_overlay`` installs, a list of fix names installs exactly those, ``[]`` none.
    timeout: seconds for the whole run. seed: seeds torch, ``random`` and Megatron's RNG tracker
    identically on every rank. device: "cpu" (gloo + CPU shims) or "cuda" (nccl, no shims, one GPU
    per rank).
    """
    _check_arguments(world_size, tp, cp, fixes, timeout, device)
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    readers, processes = {}, {}
    try:
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)
            readers[reader] = rank
            setup = dict(rank=rank, world_size=world_size, port=port, seed=seed)
            setup.update(tp=tp, cp=cp, fixes=fixes, device=device)
            processes[rank] = context.Process(
                target=_worker, args=(setup, fn, tuple(args), dict(kwargs or {}), writer), daemon=True
            )
            try:
                processes[rank].start()  # pickles fn, args and kwargs
            finally:
                writer.close()  # the child holds the only writer: EOF on the reader means it died
        return _collect(readers, processes, timeout)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            if process.pid is not None:  # started
                process.join(5)
        for reader in readers:
            reader.close()


def run_ranks_checked(fn, world_size, **options):
    """``run_ranks`` that returns the values by rank, or raises RanksFailed with every traceback."""
    results = run_ranks(fn, world_size, **options)
    if not all(result.ok for result in results):
        raise RanksFailed(results)
    return [result.value for result in results]


def _check_arguments(world_size, tp, cp, fixes, timeout, device):
    for name, value in (("world_size", world_size), ("tp", tp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if world_size % (tp * cp):
        raise ValueError(f"world_size ({world_size}) must be a multiple of tp * cp ({tp} * {cp})")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        import torch

        if world_size > torch.cuda.device_count():
            raise ValueError(f"device='cuda' needs one GPU per rank: world_size {world_size}, "
                             f"{torch.cuda.device_count()} CUDA devices")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if fixes is not None:
        if isinstance(fixes, str):
            raise TypeError(f"fixes must be None or a list of fix names, got the string {fixes!r}")
        from ..registry import get

        for name in fixes:
            get(name)  # ValueError naming the known fixes


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collect(readers, processes, timeout):
    """Read one RankResult per rank; a rank that dies or never answers gets one that says so."""
    results = {}
    deadline = time.monotonic() + timeout
    pending = dict(readers)
    while pending and time.monotonic() < deadline:
        ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        for reader in ready:
            rank = pending.pop(reader)
            try:
                results[rank] = reader.recv()
            except (EOFError, OSError):
                processes[rank].join(5)
                died = f"rank {rank} died without a result (exit code {processes[rank].exitcode})"
                results[rank] = RankResult(rank, error=died)
            if not results[rank].ok:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    failed = [rank for rank in sorted(results) if not results[rank].ok]
    why = f"after rank {failed[0]} failed" if failed else f"after the {timeout} s timeout"
    for rank in pending.values():
        results[rank] = RankResult(rank, error=f"rank {rank} was killed {why}: it never returned")
    return [results[rank] for rank in sorted(results)]


def _worker(setup, fn, args, kwargs, writer):
    rank = setup["rank"]
    try:
        value = _run_rank(setup, fn, args, kwargs)
        result = RankResult(rank, value=value)
    except BaseException:  # the caller must hear about everything, SystemExit included
        result = RankResult(rank, error=traceback.format_exc())
    try:
        writer.send(result)
    except Exception:  # the value did not pickle
        error = f"rank {rank}: return value did not pickle:\n{traceback.format_exc()}"
        writer.send(RankResult(rank, error=error))
    writer.close()


def _run_rank(setup, fn, args, kwargs):
    import contextlib

    import torch

    import mtp_overlay

    fixes = setup["fixes"]
    if fixes is not None:
        mtp_overlay.uninstall()
        mtp_overlay.install(only=fixes)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(setup["port"])
    if setup["device"] == "cpu":
        from .cpu_shims import cpu_shims

        shims, backend = cpu_shims(), "gloo"
    else:
        torch.cuda.set_device(setup["rank"] % torch.cuda.device_count())
        shims, backend = contextlib.nullcontext(), "nccl"
    with shims:
        return _run_in_process_group(setup, backend, fn, args, kwargs)


def _run_in_process_group(setup, backend, fn, args, kwargs):
    import datetime
    import random

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{setup['port']}",
        rank=setup["rank"],
        world_size=setup["world_size"],
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=setup["tp"],
            pipeline_model_parallel_size=1,
            context_parallel_size=setup["cp"],
        )
        random.seed(setup["seed"])
        torch.manual_seed(setup["seed"])
        tensor_parallel.model_parallel_cuda_manual_seed(setup["seed"])
        return fn(*args, **kwargs)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
