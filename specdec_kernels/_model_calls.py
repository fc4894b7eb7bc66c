"""How the decoding loops call a model that follows the model protocol.

A model maps ``(input_ids [B, T], cache, q_seqlens=None)`` to logits ``[B, T, V]``, appends its
keys and values at each row's own cache length, and has ``vocab_size`` and
``new_cache(batch_size, max_len)``. Its ``forward`` may also take the keywords ``last_only``,
``num_tokens``, ``max_seqlen`` and ``min_seqlen``: host-side facts the loops know without a
sync (see `specdec_kernels.generation`); the helpers here pass each only where it is listened
for, wrap decoding forwards in CUDA-graph replay where asked, and check what every forward
returns (`_LogitsCheck`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator

import torch

from ._checks import DeviceCheckError, device_check
from .cache import KVCache
from .cuda_graphs import GraphedForward


@functools.lru_cache(maxsize=64)
def _keywords(forward) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _accepts(model, keyword: str) -> bool:
    """Whether ``model``'s forward takes the optional protocol extension ``keyword``:
    ``last_only`` (return only each row's last logits, saving the full [B, T, V] head),
    ``num_tokens`` (the host-known ``q_seqlens.sum()``, letting the model skip padding) or
    ``max_seqlen`` / ``min_seqlen`` (host bounds on the cache lengths after the call)."""
    forward = getattr(type(model), "forward", None)
    return forward is not None and keyword in _keywords(forward)


def _forward(model, input_ids, cache, q_seqlens=None, num_tokens: int | None = None, *,
             max_seqlen: int | None = None, min_seqlen: int | None = None, **kwargs) -> torch.Tensor:
    """``model(input_ids, cache, q_seqlens)``, telling it ``num_tokens``, ``max_seqlen`` and
    ``min_seqlen`` where it listens."""
    if num_tokens is not None and q_seqlens is not None and _accepts(model, "num_tokens"):
        kwargs["num_tokens"] = num_tokens
    for keyword, bound in (("max_seqlen", max_seqlen), ("min_seqlen", min_seqlen)):
        if bound is not None and _accepts(model, keyword):
            kwargs[keyword] = bound
    return model(input_ids, cache, q_seqlens, **kwargs)


def _last_logits(model, input_ids, cache, q_seqlens=None, num_tokens: int | None = None, *,
                 max_seqlen: int | None = None, min_seqlen: int | None = None, return_hidden: bool = False):
    """[B, V] logits at each row's last real input position (``q_seqlens`` None: position T-1);
    with ``return_hidden``, also the model's hidden states at every input position, [B, T, H]."""
    kwargs = dict(max_seqlen=max_seqlen, min_seqlen=min_seqlen, **_hidden_keyword(model, return_hidden))
    last_only = _accepts(model, "last_only")
    if last_only:
        kwargs["last_only"] = True
    out = _forward(model, input_ids, cache, q_seqlens, num_tokens, **kwargs)
    logits, hidden = out if return_hidden else (out, None)
    if last_only or q_seqlens is None:
        logits = logits[:, -1]
    else:
        logits = logits.gather(1, (q_seqlens - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1]))[:, 0]
    return (logits, hidden) if return_hidden else logits


def _hidden_keyword(model, return_hidden: bool) -> dict:
    """``{"return_hidden": True}`` when asked for, refusing a model whose forward cannot give them."""
    if not return_hidden:
        return {}
    if not _accepts(model, "return_hidden"):
        raise TypeError(f"the drafter needs the target's hidden states (needs_target_hidden = True), but "
                        f"{type(model).__name__}.forward takes no return_hidden keyword")
    return {"return_hidden": True}


def _use_cuda_graphs(cuda_graphs: bool | None, models, device: torch.device) -> bool:
    """Whether the loop replays its decoding forwards as CUDA graphs (`GraphedForward`): by
    default on CUDA when every model says it is capturable (``capturable`` True: no host
    synchronization; the built-in `Llama`, and an `HFCausalLM` whose rotary embeddings allow it);
    ``True`` asks for it with any protocol model whose cache is a `KVCache`."""
    if cuda_graphs is None:
        return device.type == "cuda" and all(getattr(m, "capturable", False) is True for m in models)
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be None, True or False, got {type(cuda_graphs).__name__}")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs input_ids and the models on a CUDA device, got {device}")
    return cuda_graphs


def _decoding_forward(model, cache, name: str, graphs: bool, *, last_only: bool, return_hidden: bool = False
                      ) -> Callable:
    """The loop's decoding forward of ``model``: ``fn(ids, cache, q_seqlens=None, num_tokens=None,
    *, max_seqlen, min_seqlen)`` -> `_last_logits` (``last_only``) or `_forward`'s logits (with
    ``return_hidden``: (logits, hidden states), never graphed). With ``graphs``, replayed from
    CUDA graphs (`GraphedForward`) on ``cache`` (a `KVCache`, whose `select` keeps the object) at
    full capacity: ``num_tokens`` and the bounds are left out, they would change the shapes (or
    the masks) every step."""
    if return_hidden:
        keyword = _hidden_keyword(model, True)
        return lambda ids, cache, q_seqlens=None, num_tokens=None, *, max_seqlen, min_seqlen: _forward(
            model, ids, cache, q_seqlens, num_tokens, max_seqlen=max_seqlen, min_seqlen=min_seqlen, **keyword)
    forward = _last_logits if last_only else _forward
    if not graphs:
        return lambda ids, cache, q_seqlens=None, num_tokens=None, *, max_seqlen, min_seqlen: forward(
            model, ids, cache, q_seqlens, num_tokens, max_seqlen=max_seqlen, min_seqlen=min_seqlen)
    if not isinstance(cache, KVCache):
        raise ValueError(f"cuda_graphs needs the {name}'s cache to be a KVCache, got {type(cache).__name__}")
    graphed = GraphedForward(lambda ids, q_seqlens: forward(model, ids, cache, q_seqlens), cache)
    return lambda ids, cache, q_seqlens=None, num_tokens=None, *, max_seqlen, min_seqlen: graphed(ids, q_seqlens)


