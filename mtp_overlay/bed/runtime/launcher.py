"""Run functions on N spawned torch.distributed ranks with Megatron model parallelism set up.

A `RankPool` starts ``world_size`` processes once (CPU ranks forked from `preloaded`'s server,
prepared as spawned ones, with CUDA hidden; CUDA ranks spawned: `device`); each joins a process group on 127.0.0.1 (gloo on CPU, nccl on CUDA) and calls
``parallel_state.initialize_model_parallel`` with the pool's tensor, context, pipeline and expert
parallel sizes. Every ``pool.run(fn)`` then installs the asked-for fixes in the ranks, seeds every
generator (torch, Python, Megatron's model-parallel RNG tracker) and runs ``fn(*args, **kwargs)`` on
every rank: the cost of starting ranks and importing torch and megatron-core is paid once per pool,
not per case. `run_ranks` is a pool used for one call. On CPU the shims of ``cpu_shims`` are
installed in the ranks, and CUDA's device-assert rule is enforced there (`device.emulate_cuda_asserts`). A rank that crashes or hangs never hangs the caller: each run is bounded by
``timeout``; once one rank failed, the others get ``FAILURE_GRACE_S`` before they are killed, and a
pool whose run failed starts fresh ranks for its next run. Ranks are born with the overlay switched
off (`preloaded`): a run installs exactly the fixes it asks for, and a rank never imports the module
of a fix no run of its pool asked for.

``fn`` and its arguments must be picklable (a module-level function), as must its return value.
"""

import atexit
import collections
import dataclasses
import multiprocessing.connection
import os
import pickle
import socket
import sys
import time
import traceback

from . import preloaded
from .device import HIDE_CUDA, check_device, emulate_cuda_asserts, set_rank_device

FAILURE_GRACE_S = 10.0
# MTP_OVERLAY_SHARED_RANKS=1: run_ranks reuses one pool per layout and sys.path for the process's
# life (a test suite's), keeping at most SHARED_POOLS of them started
SHARED_RANKS = "MTP_OVERLAY_SHARED_RANKS"
SHARED_POOLS = 3
_shared = collections.OrderedDict()  # (world_size, tp, cp, pp, seed, device, log, sys.path) -> RankPool


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


