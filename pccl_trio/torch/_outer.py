"""The outer model of DiLoCo, in torch: what the run shares and how an outer step moves it.

Theory of operation
-------------------
DiLoCo keeps two copies of a model's parameters. The *local* ones are the model's own
tensors, which the trainer's inner optimizer moves every step. The *outer* ones are
where every round starts from; they, and the outer optimizer's state, are the run's
shared state, so a joiner receives them by a sync and every peer holds the same bits.
A ``Bank`` holds one such copy: a detached tensor per trainable parameter, the outer
optimizer's state for each, and the ``SharedState`` naming them all.

The outer optimizer is built by the trainer over the model's parameters, as any torch
optimizer is; ``OuterModel`` then *points it at a bank*: its parameter groups list the
bank's tensors instead of the model's, and its state is keyed by them. An outer step
sets each bank tensor's ``.grad`` to its slice of the averaged vector and calls the
optimizer's own ``step``: the same arithmetic, on the same values, as stepping the
model's parameters would be, and it leaves the model alone. That matters with
``overlap``: the outer step of a round is taken while the trainer's thread trains the
model on the next one.

At the end of a round, ``pseudo_gradient`` writes outer minus local, flattened into one
vector (float32, or float64 when a parameter is), which the run all-reduces as a single
tensor: one all-reduce, one verdict. ``load`` sets the model to the outer parameters.
The outer step is a deterministic function of identical inputs (shared state and
all-reduce result), so every peer computes the same bits.

Without ``overlap`` there is one bank, stepped in place. With it there are two: the
*published* bank holds the outer parameters the current round started from, and is
what the wrapper's ``shared_state`` shows; ``advance`` makes the other one the
published one's copy and takes the outer step there, and ``publish`` swaps them at the
next boundary. Between boundaries the published bank stays as it was (only a sync
that corrects a peer whose state was wrong writes it), so the trainer may read it.

The outer optimizer's state must exist before the first sync: it is made up front, as
torch would make it at the first step (``_state.create_state``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .._types import SharedState, TensorInfo
from ._state import check_optimizes, create_state, named_state, trainable

__all__ = ["Bank", "OuterModel", "nonzero"]


def nonzero(vector: torch.Tensor) -> bool:
    """Whether ``vector`` holds anything but zeros (either sign); a NaN counts. Its
    largest and smallest element tell, at a fraction of ``any()``'s cost."""
    return bool(vector.amax() != 0) or bool(vector.amin() != 0)


class Bank:
    """One copy of the outer parameters and the outer optimizer's state, and the
    shared state that names them (``names``: the model's parameter names; ``keys``:
    each parameter's state keys)."""

    def __init__(self, params: list[torch.Tensor], state: list[dict[str, torch.Tensor]],
                 names: list[str]) -> None:
        self.params = params
        self.state = state
        self.shared = SharedState(
            [TensorInfo(f"outer.{name}", p) for name, p in zip(names, params, strict=True)]
            + named_state(state, names, "outer_optimizer")
        )

    def copy(self, names: list[str]) -> Bank:
        """A bank of the same shapes and values."""
        with torch.no_grad():
            return Bank([p.clone() for p in self.params],
                        [{k: v.clone() for k, v in entries.items()} for entries in self.state],
                        names)

    def copy_from(self, other: Bank) -> None:
        """Take ``other``'s values and revision."""
        with torch.no_grad():
            for mine, theirs in zip(self.params, other.params, strict=True):
                mine.copy_(theirs)
            for mine_state, their_state in zip(self.state, other.state, strict=True):
                for key, value in mine_state.items():
                    value.copy_(their_state[key])
        self.shared.revision = other.shared.revision


class OuterModel:
    """A model's outer parameters, its outer optimizer and the banks holding them
    (see the module docstring)."""

    def __init__(self, model: nn.Module, outer_optimizer: torch.optim.Optimizer | None, *,
                 delayed: bool = False) -> None:
        named = trainable(model)
        self.params = [p for _, p in named]
        self.device = self.params[0].device
        self.dtype = (
            torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        )
        self.numel = sum(p.numel() for p in self.params)
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
        self._names = [name for name, _ in named]
        index = {id(p): i for i, p in enumerate(self.params)}
        self._groups = [[index[id(p)] for p in group["params"]]
                        for group in outer_optimizer.param_groups]
        with torch.no_grad():
            outer = [p.detach().clone() for p in self.params]
        state = [{key: value for key, value in outer_optimizer.state[p].items() if value is not None}
                 for p in self.params]
        self.bank = Bank(outer, state, self._names)  # published: where the round started
        self.spare = self.bank.copy(self._names) if delayed else None
        self._point(self.bank)

    @property
    def shared(self) -> SharedState:
        """The published bank's shared state."""
        return self.bank.shared

    @property
    def spare_shared(self) -> SharedState:
        """With ``overlap``: the spare bank's shared state (``advance`` moved it)."""
        assert self.spare is not None, "a delayed OuterModel has a spare bank"
        return self.spare.shared

    @property
    def outer(self) -> list[torch.Tensor]:
        """The published outer parameters."""
        return self.bank.params

    def new_vector(self) -> torch.Tensor:
        """A zeroed vector of the pseudo-gradient's size, dtype and device."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def pseudo_gradient(self, into: torch.Tensor) -> None:
        """Write the published outer minus the local parameters into ``into``, flattened."""
        with torch.no_grad():
            for part, outer, p in self._parts(into, self.bank):
                torch.sub(outer.reshape(-1), p.detach().reshape(-1), out=part)

    def apply(self, averaged: torch.Tensor) -> None:
        """The outer step with ``averaged`` as the gradient, on the published bank, in
        place (without ``overlap``); the model is not touched (``load`` does that)."""
        self._step(self.bank, averaged)

    def advance(self, averaged: torch.Tensor | None) -> None:
        """With ``overlap``: the spare bank becomes a copy of the published one, then
        takes the outer step with ``averaged`` (None: no step). ``publish`` shows it."""
        assert self.spare is not None, "advance() is for a delayed OuterModel"
        self.spare.copy_from(self.bank)
        if averaged is not None:
            self._step(self.spare, averaged)

    def publish(self) -> None:
        """With ``overlap``: the bank ``advance`` moved becomes the published one."""
        assert self.spare is not None, "publish() is for a delayed OuterModel"
        self.bank, self.spare = self.spare, self.bank

    def load(self) -> None:
        """Set the model's parameters to the published outer ones."""
        with torch.no_grad():
            for outer, p in zip(self.bank.params, self.params, strict=True):
                p.copy_(outer)

    def _step(self, bank: Bank, averaged: torch.Tensor) -> None:
        self._point(bank)
        with torch.no_grad():
            for part, outer, p in self._parts(averaged, bank):
                grad = part.view_as(outer)  # read by the step, not kept: a view will do
                outer.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)
        self.optimizer.step()
        for outer in bank.params:
            outer.grad = None

    def _point(self, bank: Bank) -> None:
        """Point the outer optimizer at ``bank``'s tensors and state (module docstring)."""
        optimizer = self.optimizer
        for group, indices in zip(optimizer.param_groups, self._groups, strict=True):
            group["params"] = [bank.params[i] for i in indices]
        optimizer.state.clear()
        for outer, entries in zip(bank.params, bank.state, strict=True):
            optimizer.state[outer] = entries

    def _parts(self, vector: torch.Tensor, bank: Bank
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        offset = 0
        for outer, p in zip(bank.params, self.params, strict=True):
            yield vector[offset : offset + p.numel()], outer, p
            offset += p.numel()
