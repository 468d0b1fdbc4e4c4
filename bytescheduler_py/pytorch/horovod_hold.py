"""Tensors handed to Horovod with a second C++ reference, so that Horovod never needs the GIL to let go of them.

Why: when Horovod's background loop dies (a peer closed its connection: "Horovod background
loop uncaught exception"), its thread finalizes the operations still queued while it holds
its process-set table's lock, and destroys their tensors. In torch 2.x a tensor that has a
Python object and loses its last other C++ reference (its count going from 2 to 1) updates
the Python object, which takes the GIL. Meanwhile a Python thread that calls into Horovod
(``allreduce_async_`` and the other enqueue calls keep the GIL) first waits for that table
lock: the two wait for each other forever. That was the one Horovod hang of the chaos
campaign (trial 135); a script that kills the peer while a thread keeps enqueueing hung 5 of
13 times, gdb showing exactly these two stacks. A Python reference does not help (the
count still goes from 2 to 1), nor does a ``torch.futures.Future`` (it holds the Python
object): a C++ one does.

:class:`Held` gives Horovod an alias of the tensor (``detach()``: the same memory, not a
view) and keeps a view of that alias, whose view information holds the alias by a C++
reference, so Horovod's release never brings the count to 1. It is let go once the
operation succeeded (Horovod lets go in its normal course, outside that lock); a
:class:`Held` never released (the operation failed, timed out or was given up, when Horovod
may still finalize it) keeps its view for the life of the process: a few tensors, once.

>>> gradient = torch.zeros(4)
>>> held = Held(gradient)
>>> held.tensor.data_ptr() == gradient.data_ptr(), held.tensor._use_count()
(True, 2)
>>> held.release()   # the operation succeeded
>>> held.tensor._use_count()
1
"""

from __future__ import annotations

from typing import List, Optional

import torch

# Views holding the tensors of operations that failed or were given up, until the process ends.
_KEPT: List[torch.Tensor] = []


class Held:
    """``tensor``, for Horovod: an alias of the given tensor held by a C++ reference until
    :meth:`release`, or, if never released, until the process ends."""

    __slots__ = ("tensor", "_view")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()  # the same memory; not a view, so a view of it holds it
        self._view: Optional[torch.Tensor] = self.tensor.view(self.tensor.size())

    def release(self) -> None:
        """The operation succeeded: Horovod let go of the tensor in its normal course."""
        self._view = None

    def __del__(self) -> None:
        if self._view is not None:  # Horovod may still finalize the operation
            _KEPT.append(self._view)
