"""A torch model's trainable parameters and an optimizer's state, as a run shares them.

Theory of operation
-------------------
Both wrappers share tensors of a torch model with every peer of the run: DiLoCo its
outer parameters and outer optimizer's state, DataParallel the parameters and the
optimizer's state themselves. Three things are the same for both, and live here.

``trainable`` picks the parameters that require a gradient, and refuses what the
wrappers cannot handle: no such parameter, parameters on several devices, parameters
that are not floating point.

``check_optimizes`` insists that the optimizer steps exactly those parameters: an
optimizer built over other tensors would step something no peer shares.

``create_state`` makes the optimizer's state exist before the first sync. A joiner
must hold the same tensors as the run (the sync fills them in place), and torch
creates optimizer state lazily, at the first step. It takes one step on zero
gradients, then restores the parameters (and their ``.grad``) and sets every state
tensor that step created to zero, which is the fresh state of torch's SGD (without
dampening), Adam, AdamW, Adamax, RAdam, RMSprop and Adadelta, so the first real step
does exactly what it would have done. State that exists already (an optimizer that
creates it eagerly, like Adagrad, or state the trainer created or loaded) is kept as
it is. ``state_tensors`` then names every state tensor for the shared state
(``<prefix>.<parameter>.<key>``); state that is not a tensor cannot be shared, and is
refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._errors import InvalidArgument
from .._types import TensorInfo

__all__ = ["check_optimizes", "create_state", "named_state", "state_tensors", "trainable"]


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters that require a gradient, by name (see the module
    docstring for what is refused)."""
    if not isinstance(model, nn.Module):
        raise InvalidArgument(f"model must be a torch.nn.Module, not {type(model).__name__}")
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
    return named


def check_optimizes(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]],
                    *, what: str) -> None:
    """``optimizer`` (called ``what`` in messages) must step exactly the model's
    trainable parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgument(
            f"{what} must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
        )
    theirs = {id(p) for group in optimizer.param_groups for p in group["params"]}
    ours = {id(p) for _, p in named}
    if theirs != ours:
        missing = [name for name, p in named if id(p) not in theirs]
        raise InvalidArgument(
            f"the {what} must be built over the model's trainable parameters "
            f"(model.parameters()); it misses {missing[:3]}" if missing else
            f"the {what} steps tensors that are not the model's trainable parameters"
        )


def create_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Create the state the optimizer would create lazily, as fresh (zero) state."""
    lacking = [p for p in params if not optimizer.state.get(p)]
    if not lacking:
        return
    if len(lacking) < len(params):
        raise InvalidArgument(
            "the optimizer holds state for some of the model's parameters but not "
            "all: give it state for every parameter, or for none"
        )
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, value, grad in zip(params, saved, grads, strict=True):
            p.copy_(value)
            p.grad = grad
        for p in lacking:
            for state in optimizer.state[p].values():
                if isinstance(state, torch.Tensor):
                    state.zero_()


def state_tensors(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]],
                  prefix: str) -> list[TensorInfo]:
    """Every state tensor of ``optimizer``, named ``<prefix>.<parameter>.<key>``."""
    return named_state([optimizer.state[p] for _, p in named], [name for name, _ in named],
                       prefix)


def named_state(states: Sequence[Mapping[str, Any]], names: list[str],
                prefix: str) -> list[TensorInfo]:
    """Each parameter's state (``states[i]`` for parameter ``names[i]``) as tensors named
    ``<prefix>.<parameter>.<key>``, keys in sorted order; None entries are left out."""
    tensors = []
    for name, state in zip(names, states, strict=True):
        for key, value in sorted(state.items()):
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise InvalidArgument(
                    f"the optimizer keeps {key!r} of parameter {name!r} as "
                    f"{type(value).__name__}, not a tensor: it cannot be shared with joiners"
                )
            if not value.is_contiguous():
                raise InvalidArgument(
                    f"the optimizer's {key!r} of parameter {name!r} is not contiguous"
                )
            tensors.append(TensorInfo(f"{prefix}.{name}.{key}", value))
    return tensors
