"""Averaged gradients handed over as views of the buffer they were averaged in, not copied back.

A bucket of gradients is averaged in one flat buffer (DDP's buckets; the plain path's); the
way back copies each average into the parameter's own ``.grad``: one more pass over every
byte of the gradients, which on a one-core rank is time taken from compute. Pointing a
large, contiguous parameter's ``.grad`` at its place in the buffer gives the same values
without that pass, as DDP's ``gradient_as_bucket_view=True`` does:

- DDP's copy back into ``.grad`` finds the gradient already there (``copy_`` of a tensor
  onto the very same memory returns at once), so a communication hook, which must divide
  the bucket in a pass of its own, costs what DDP's built-in path costs;
- with ``zero_grad(set_to_none=False)`` the next backward accumulates into the view, so the
  copy into the bucket is skipped too; with the default ``set_to_none=True`` backward makes
  a fresh gradient, which is copied in as before.

What a user sees: after ``backward()`` such a ``.grad`` shares memory with the buffer, so a
reference kept from an earlier iteration shows later values (keep a ``.clone()`` instead),
as with DDP's option. ``grad_views=False`` (``BYTESCHEDULER_GRAD_VIEWS=0``) turns it off.
Small gradients are always copied: setting ``.grad`` from Python costs more than copying
a few KiB.

>>> param = torch.nn.Parameter(torch.zeros(64, 1024))
>>> param.grad = torch.ones(64, 1024)
>>> buffer = torch.full((64 * 1024,), 0.5)
>>> view = buffer.view(64, 1024)
>>> hand_over(param, view), param.grad.data_ptr() == buffer.data_ptr()
(True, True)
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

# Below this a copy is cheaper than setting ``.grad`` from Python (~1-2 us).
MIN_VIEW_BYTES = 64 * 1024


def can_view(param: torch.Tensor, view: torch.Tensor, min_bytes: int = MIN_VIEW_BYTES) -> bool:
    """Whether ``view`` may become ``param``'s gradient: large enough to pay, and laid out as
    ``param`` is (DDP's copy back skips only an exact alias: same sizes, strides, dtype)."""
    return (view.numel() * view.element_size() >= min_bytes and view.dtype == param.dtype
            and view.device == param.device and tuple(view.shape) == tuple(param.shape)
            and tuple(view.stride()) == tuple(param.stride()))


def hand_over(param: torch.Tensor, view: torch.Tensor) -> bool:
    """Make ``view`` ``param``'s gradient when ``param`` has a dense gradient of that layout
    that is not ``view`` already; True when it did."""
    grad = param.grad
    if grad is None or grad is view or grad.is_sparse or grad.dtype != view.dtype or grad.shape != view.shape:
        return False
    param.grad = view
    return True


class BucketViews:
    """A DDP communication hook's side of it: each bucket is divided into a buffer of the
    hook's own, which is then all-reduced and returned to DDP, and the bucket's large
    gradients become views of that buffer, so DDP's copy back finds them in place.

    Why not DDP's own bucket: DDP (without ``gradient_as_bucket_view``) refuses a gradient
    that is a view of its bucket when the next backward hands it over again (an internal
    assertion). The division writes the buffer anyway (DDP's built-in path fuses it into
    the copy into the bucket; a hook gets the bucket undivided), so dividing into another
    buffer costs what dividing in place costs. That buffer is one per bucket, reused: by the
    time DDP calls the hook for a bucket again, its gradients have been copied into DDP's
    bucket. Memory: one more copy of the gradients, while the gradients' own tensors are
    freed as they are handed over. Buckets without a large gradient, and DDP run with
    ``gradient_as_bucket_view=True`` (its gradients are the bucket already), are divided
    in place as before. That mode is told from every large gradient of the bucket, not
    one: with ``find_unused_parameters=True`` a parameter unused on this rank has no
    gradient when the hook runs, while the others' are DDP's views, which DDP checks are
    still its views when it takes the result back (and raises otherwise).

    >>> views = BucketViews()                                  # in the hook:
    >>> averaged = views.divide(bucket, world_size)            # doctest: +SKIP
    >>> dist.all_reduce(averaged)  # then return it to DDP     # doctest: +SKIP
    """

    def __init__(self, min_bytes: int = MIN_VIEW_BYTES) -> None:
        self._min_bytes = min_bytes
        # bucket index -> (DDP's buffer, our buffer or None, [(parameter, its view)]). Holding
        # DDP's buffer keeps its memory from being reused, so a buffer at the same address
        # is the same bucket: a rebuilt bucket (new parameters, new offsets) always has
        # another address.
        self._buckets: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor], List[Tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._seen: List[int] = []  # bucket indices of the current iteration

    def divide(self, bucket: "torch.distributed.GradBucket", world_size: int) -> torch.Tensor:
        """``bucket``'s buffer divided by ``world_size``: into this object's buffer for the
        bucket (returned; its large gradients now views of it), or in place (returned)."""
        buffer = bucket.buffer()
        index = bucket.index()
        if index == 0:  # a new iteration: forget buckets DDP no longer has (after a rebuild)
            for gone in set(self._buckets) - set(self._seen):
                del self._buckets[gone]
            self._seen = []
        self._seen.append(index)
        known = self._buckets.get(index)
        if known is None or known[0].data_ptr() != buffer.data_ptr() or known[0].numel() != buffer.numel():
            known = self._buckets[index] = (buffer, *self._views(bucket, buffer))
        averaged, pairs = known[1], known[2]
        if averaged is None or any(_is_ddps_own_view(param.grad, buffer) for param, _ in pairs):
            return buffer.div_(world_size)
        torch.div(buffer, world_size, out=averaged)
        for param, view in pairs:
            hand_over(param, view)
        return averaged

    def _views(self, bucket: "torch.distributed.GradBucket", buffer: torch.Tensor
               ) -> Tuple[Optional[torch.Tensor], List[Tuple[torch.Tensor, torch.Tensor]]]:
        chosen = [(param, (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size())
                  for param, grad in zip(bucket.parameters(), bucket.gradients())
                  if can_view(param, grad, self._min_bytes)]
        if not chosen:
            return None, []
        averaged = torch.empty_like(buffer)
        return averaged, [(param, averaged.narrow(0, offset, param.numel()).view(param.shape))
                          for param, offset in chosen]


def _is_ddps_own_view(grad: Optional[torch.Tensor], buffer: torch.Tensor) -> bool:
    """Whether ``grad`` lives in DDP's bucket (``gradient_as_bucket_view=True``)."""
    return grad is not None and grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def split_views(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``flat`` cut into one view per gradient, each shaped as that gradient."""
    pieces = torch.split(flat, [grad.numel() for grad in grads])
    return [piece.view(grad.shape) for piece, grad in zip(pieces, grads)]
