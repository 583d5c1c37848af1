"""The outer model of DiLoCo, in torch: what the run shares and how an outer step moves it.

Theory of operation
-------------------
DiLoCo keeps two copies of a model's parameters. The *local* ones are the model's own
tensors, which the trainer's inner optimizer moves every step. The *outer* ones
(``OuterModel.outer``, one detached copy per trainable parameter) are where every
round starts from; they, and the outer optimizer's state, are the run's shared state
(``shared``), so a joiner receives them by a sync and every peer holds the same bits.

At the end of a round, ``pseudo_gradient`` writes outer minus local, flattened into
one vector (float32, or float64 when a parameter is), which the run all-reduces as a
single tensor: one all-reduce, one verdict. ``apply`` then takes the outer step the
way torch's optimizers are meant to be driven: each parameter is set to its outer
value, its ``.grad`` to its slice of the averaged vector (in its own dtype), the outer
optimizer (built by the trainer over the model's parameters, as for any torch
optimizer) steps, and the results are copied back into the outer tensors. The model
is left at the new outer parameters. The outer step is a deterministic function of
identical inputs (shared state and all-reduce result), so every peer computes the same
bits.

The outer optimizer's state must exist before the first sync: it is made up front,
as torch would make it at the first step (``_state.create_state``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .._types import SharedState, TensorInfo
from ._state import check_optimizes, create_state, state_tensors, trainable

__all__ = ["OuterModel"]


class OuterModel:
    """A model's outer parameters, its outer optimizer and the shared state holding
    them (see the module docstring)."""

    def __init__(self, model: nn.Module, outer_optimizer: torch.optim.Optimizer | None, *,
                 delayed: bool = False) -> None:
        named = trainable(model)
        self.params = [p for _, p in named]
        self.device = self.params[0].device
        self.dtype = (
            torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        )
        self.numel = sum(p.numel() for p in self.params)
        with torch.no_grad():
            self.outer = [p.detach().clone() for p in self.params]
        if outer_optimizer is None and delayed:
            # Applied a round late, Nesterov momentum amplifies a stale direction: on
            # the char-level LM example it diverged, plain SGD did not (docs/diloco.md).
            outer_optimizer = torch.optim.SGD(self.params, lr=0.7)
        elif outer_optimizer is None:
            # DiLoCo's outer optimizer (Douillard et al., 2023).
            outer_optimizer = torch.optim.SGD(self.params, lr=0.7, momentum=0.9, nesterov=True)
        self.optimizer = outer_optimizer
        check_optimizes(outer_optimizer, named, what="outer optimizer")
        create_state(outer_optimizer, self.params)
        tensors = [
            TensorInfo(f"outer.{name}", outer)
            for (name, _), outer in zip(named, self.outer, strict=True)
        ]
        self.shared = SharedState(tensors + state_tensors(outer_optimizer, named, "outer_optimizer"))

    def new_vector(self) -> torch.Tensor:
        """A zeroed vector of the pseudo-gradient's size, dtype and device."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def pseudo_gradient(self, into: torch.Tensor) -> None:
        """Write outer minus local parameters into ``into``, flattened."""
        with torch.no_grad():
            for part, outer, p in self._parts(into):
                torch.sub(outer.reshape(-1), p.detach().reshape(-1), out=part)

    def apply(self, averaged: torch.Tensor) -> None:
        """The outer step with ``averaged`` as the gradient; the model is left at the
        new outer parameters (see the module docstring)."""
        with torch.no_grad():
            for part, outer, p in self._parts(averaged):
                p.copy_(outer)
                grad = part.view_as(p)  # read by the step, not kept: a view will do
                p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)
        self.optimizer.step()
        with torch.no_grad():
            for outer, p in zip(self.outer, self.params, strict=True):
                outer.copy_(p)
                p.grad = None

    def load(self) -> None:
        """Set the model's parameters to the outer ones."""
        with torch.no_grad():
            for outer, p in zip(self.outer, self.params, strict=True):
                p.copy_(outer)

    def _parts(self, vector: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        offset = 0
        for outer, p in zip(self.outer, self.params, strict=True):
            yield vector[offset : offset + p.numel()], outer, p
            offset += p.numel()
