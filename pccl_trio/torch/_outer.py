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

The outer optimizer's state must exist before the first sync: a joiner must hold the
same tensors as the run (the sync fills them in place), and torch creates optimizer
state lazily at the first step. ``OuterModel`` creates it up front with one step on zero
gradients, then restores the parameters and sets every state tensor that step created
to zero, which is the fresh state of torch's SGD (without dampening), Adam, AdamW,
Adamax, RAdam, RMSprop and Adadelta, so the first real step does exactly what it would
have done. State that exists already (an optimizer that creates it eagerly, like
Adagrad, or state the trainer created or loaded) is shared as it is. State that is not
a tensor cannot be shared, and is refused.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .._errors import InvalidArgument
from .._types import SharedState, TensorInfo

__all__ = ["OuterModel"]


class OuterModel:
    """A model's outer parameters, its outer optimizer and the shared state holding
    them (see the module docstring)."""

    def __init__(self, model: nn.Module, outer_optimizer: torch.optim.Optimizer | None) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise InvalidArgument("the model has no parameters that require a gradient")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise InvalidArgument(
                f"the model's parameters live on several devices ({sorted(map(str, devices))}); "
                "pccl_trio.torch wants them on one"
            )
        for name, p in named:
            if not p.is_floating_point():
                raise InvalidArgument(f"parameter {name!r} is {p.dtype}, not floating point")
        self.params = [p for _, p in named]
        self.device = self.params[0].device
        self.dtype = (
            torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        )
        self.numel = sum(p.numel() for p in self.params)
        with torch.no_grad():
            self.outer = [p.detach().clone() for p in self.params]
        if outer_optimizer is None:
            # DiLoCo's outer optimizer (Douillard et al., 2023).
            outer_optimizer = torch.optim.SGD(self.params, lr=0.7, momentum=0.9, nesterov=True)
        self.optimizer = outer_optimizer
        _check_optimizes(outer_optimizer, named)
        _create_state(outer_optimizer, self.params, self.outer)
        tensors = [
            TensorInfo(f"outer.{name}", outer)
            for (name, _), outer in zip(named, self.outer, strict=True)
        ]
        for (name, p) in named:
            for key, value in sorted(outer_optimizer.state[p].items()):
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise InvalidArgument(
                        f"the outer optimizer keeps {key!r} of parameter {name!r} as "
                        f"{type(value).__name__}, not a tensor: it cannot be shared with "
                        "joiners"
                    )
                tensors.append(TensorInfo(f"outer_optimizer.{name}.{key}", _contiguous(value)))
        self.shared = SharedState(tensors)

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
                p.grad = part.view_as(p).to(p.dtype).clone()
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


def _check_optimizes(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]) -> None:
    """The outer optimizer must step exactly the model's trainable parameters."""
    theirs = {id(p) for group in optimizer.param_groups for p in group["params"]}
    ours = {id(p) for _, p in named}
    if theirs != ours:
        missing = [name for name, p in named if id(p) not in theirs]
        raise InvalidArgument(
            "the outer optimizer must be built over the model's trainable parameters "
            f"(model.parameters()); it misses {missing[:3]}" if missing else
            "the outer optimizer steps tensors that are not the model's trainable parameters"
        )


def _create_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                  outer: list[torch.Tensor]) -> None:
    """Create the optimizer state it would create lazily, as fresh (zero) state."""
    lacking = [p for p in params if not optimizer.state.get(p)]
    if not lacking:
        return
    if len(lacking) < len(params):
        raise InvalidArgument(
            "the outer optimizer holds state for some of the model's parameters but not "
            "all: give it state for every parameter, or for none"
        )
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, saved, grad in zip(params, outer, grads, strict=True):
            p.copy_(saved)
            p.grad = grad
        for p in lacking:
            for value in optimizer.state[p].values():
                if isinstance(value, torch.Tensor):
                    value.zero_()


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise InvalidArgument("an outer optimizer state tensor is not contiguous")
    return tensor
