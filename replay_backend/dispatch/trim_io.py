"""The trim op's gathers and scatter as graphs, for steps whose main pieces are graphed.

In a PIECEWISE step at main size S that trims into replay size R, every tensor the trim
op moves has a fixed address: its row tensors and outputs are outputs of main pieces
captured at S (owned: they are alive across the trim op, see ``graphs.py``), and the
region's inputs and outputs are its static buffers and its graphs' outputs at R. So
the gathers into the region and the scatter back are graphs per (S, R), and what is
left on the host per step is two replays (instead of a launch per row tensor and per
output).

The per-step index data is one device buffer: at 0 the number of real replay rows n,
then ``[1, R + 1)`` the rows to gather. A serving backend builds every step's metadata
into one fixed buffer with the count and rows at its head (``step_metadata.py``), and
the graphs are captured on that head: a served step's index data is in place, with no
copy at all. A batch built elsewhere (fresh memory) is staged instead: one
device-to-device copy of its ``ReplayBatch.count_rows`` into ``[0, n + 1)``. Entries
past n hold whatever follows there (the step's other metadata fields, or what an
earlier step left), so the gather graph clamps every index below the main size S
first: a padded replay row then copies some real row, and only fills padding. The
gather graph derives the scatter's index and mask from the count on the device (for
each main row its replay row plus one, or 0 for a trimmed row: a scatter-add of
``1..n`` at the gathered rows, pads adding 0). Neither graph allocates: every op
writes into a buffer that exists already, so these graphs take nothing from the shared
pool that a replay graph could reuse.
"""
from __future__ import annotations

import torch

from ..fallbacks import Fallback
from ..counters import counters
from ..step_metadata import MetadataBuffer
from ..capture.graphs import GraphResources, StaticGraph


def _gather(k: int, size: int):
    def run(*args):
        rows, bufs = args[:k], args[k:2 * k]
        index, gidx, count, ranks, vals, valid, row_map, sidx, smask = args[2 * k:]
        torch.clamp(index, 0, size - 1, out=gidx)  # stale padding entries stay in range
        for b, x in zip(bufs, rows):
            torch.index_select(x, 0, gidx, out=b)
        torch.le(ranks, count, out=valid)  # real replay rows, not padding
        torch.mul(ranks, valid, out=vals)
        row_map.zero_()
        row_map.scatter_add_(0, gidx, vals)  # integer adds: the same result in any order
        torch.sub(row_map, 1, out=sidx)
        sidx.clamp_(min=0)
        torch.gt(row_map, 0, out=smask)
    return run


def _scatter(k: int):
    def run(*args):
        res, outs = args[:k], args[k:2 * k]
        sidx, smask = args[2 * k:]
        for o, r in zip(outs, res):
            torch.index_select(r, 0, sidx, out=o)
            o.mul_(smask.view(-1, *[1] * (o.dim() - 1)))  # trimmed rows: zeros, never stale
    return run