class RankPool:
    """``world_size`` ranks with TP/CP/PP set up, reused by every `run`; spawned at the first one.

    tp, cp, pp: tensor / context / pipeline parallel sizes (``world_size`` must be a multiple of
    ``tp * cp * pp``; the rest is data parallel). ep, etp: expert model / expert tensor parallel sizes
    of MoE layers (``etp=None``: megatron-core's default, ``tp``; ``world_size`` must be a multiple of
    ``etp * ep``; TP2 x EP2 on 2 ranks, as Nemotron 3 Super trains, is ``tp=2, ep=2, etp=1``). seed:
    seeds torch, ``random`` and Megatron's RNG tracker identically on every rank before each run.
    device: "cpu" (gloo + CPU shims) or "cuda" (nccl, no shims, one GPU per rank). log: a file the
    ranks' stdout and stderr go to (appended), or None to inherit ours. Use it as a context manager,
    or call `close`.
    """

    def __init__(self, world_size, *, tp=1, cp=1, pp=1, ep=1, etp=None, seed=1234, device="cpu", log=None):
        _check_layout(world_size, tp, cp, device, pp, ep, etp)
        self.world_size, self.tp, self.cp, self.seed, self.device = world_size, tp, cp, seed, device
        self.pp, self.ep, self.etp = pp, ep, etp
        self.log = None if log is None else os.fspath(log)
        self._processes, self._connections = {}, {}

    def run(self, fn, *, args=(), kwargs=None, fixes=None, timeout=300):
        """``fn(*args, **kwargs)`` on every rank; one RankResult per rank, by rank.

        fixes: overlay fixes installed in the ranks for this run; None installs what
        ``import mtp_overlay`` installs under the caller's environment (its ``MTP_OVERLAY_DISABLE``),
        a list of fix names installs exactly those, ``[]`` none. The fixes of the pool's previous run
        are uninstalled first (``fresh=True`` in `run_ranks`: ranks no earlier run has touched).
        timeout: seconds for this run (the ranks' start-up included on the first one).
        """
        _check_run(fixes, timeout)
        job = pickle.dumps((fn, tuple(args), dict(kwargs or {}), fixes))  # refused here, before any rank starts
        if not self._processes:
            self._start()
        for connection in self._connections.values():
            connection.send_bytes(job)
        results = _collect(self._connections, self._processes, timeout)
        if not all(result.ok for result in results):
            self.close()  # a rank that failed mid-collective leaves its peers unusable: start afresh
        return results

    def run_checked(self, fn, **options):
        """`run` that returns the values by rank, or raises RanksFailed with every traceback."""
        return _values(self.run(fn, **options))

    def close(self):
        """Stop the ranks (killed if they do not leave at once); the next `run` starts new ones."""
        for connection in self._connections.values():
            try:
                connection.send_bytes(b"")
            except OSError:
                pass
        for process in self._processes.values():
            if process.pid is None:  # never started (its start failed): nothing to stop
                continue
            process.join(2)
            if process.is_alive():
                process.kill()
                process.join(5)
        for connection in self._connections.values():
            connection.close()
        self._processes, self._connections = {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _start(self):
        context = preloaded.rank_context(self.device)
        port = _free_port()
        # CPU ranks never see CUDA; CUDA ranks are spawned, born with the overlay off (preloaded's rule)
        environ = dict(os.environ, **HIDE_CUDA) if self.device == "cpu" else dict(os.environ)
        for rank in range(self.world_size):
            ours, theirs = context.Pipe(duplex=True)
            setup = dict(rank=rank, world_size=self.world_size, port=port, seed=self.seed, environ=environ)
            setup.update(tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, etp=self.etp, device=self.device, log=self.log)
            self._processes[rank] = context.Process(target=_worker, args=(setup, theirs), daemon=True)
            self._connections[rank] = ours
            try:
                with preloaded.born_with({preloaded.DISABLE: "all"}):  # a spawned rank copies it
                    self._processes[rank].start()
            finally:
                theirs.close()  # the child holds the only other end: EOF means it died


def run_ranks(fn, world_size, *, tp=1, cp=1, pp=1, ep=1, etp=None, args=(), kwargs=None, fixes=None, timeout=300,
              seed=1234, device="cpu", log=None, fresh=False):
    """``fn(*args, **kwargs)`` on ``world_size`` ranks: fresh ones (a `RankPool` for one run), or,
    with ``MTP_OVERLAY_SHARED_RANKS=1`` and not ``fresh``, the shared pool of this layout and sys.path."""
    options = dict(args=args, kwargs=kwargs, fixes=fixes, timeout=timeout)
    layout = dict(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, seed=seed, device=device, log=log)
    if fresh or os.environ.get(SHARED_RANKS) != "1":
        with RankPool(world_size, **layout) as pool:
            return pool.run(fn, **options)
    key = (world_size, tp, cp, pp, ep, etp, seed, device, log, tuple(sys.path))
    pool = _shared.pop(key, None) or RankPool(world_size, **layout)
    _shared[key] = pool  # the most recently used last
    while len(_shared) > SHARED_POOLS:
        _shared.popitem(last=False)[1].close()
    return pool.run(fn, **options)


@atexit.register
def _close_shared():
    while _shared:
        _shared.popitem()[1].close()


def run_ranks_checked(fn, world_size, **options):
    """``run_ranks`` that returns the values by rank, or raises RanksFailed with every traceback."""
    return _values(run_ranks(fn, world_size, **options))


def _values(results):
    if not all(result.ok for result in results):
        raise RanksFailed(results)
    return [result.value for result in results]


def _check_layout(world_size, tp, cp, device, pp=1, ep=1, etp=None):
    sizes = [("world_size", world_size), ("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep)]
    sizes += [("etp", etp)] if etp is not None else []
    for name, value in sizes:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            alternative = " (or None: tp)" if name == "etp" else ""
            raise ValueError(f"{name} must be a positive int, got {value!r}{alternative}")
    if world_size % (tp * cp * pp):
        raise ValueError(f"world_size ({world_size}) must be a multiple of tp * cp * pp ({tp} * {cp} * {pp})")
    expert_tp = tp if etp is None else etp
    if world_size % (expert_tp * ep):
        raise ValueError(
            f"world_size ({world_size}) must be a multiple of etp * ep ({expert_tp} * {ep}; etp defaults to tp): "
            "megatron-core lays the experts' tensor x expert parallel grid over the same ranks"
        )
    if check_device(device) == "cuda":
        import torch

        if world_size > torch.cuda.device_count():
            raise ValueError(f"device='cuda' needs one GPU per rank: world_size {world_size}, "
                             f"{torch.cuda.device_count()} CUDA devices")


def _check_run(fixes, timeout):
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if fixes is not None:
        preloaded.check_fixes(fixes)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collect(connections, processes, timeout):
    """Read one RankResult per rank; a rank that dies or never answers gets one that says so."""
    results = {}
    deadline = time.monotonic() + timeout
    pending = {connection: rank for rank, connection in connections.items()}
    while pending and time.monotonic() < deadline:
        ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        for connection in ready:
            rank = pending.pop(connection)
            try:
                results[rank] = connection.recv()
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


def _worker(setup, connection):
    """A rank: set up once, then run each job sent until an empty message (or EOF) ends it.

    Forked from the preloaded server, which multiprocessing prepares as a spawned process (the
    caller's sys.path, working folder and ``__main__``) in the server's environment, where the
    overlay is off: ``mtp_overlay``, imported to unpickle this function, installed nothing. The
    caller's environment is set here; each run then installs its own fixes."""
    os.environ.clear()
    os.environ.update(setup["environ"])
    if setup["log"] is not None:
        _redirect_output(setup["log"])
    rank = setup["rank"]
    try:
        context = _RankContext(setup)
    except BaseException:
        context, failure = None, traceback.format_exc()
    while True:
        try:
            job = connection.recv_bytes()
        except (EOFError, OSError):
            break
        if not job:
            break
        try:
            if context is None:
                raise RuntimeError(f"rank {rank} could not start:\n{failure}")
            result = RankResult(rank, value=context.run(*pickle.loads(job)))
        except BaseException:  # the caller must hear about everything, SystemExit included
            result = RankResult(rank, error=traceback.format_exc())
        try:
            connection.send(result)
        except Exception:  # the value did not pickle
            connection.send(RankResult(rank, error=f"rank {rank}: return value did not pickle:\n{traceback.format_exc()}"))
    if context is not None:
        context.close()
    connection.close()


def _redirect_output(path):
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)


class _RankContext:
    """One rank's process group, model parallelism and (on CPU) shims, for the pool's life."""

    def __init__(self, setup):
        import datetime

        import torch
        import torch.distributed as dist

        self.setup = setup
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(setup["port"])
        set_rank_device(setup["device"])
        if setup["device"] == "cpu":
            from . import cpu_shims

            cpu_shims.install()
            emulate_cuda_asserts()
            backend = "gloo"
        else:
            torch.cuda.set_device(setup["rank"] % torch.cuda.device_count())
            backend = "nccl"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{setup['port']}",
            rank=setup["rank"],
            world_size=setup["world_size"],
            timeout=datetime.timedelta(seconds=120),
        )
        _initialize_model_parallel(setup)

    def run(self, fn, args, kwargs, fixes):
        import random

        import torch
        from megatron.core import parallel_state, tensor_parallel

        # every run starts from the pool's environment: upstream records state in os.environ (megatron-core
        # its attention backend in NVTE_*, language_module.py:124), which must not leak into the next case
        os.environ.clear()
        os.environ.update(self.setup["environ"])
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(self.setup["port"])
        if not parallel_state.model_parallel_is_initialized() or _layout(self.setup) != _current_layout():
            # an earlier run changed the layout: back to the pool's
            parallel_state.destroy_model_parallel()
            _initialize_model_parallel(self.setup)

        preloaded.install_exactly(fixes, self.setup["environ"].get(preloaded.DISABLE))
        seed = self.setup["seed"]
        random.seed(seed)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return fn(*args, **kwargs)

    def close(self):
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _layout(setup):
    """(tp, cp, pp, ep, etp) of a rank's setup, etp resolved (None: tp)."""
    return setup["tp"], setup["cp"], setup["pp"], setup["ep"], setup["tp"] if setup["etp"] is None else setup["etp"]


def _current_layout():
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )


def _initialize_model_parallel(setup):
    from megatron.core import parallel_state

    tp, cp, pp, ep, etp = _layout(setup)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