def as_protocol_model(model):
    """``model`` itself, or for a transformers ``PreTrainedModel`` an `HFCausalLM` around it
    (``specdec_kernels.hf``; transformers is imported only when such a model is given)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return model
    from .hf import HFCausalLM

    return HFCausalLM(model)


def _check_model(model, name: str) -> None:
    for attribute in ("vocab_size", "new_cache"):
        if not hasattr(model, attribute):
            raise TypeError(f"{name} must follow the model protocol (callable with .vocab_size and "
                            f".new_cache(batch_size, max_len)); it has no {attribute!r}")


def _refused_allocation(error: BaseException) -> bool:
    """Whether ``error`` says that memory of the requested size could not be had (out of memory,
    a size past what the allocator can count), rather than any other failure."""
    if isinstance(error, (MemoryError, OverflowError, torch.OutOfMemoryError)):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in message for word in ("alloc", "overflow", "out of memory"))


@contextlib.contextmanager
def allocating(what: str, advice: str) -> Iterator[None]:
    """Turn a refused allocation inside the block into a ValueError saying ``what`` could not be
    allocated and ``advice`` (the arguments that sized it); any other error passes unchanged."""
    try:
        yield
    except (RuntimeError, MemoryError, OverflowError) as e:
        if not _refused_allocation(e):
            raise
        raise ValueError(f"{what} could not be allocated ({e}); {advice}") from e


def _new_cache(model, name: str, batch_size: int, max_len: int, device: torch.device):
    """``model.new_cache(...)``, refusing a cache on another device than the input ids, and naming
    the arguments that sized it when it cannot be allocated."""
    with allocating(f"the {name}'s KV cache for {batch_size} rows of max_cache_len={max_len} tokens",
                    "lower max_new_tokens or max_cache_len"):
        cache = model.new_cache(batch_size, max_len)
    lengths = getattr(cache, "lengths", None)
    if isinstance(lengths, torch.Tensor) and lengths.device != device:
        raise ValueError(f"input_ids is on {device} but the {name}'s cache is on {lengths.device}: "
                         "move input_ids and attention_mask to the model's device")
    return cache


class _LogitsCheck:
    """Every forward's logits (and every draft proposal), checked without a host synchronization.

    The width must equal the vocabulary's (a shape: checked on the host at once). A row the loop
    samples from must have a finite maximum: NaN, +inf or nothing but -inf leave no token to
    sample, and a sampler handed them would have to make one up. On CPU a failed check raises at
    once (`device_check`); on CUDA a flag per name is read in the step's one transfer
    (`_rows_still_running`), which raises, so the loop stays sync-free and a bad model never
    triggers a device-side assert.
    """

    def __init__(self, device: torch.device, names: tuple[str, ...]) -> None:
        self.names = names  # the loop's names of its models (and drafter), for the messages
        self.messages = {name: self.logits_message(name) for name in names}
        self.deferred = device.type == "cuda"
        self.failed = torch.zeros(len(names), dtype=torch.bool, device=device)

    @staticmethod
    def logits_message(name: str) -> str:
        return (f"the {name} returned NaN or infinite logits, or a row of only -inf: no token can be "
                "sampled from them (check its weights, its inputs and its dtype: float16 overflows past 65504)")

    def flag(self, name: str, bad: torch.Tensor, message: str | None = None) -> None:
        """Fail the ``name`` check where the 0-d bool ``bad`` is true (``message``: what went wrong,
        instead of the logits message)."""
        if message is not None:
            self.messages[name] = message
        if self.deferred:
            self.failed[self.names.index(name)] |= bad
        else:
            device_check(~bad, self.messages[name])

    def __call__(self, name: str, vocab_size: int, logits: torch.Tensor, q_seqlens: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """Check ``logits`` ([B, V], or [B, T, V] of which row b uses the first ``q_seqlens[b]``)
        of the ``name`` model (one of ``names``) against ``vocab_size`` and return them."""
        if logits.shape[-1] != vocab_size:
            raise ValueError(f"the {name} returned logits of width {logits.shape[-1]} but its vocab_size "
                             f"is {vocab_size}: ids past vocab_size would be sampled")
        bad = ~torch.isfinite(logits.amax(-1))
        if q_seqlens is not None and logits.dim() == 3:
            bad &= torch.arange(logits.shape[1], device=logits.device) < q_seqlens[:, None]
        self.flag(name, bad.any())  # (the logits message, set at construction)
        if self.deferred:
            # The samplers would assert on such rows on the device; zeros keep them quiet until
            # the step's transfer raises, and what they sample is never returned.
            logits.masked_fill_(bad[..., None], 0.0)
        return logits

    def checked(self, name: str, vocab_size: int, forward: Callable) -> Callable:
        """``forward`` (a `_decoding_forward`) with its logits checked (the first of a tuple)."""
        def run(ids, cache, q_seqlens=None, *args, **kwargs):
            out = forward(ids, cache, q_seqlens, *args, **kwargs)
            self(name, vocab_size, out[0] if isinstance(out, tuple) else out, q_seqlens)
            return out
        return run

    def raise_if_failed(self, flags: list[int]) -> None:
        for name, failed in zip(self.names, flags, strict=True):
            if failed:
                raise DeviceCheckError(self.messages[name])