class TrimIO:
    def __init__(self, max_rows: int, max_tokens: int, device: torch.device, res: GraphResources) -> None:
        self.rmax, self.smax, self.res = max_rows, max_tokens, res
        self.index = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)  # count, rows
        self.count = self.index[:1]
        self.index_ptr = self.index.data_ptr()  # a batch whose count_rows starts here is in place
        self.metadata: MetadataBuffer | None = None  # whose head ``index`` is (adopt)
        self.gidx = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.ranks = torch.arange(1, max_rows + 1, dtype=torch.int64, device=device)  # replay row + 1
        self.vals = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.valid = torch.zeros(max_rows, dtype=torch.bool, device=device)
        self.row_map = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.sidx = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.smask = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.main_io: dict[int, tuple[list, list]] = {}  # S -> (rows, outs) while main graphs capture
        self.graphs: dict[tuple[int, int], tuple[StaticGraph, StaticGraph]] = {}
        self._tail_cache: dict[tuple[int, int], tuple[tuple, tuple]] = {}

    def adopt(self, metadata: MetadataBuffer) -> None:
        """Capture the graphs on the head of ``metadata`` (the serving backend's buffer)
        instead of this object's own index buffer."""
        if metadata is self.metadata:  # a capture tried again: the graphs already read it
            return
        if self.graphs:
            raise RuntimeError("trim gather graphs were captured already: their index cannot move")
        data = metadata.data
        if data.device != self.index.device or data.shape[0] < self.rmax + 1:
            self.res.fallback(Fallback.TRIM_INDEX_IN_PLACE, f"the metadata buffer ({data.shape[0]} entries on "
                              f"{data.device}) cannot hold {self.rmax + 1} on {self.index.device}: "
                              "every graphed trimming step copies its rows")
            return
        self.metadata = metadata
        self.index = data[:self.rmax + 1]
        self.count = self.index[:1]
        self.index_ptr = self.index.data_ptr()
        self._tail_cache.clear()

    def remember(self, size: int, rows: list, outs: list) -> None:
        """The trim op's tensors in the main capture step at ``size`` (owned, fixed)."""
        if size <= self.smax:
            self.main_io[size] = (list(rows), list(outs))

    def tails(self, size: int, rows_size: int) -> tuple[tuple, tuple]:
        """The index arguments of the (``size``, ``rows_size``) graphs after the row
        tensors, kept per pair: slicing them per step would be host time."""
        tails = self._tail_cache.get((size, rows_size))
        if tails is None:
            tails = self._tail_cache[(size, rows_size)] = (
                (self.index[1:rows_size + 1], self.gidx[:rows_size], self.count, self.ranks[:rows_size],
                 self.vals[:rows_size], self.valid[:rows_size], self.row_map[:size], self.sidx[:size],
                 self.smask[:size]),
                (self.sidx[:size], self.smask[:size]))
        return tails

    def capture(self, rows_size: int, bufs: list, res: list, sizes: list[int]) -> int:
        """Capture the (S, ``rows_size``) pairs for every remembered main size in
        ``sizes``, right after the region's graphs at ``rows_size`` (``res`` are their
        outputs). Returns the number of graphs captured."""
        n = 0
        for size in sizes:
            if size not in self.main_io or (size, rows_size) in self.graphs:
                continue
            rows, outs = self.main_io[size]
            gtail, stail = self.tails(size, rows_size)
            pair = []
            for name, fn, args in (("gather", _gather(len(rows), size), (*rows, *bufs, *gtail)),
                                   ("scatter", _scatter(len(outs)), (*res, *outs, *stail))):
                if self.res.use_cuda:
                    fn(*args)  # warm-up: first kernel loads happen outside the capture
                pair.append(StaticGraph(f"trim-{name}[{size},{rows_size}]", fn, args, self.res))
            self.graphs[(size, rows_size)] = (pair[0], pair[1])
            n += 2
        return n

    def stage(self, count_rows: torch.Tensor) -> None:
        """Write the index data of a step not built in place, ``ReplayBatch.count_rows``
        (a device tensor: the count, then the rows): one device copy, queued in stream
        order, so the host never waits for the step the GPU is running and the graphs
        read it in that order."""
        counters.trim_index_copies += 1
        if self.metadata is not None:
            # The copy lands on the head of the batch its backend built last: refuse to
            # run that one on these rows, loudly (MetadataBuffer.check).
            self.metadata.overwritten()
        self.index[:count_rows.shape[0]].copy_(count_rows)

    def run(self, size: int, rows_size: int, rows, bufs, region, outs) -> None:
        """Gather (graph), ``region()`` runs the region and returns its outputs, scatter
        (graph). The step's index data must be in place or staged."""
        gather, scatter = self.graphs[(size, rows_size)]
        gtail, stail = self.tails(size, rows_size)
        gather.replay((*rows, *bufs, *gtail))
        scatter.replay((*region(), *outs, *stail))
