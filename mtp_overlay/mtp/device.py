"""Where the MTP library's work runs: the library's one home for device-specific code, beside `checks`.

* `for_collective`: a tensor where a process group's backend can reduce it (NCCL takes device
  tensors only; gloo takes host tensors).
* `word_sums`: the refit checksum's row and column sums (`refit`'s format 2) of many tensors in two
  Triton kernel launches, on a CUDA device. Per-tensor torch reductions are launch-bound there (a
  655M-parameter model's 1.3 GB read at ~70 GB/s with two reductions a tensor on an H200), while one
  pass over every tensor reads at memory speed. `uses_kernels` says where they run: CUDA devices,
  when Triton (which torch's CUDA builds bring) imports and the kernels have not failed there
  (`kernels_failed`); elsewhere `refit` sums with torch ops (the same words, so the same digests).
  The kernels live in `kernels`, which nothing else imports; Triton's interpreter
  (``TRITON_INTERPRET=1`` before that import) runs them on host tensors, which is how the CPU suite
  checks them against the checksum's definition.
"""

from __future__ import annotations

import contextlib
import warnings

from ..contract import OverlayWarning

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: torch loads inside the functions
    import torch
    from torch.distributed import ProcessGroup

# (address, words, rows, width, at): one tensor's aligned 64-bit words at ``address`` (``words`` of
# them), the matrix of their first ``rows * width``, and where its sums start in the output
Entry = tuple[int, int, int, int, int]

_unavailable: list[str] = []  # why the kernels cannot load, compile or launch here, once known (warned once)


def for_collective(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``tensor`` on a device ``group``'s backend reduces: the current CUDA device for NCCL when it
    is a host tensor, else itself."""
    import torch

    if tensor.device.type == "cpu" and "nccl" in str(torch.distributed.get_backend(group)):
        return tensor.cuda()
    return tensor


def uses_kernels(device: torch.device) -> bool:
    """Whether `word_sums` runs on ``device``: a CUDA device where Triton imports and the kernels have
    not failed in this process (`kernels_failed`; torch ops sum instead)."""
    if device.type != "cuda" or _unavailable:
        return False
    try:
        from .kernels import row_sums  # noqa: F401  (Triton loads here)
    except Exception as exc:  # Triton missing or broken: torch ops give the same words, slower
        kernels_failed(exc)
        return False
    return True


def kernels_failed(error: Exception) -> None:
    """Record that the kernels cannot load, compile or launch here, and warn once naming ``error``:
    `uses_kernels` is False from now on in this process (torch ops give the same words, slower)."""
    if not _unavailable:
        _unavailable.append(f"{type(error).__name__}: {error}")
        warnings.warn(OverlayWarning(
            f"mtp-overlay: the refit fingerprint's CUDA kernels failed here ({_unavailable[0]:.300}): "
            "fingerprinting with torch ops, two launches per tensor"), stacklevel=4)


def word_sums(entries: list[Entry], size: int, device: torch.device) -> torch.Tensor:
    """[size] int64 on ``device``: for each entry, from ``at`` on, the row sums of its words' matrix
    (``rows`` values), its column sums (``width``) and the words past the matrix, every sum wrapping
    modulo 2**64; other places are left unwritten. Every entry's words must stay allocated and
    unchanged until the work queued here has run (stream order, as for any op). No host read."""
    import torch

    from .kernels import COLUMNS, ROWS, column_sums, row_sums

    out = torch.empty(size, dtype=torch.int64, device=device)
    if not entries:
        return out
    layout, tiles, blocks, partials = [], 0, 0, 0
    for address, words, rows, width, at in entries:  # kernels.py's eight fields per tensor
        layout += [address, words, rows, width, at, partials, tiles, blocks]
        tiles += -(-rows // ROWS)  # row_sums programs: ROWS rows each, all their columns
        blocks += -(-width // COLUMNS)  # column_sums programs: COLUMNS columns each
        partials += -(-rows // ROWS) * width  # per tile, its rows' sum down each column
    table = torch.tensor(layout, dtype=torch.int64)
    if device.type == "cuda":  # one pinned copy, queued: no wait for the device
        table = table.pin_memory().to(device, non_blocking=True)
    scratch = torch.empty(max(partials, 1), dtype=torch.int64, device=device)
    # Triton launches on the current CUDA device: the tensors' own, whichever is current
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if tiles:
            row_sums[(tiles,)](table, len(entries), out, scratch, ROWS=ROWS, COLUMNS=COLUMNS)
        column_sums[(blocks,)](table, len(entries), out, scratch, ROWS=ROWS, COLUMNS=COLUMNS)
    return out
