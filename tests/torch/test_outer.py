"""``OuterModel``: the outer step is the torch optimizer's own, its state exists before
the first sync, and what cannot be shared is refused; and the wrappers' argument checks.

No run here: the outer step is applied to averages made up by the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
import trio
from torch import nn

import pccl_trio as pccl
import pccl_trio.sync
import pccl_trio.torch as pccl_torch
from pccl_trio.torch._outer import OuterModel

Factory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
    "sgd-decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),  # creates its state eagerly
}


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def bits(model: nn.Module) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def made_up_gradients(model: nn.Module, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("delayed", [False, True], ids=["in-place", "delayed"])
def test_outer_steps_give_the_bits_of_the_optimizer_driven_by_hand(name: str, delayed: bool) -> None:
    """State made up front gives the same steps as the optimizer's lazy state: three
    outer steps equal three plain steps of the same optimizer on the same gradients,
    in place or, delayed, into the spare bank that is then published; the model is
    touched only by ``load``."""
    wrapped, plain_model = make_model(), make_model()
    start = bits(wrapped)
    outer = OuterModel(wrapped, OPTIMIZERS[name](wrapped.parameters()), delayed=delayed)
    plain = OPTIMIZERS[name](plain_model.parameters())
    for seed in range(3):
        gradients = made_up_gradients(plain_model, seed)
        averaged = torch.cat([g.reshape(-1) for g in gradients])
        if delayed:
            published = b"".join(o.numpy().tobytes() for o in outer.outer)
            outer.advance(averaged)
            assert b"".join(o.numpy().tobytes() for o in outer.outer) == published
            outer.publish()
        else:
            outer.apply(averaged)
        for p, g in zip(plain_model.parameters(), gradients, strict=True):
            p.grad = g.clone()
        plain.step()
        assert bits(wrapped) == start
        assert b"".join(o.numpy().tobytes() for o in outer.outer) == bits(plain_model)
        outer.load()
        assert bits(wrapped) == bits(plain_model)
        start = bits(wrapped)
    assert all(p.grad is None for p in wrapped.parameters())
    assert all(o.grad is None for o in outer.outer)
    expected = [
        (f"outer_optimizer.{name_}.{key}", value)
        for (name_, q) in plain_model.named_parameters()
        for key, value in sorted(plain.state[q].items()) if value is not None
    ]
    ours = [(info.name, info.data) for info in outer.shared.tensors[4:]]
    assert [name_ for name_, _ in ours] == [name_ for name_, _ in expected]
    for (key, mine), (_, theirs) in zip(ours, expected, strict=True):
        assert torch.equal(torch.as_tensor(mine), torch.as_tensor(theirs)), key


def test_the_delayed_banks_are_alike_but_apart() -> None:
    """With overlap: two banks of the same names, no tensor shared between them, and
    ``advance`` with no average copies the published bank and its revision."""
    model = make_model()
    outer = OuterModel(model, torch.optim.Adam(model.parameters(), lr=0.01), delayed=True)
    assert outer.spare is not None
    names = [t.name for t in outer.shared.tensors]
    assert names == [t.name for t in outer.spare_shared.tensors]
    ours = {id(t.data) for t in outer.shared.tensors}
    assert not ours & {id(t.data) for t in outer.spare_shared.tensors}
    outer.shared.revision = 7
    outer.advance(None)
    assert outer.spare_shared.revision == 7
    for a, b in zip(outer.shared.tensors, outer.spare_shared.tensors, strict=True):
        assert torch.equal(torch.as_tensor(a.data), torch.as_tensor(b.data))


def test_the_shared_state_holds_outer_parameters_and_optimizer_state_by_name() -> None:
    model = make_model()
    outer = OuterModel(model, torch.optim.Adam(model.parameters(), lr=0.01))
    names = [info.name for info in outer.shared.tensors]
    assert names[:4] == ["outer.0.weight", "outer.0.bias", "outer.2.weight", "outer.2.bias"]
    assert "outer_optimizer.0.weight.exp_avg" in names
    assert "outer_optimizer.2.bias.exp_avg_sq" in names
    assert "outer_optimizer.2.bias.step" in names
    assert outer.shared.revision == 0


def test_making_the_state_leaves_the_model_and_its_gradients_as_they_were() -> None:
    model = make_model()
    before = bits(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    OuterModel(model, torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.5))
    assert bits(model) == before
    assert all(bool((p.grad == 3.0).all()) for p in model.parameters())


def test_the_pseudo_gradient_is_outer_minus_local_and_load_goes_back() -> None:
    model = make_model()
    before = bits(model)
    outer = OuterModel(model, None)
    assert outer.optimizer.defaults["lr"] == 0.7 and outer.optimizer.defaults["nesterov"]
    with torch.no_grad():
        for index, p in enumerate(model.parameters()):
            p.add_(0.25 * (index + 1))
    vector = outer.new_vector()
    outer.pseudo_gradient(vector)
    expected = torch.cat([(o - p.detach()).reshape(-1)
                          for o, p in zip(outer.outer, model.parameters(), strict=True)])
    assert torch.equal(vector, expected) and vector.dtype == torch.float32
    outer.load()
    assert bits(model) == before


def test_a_double_precision_parameter_makes_the_vector_double() -> None:
    model = make_model()
    model[2].double()
    assert OuterModel(model, None).new_vector().dtype == torch.float64


def test_only_trainable_parameters_are_outer_ones() -> None:
    model = make_model()
    model[0].requires_grad_(False)
    outer = OuterModel(model, torch.optim.SGD(model[2].parameters(), lr=0.1))
    assert outer.numel == 3 + 1


def refused(model: nn.Module, optimizer: torch.optim.Optimizer | None, words: str) -> None:
    with pytest.raises(pccl.InvalidArgument, match=words):
        OuterModel(model, optimizer)


def test_what_cannot_be_an_outer_model_is_refused() -> None:
    frozen = make_model().requires_grad_(False)
    refused(frozen, None, "no parameters that require a gradient")
    model = make_model()
    refused(model, torch.optim.SGD(make_model().parameters(), lr=0.1), "misses")
    extra = torch.zeros(2, requires_grad=True)
    refused(model, torch.optim.SGD([*model.parameters(), extra], lr=0.1),
            "not the model's trainable parameters")
    split = make_model()
    split[2].to("meta")
    refused(split, None, "several devices")


def test_optimizer_state_that_cannot_be_shared_is_refused() -> None:
    model = make_model()
    partial = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = next(iter(model.parameters()))
    partial.state[first]["momentum_buffer"] = torch.zeros_like(first)
    refused(model, partial, "some of the model's parameters but not all")
    noted = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        noted.state[p]["momentum_buffer"] = torch.zeros_like(p)
        noted.state[p]["note"] = 1.5
    refused(model, noted, "'note' of parameter '0.weight' as float, not a tensor")


def wrapper_refused(words: str, **changes: object) -> None:
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    arguments: dict[str, object] = {
        "model": model, "inner_optimizer": inner, "sync_every": 10,
        "communicator": pccl_trio.sync.Communicator("127.0.0.1:48148"),
    }
    arguments.update(changes)
    if arguments.pop("inner_is_outer", False):
        arguments["outer_optimizer"] = inner
    with pytest.raises(pccl.InvalidArgument, match=words):
        pccl_torch.DiLoCo(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(("words", "changes"), [
    ("model must be a torch.nn.Module, not list", {"model": []}),
    ("inner_optimizer must be a torch.optim.Optimizer, not str", {"inner_optimizer": "adam"}),
    ("sync_every must be a positive int, not 0", {"sync_every": 0}),
    ("sync_every must be a positive int, not True", {"sync_every": True}),
    ("min_peers must be a positive int, not 0", {"min_peers": 0}),
    ("compression must be None, a pccl_trio.QuantizationOptions or a pccl_trio.TopK, not str",
     {"compression": "uint8"}),
    ("DiLoCo keeps the residual itself",
     {"compression": pccl.TopK(0.1, residual=torch.zeros(3))}),
    ("the outer optimizer must not be the inner one", {"inner_is_outer": True}),
    ("AsyncDiLoCo takes a pccl_trio.Communicator",
     {"communicator": pccl.Communicator("127.0.0.1:48148")}),
], ids=lambda value: value if isinstance(value, str) else "")
def test_wrong_arguments_are_named(words: str, changes: dict[str, object]) -> None:
    wrapper_refused(words, **changes)


def test_the_async_wrapper_wants_the_async_communicator() -> None:
    model = make_model()
    with pytest.raises(pccl.InvalidArgument, match="DiLoCo takes a pccl_trio.sync.Communicator"):
        pccl_torch.AsyncDiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=5,
            communicator=pccl_trio.sync.Communicator("127.0.0.1:48148"),  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("peers", [0, -2, True, 2.5, "3"], ids=repr)
def test_a_hold_for_a_wrong_count_is_refused(peers: object) -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    blocking = pccl_torch.DiLoCo(model, inner, sync_every=5,
                                 communicator=pccl_trio.sync.Communicator("127.0.0.1:48148"))
    asynchronous = pccl_torch.AsyncDiLoCo(model, inner, sync_every=5,
                                          communicator=pccl.Communicator("127.0.0.1:48148"))
    words = f"peers must be a positive int, not {peers!r}"
    with pytest.raises(pccl.InvalidArgument, match=words):
        blocking.hold(peers)  # type: ignore[arg-type]
    with pytest.raises(pccl.InvalidArgument, match=words):
        trio.run(asynchronous.hold, peers)
