"""The refit checksum's Triton kernels: many tensors' row and column sums in two launches (`device`'s).

Imported by `device.word_sums` alone. ``layout`` is a flat int64 table, eight values per tensor
(``tensors`` of them): the address of its aligned 64-bit words, their count, the rows and width of
the matrix of the first ``rows * width`` of them, where its sums start in ``out``, where its tiles'
column sums start in ``partials``, and the first `row_sums` and `column_sums` program that is its
(ascending: a program finds its tensor by binary search). Integer sums wrap modulo 2**64 on every
device, in any order: the kernels give `refit`'s torch reductions' words exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROWS = 16  # rows of one tensor's matrix a `row_sums` program reads, all their columns
COLUMNS = 256  # columns a program loads at a time
# the kernels read these globals: Triton takes them as constexpr only
FIELDS = tl.constexpr(8)  # values per tensor in ``layout``
FIRST_TILE = tl.constexpr(6)  # the field holding each tensor's first row_sums program
FIRST_BLOCK = tl.constexpr(7)  # and its first column_sums program


def _entry(layout: tl.tensor, tensors: tl.tensor, program: tl.tensor, FIELD: tl.constexpr) -> tl.tensor:
    """The row of ``layout`` of the last tensor whose first program (at ``FIELD``) is at most
    ``program``: the program's tensor (one with no program of its own never is the last such)."""
    low = tl.full([], 0, tl.int64)
    high = low + tensors  # an int64 whatever Triton made of the count (i32, i64, or the constant 1)
    while high - low > 1:
        middle = (low + high) // 2
        if tl.load(layout + FIELDS * middle + FIELD) <= program:
            low = middle
        else:
            high = middle
    return layout + FIELDS * low


def _row_sums(layout: tl.tensor, tensors: tl.tensor, out: tl.tensor, partials: tl.tensor,
              ROWS: tl.constexpr, COLUMNS: tl.constexpr) -> None:
    """One program per ROWS rows of one tensor's matrix, reading them once: their sums into
    ``out`` (complete), and their sum down each column into the tile's row of ``partials``."""
    program = tl.program_id(0)
    entry = entry_of(layout, tensors, program, FIRST_TILE)
    tile = program - tl.load(entry + FIRST_TILE)
    words = tl.load(entry).to(tl.pointer_type(tl.int64))
    rows = tl.load(entry + 2)
    width = tl.load(entry + 3)
    row = tile * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    partial = partials + tl.load(entry + 5) + tile * width
    total = tl.zeros([ROWS], dtype=tl.int64)
    for start in range(0, width, COLUMNS):
        column = start + tl.arange(0, COLUMNS)
        column_ok = column < width
        block = tl.load(words + row[:, None] * width + column[None, :], mask=row_ok[:, None] & column_ok[None, :],
                        other=0)
        total += tl.sum(block, 1)
        tl.store(partial + column, tl.sum(block, 0), mask=column_ok)
    tl.store(out + tl.load(entry + 4) + row, total, mask=row_ok)


def _column_sums(layout: tl.tensor, tensors: tl.tensor, out: tl.tensor, partials: tl.tensor,
                 ROWS: tl.constexpr, COLUMNS: tl.constexpr) -> None:
    """One program per COLUMNS columns of one tensor's matrix: the sum of its tiles' partial sums
    into ``out`` after the row sums, then the words past the matrix (fewer than ``width``) that
    fall at these columns' places."""
    program = tl.program_id(0)
    entry = entry_of(layout, tensors, program, FIRST_BLOCK)
    column = (program - tl.load(entry + FIRST_BLOCK)) * COLUMNS + tl.arange(0, COLUMNS)
    words = tl.load(entry).to(tl.pointer_type(tl.int64))
    count = tl.load(entry + 1)
    rows = tl.load(entry + 2)
    width = tl.load(entry + 3)
    at = tl.load(entry + 4) + rows
    partial = partials + tl.load(entry + 5) + column
    column_ok = column < width
    total = tl.zeros([COLUMNS], dtype=tl.int64)
    for tile in range(0, tl.cdiv(rows, ROWS)):
        total += tl.load(partial + tile * width, mask=column_ok, other=0)
    tl.store(out + at + column, total, mask=column_ok)
    tail = rows * width + column
    tail_ok = tail < count
    tl.store(out + at + width + column, tl.load(words + tail, mask=tail_ok, other=0), mask=tail_ok)


entry_of = triton.jit(_entry)
row_sums = triton.jit(_row_sums)
column_sums = triton.jit(_column_sums)
