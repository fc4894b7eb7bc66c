"""Decoding forwards replayed as CUDA graphs.

On a GPU, a decoding step of a small model is a few milliseconds of kernels behind several
times as long of Python and kernel launches (hundreds of kernels a step for SmolLM2-135M; the
timings are in ``docs/performance.md``); a replayed graph launches them all at once. The
package's forwards are free of host synchronization and, when attention reads the cache's whole
capacity, have fixed shapes, so each shape can be recorded once and replayed. The generation
loops use this on CUDA (``cuda_graphs=`` in `generate` and `speculative_generate`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphedForward:
    """``forward(input_ids, q_seqlens)`` replayed from CUDA graphs, one per input shape.

    ``forward`` runs a model on ``cache`` (appending at each row's length and advancing
    ``cache.lengths`` in place, as the model protocol does) and returns logits. The first call
    of each shape (``input_ids`` [B, T], with or without ``q_seqlens`` [B]) runs ``forward``
    eagerly; the second records a graph: an eager warm-up forward on the capture's stream, whose
    cache lengths are rolled back (its keys and values lie past the lengths, where the replay
    writes the same values again), then the capture. Later calls copy their inputs into the
    graph's and replay it. A shape used once (a verify width probed once, the last steps of a
    batch size) so costs one eager forward, not a recording.

    The returned logits may live in the graph's output buffer, which the next call of that
    shape overwrites: use or copy them first. The graphs are dropped when the cache's tensors
    are replaced (`KVCache.select`); a model's weights must not be replaced between calls
    (changed in place is fine). A recording costs an eager forward, the capture and a device
    synchronization (torch's capture starts with one), once per shape: the generation loops
    record again in every call and after every change of batch size.

    Raises:
        RuntimeError: the forward could not be captured (it synchronizes with the host, or
            does something else a capture does not allow); decode eagerly instead.
    """

    #: Calls of all instances so far that ran eagerly or recorded a graph instead of replaying one,
    #: each far slower than a replay: `speculative_generate` leaves their steps out of its costs.
    slow_calls = 0

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], cache) -> None:
        self.forward, self.cache = forward, cache
        self.captures = 0  # graphs recorded so far
        self._graphs: dict[tuple, tuple | None] = {}  # None: the shape was run once, eagerly
        self._cache_tensors: tuple = (None, None, None)

    def __call__(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        cache = self.cache
        tensors = (cache.lengths, cache.k[0], cache.v[0])
        # Held, so no new tensor can take an old one's address while graphs still write there.
        if not all(a is b for a, b in zip(tensors, self._cache_tensors, strict=True)):
            self._graphs.clear()
            self._cache_tensors = tensors
        key = (tuple(input_ids.shape), q_seqlens is not None)
        if self._graphs.get(key) is None:
            GraphedForward.slow_calls += 1
            if key not in self._graphs:
                self._graphs[key] = None  # seen once: recorded if it comes again
                return self.forward(input_ids, q_seqlens)
            self._graphs[key] = self._capture(input_ids, q_seqlens)
        replay, static_ids, static_q, out = self._graphs[key]
        static_ids.copy_(input_ids)
        if static_q is not None:
            static_q.copy_(q_seqlens)
        replay()
        cache.version += 1  # what `KVCache.advance` does on the host (the replay runs only kernels)
        return out

    def _capture(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor | None) -> tuple:
        """Record the graph of this shape: ``(replay, static input_ids, static q_seqlens, output)``."""
        device = input_ids.device
        with torch.cuda.device(device):  # streams, capture and replays on the inputs' GPU, maybe not the current one
            graph, static_ids, static_q, out = self._record(input_ids, q_seqlens)

        def replay() -> None:
            with torch.cuda.device(device):
                graph.replay()

        return replay, static_ids, static_q, out

    def _record(self, input_ids: torch.Tensor, q_seqlens: torch.Tensor | None) -> tuple:
        device = input_ids.device
        static_ids = input_ids.clone()
        static_q = None if q_seqlens is None else q_seqlens.clone()
        start = self.cache.lengths.clone()
        # Warm up on a side stream, as torch.cuda.graph asks: lazy initialization (cuBLAS
        # workspaces, Triton compilation) must not happen inside the capture. The shape's first,
        # eager call ran on the current stream; per-stream state needs this one.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.forward(static_ids, static_q)
            self.cache.crop(start)
        torch.cuda.current_stream(device).wait_stream(stream)
        # Each graph gets its own memory pool: a shared one could not take a new graph once the
        # old ones are dropped while their outputs live on (torch asserts), and the pools are
        # small (activations and logits of one step).
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
                out = self.forward(static_ids, static_q)  # records the kernels; lengths stay where they were
        except RuntimeError as e:
            raise RuntimeError(f"the model's forward on input_ids of shape {list(input_ids.shape)} could not be "
                               "recorded as a CUDA graph (does it synchronize with the host?); decode eagerly "
                               "with cuda_graphs=False") from e
        self.captures += 1
        return graph, static_ids, static_q, out
