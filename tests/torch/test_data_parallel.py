"""``GradientRounds``' buckets and hooks, without a run; ``DataParallel``'s argument checks.

The hooks are driven by real backward passes; what would start an all-reduce is
recorded instead (``rounds.start``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pccl_trio as pccl
import pccl_trio.sync
import pccl_trio.torch as pccl_torch
from pccl_trio.torch._gradients import Bucket, GradientRounds, buckets_of


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)  # 32 + 8 float32: 160 bytes
        self.second = nn.Linear(8, 2)  # 16 + 2: 72 bytes
        self.spare = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))  # spare unused


def names(model: nn.Module, bucket: Bucket) -> list[str]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id[id(p)] for p in bucket.params]


def test_buckets_fill_in_reverse_order_up_to_their_size_one_dtype_each() -> None:
    model = Net()
    model.second.double()
    named = list(model.named_parameters())
    buckets = buckets_of(named, bucket_bytes=160)
    # float32: spare's 72 bytes and first.bias's 32 fit in 160; first.weight's 128 do
    # not; float64 (second) goes apart, 144 bytes.
    assert [names(model, b) for b in buckets] == [
        ["spare.bias", "spare.weight", "first.bias"], ["second.bias", "second.weight"],
        ["first.weight"],
    ]
    assert [b.tag for b in buckets] == [0, 1, 2]
    assert buckets[1].buffer.dtype == torch.float64 and buckets[1].buffer.numel() == 18
    one = buckets_of(named, bucket_bytes=2**20)
    assert [names(model, b) for b in one] == [
        ["spare.bias", "spare.weight", "first.bias", "first.weight"],
        ["second.bias", "second.weight"],
    ]


def test_hooks_start_each_bucket_once_its_gradients_exist() -> None:
    model = Net()
    rounds = GradientRounds(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            bucket_bytes=40, min_peers=1)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(rounds.ready)
    started: list[list[str]] = []

    def start(bucket: Bucket) -> None:
        bucket.fill()
        bucket.handle = object()  # type: ignore[assignment]
        started.append(names(model, bucket))

    model(torch.randn(3, 4)).sum().backward()  # not joined yet: nothing starts
    assert started == []
    model.zero_grad()
    rounds.start = start
    model(torch.randn(3, 4)).sum().backward()
    assert ["second.bias"] in started and ["first.weight"] in started
    assert ["spare.bias"] not in started  # unused: its bucket waits for step()
    assert started.index(["second.bias"]) < started.index(["first.bias"])
    bucket = next(b for b in rounds.buckets if names(model, b) == ["first.weight"])
    assert torch.equal(bucket.buffer, model.first.weight.grad.reshape(-1))


def test_the_shared_state_holds_the_parameters_themselves_and_the_optimizer_state() -> None:
    model = Net()
    rounds = GradientRounds(model, torch.optim.Adam(model.parameters(), lr=0.1),
                            bucket_bytes=2**20, min_peers=1)
    names_ = [info.name for info in rounds.shared.tensors]
    assert names_[:2] == ["params.first.weight", "params.first.bias"]
    assert "optimizer.spare.bias.exp_avg_sq" in names_
    assert rounds.shared.tensors[0].data.data_ptr() == model.first.weight.data_ptr()


@pytest.mark.parametrize(("words", "changes"), [
    ("bucket_bytes must be a positive int, not 0", {"bucket_bytes": 0}),
    ("min_peers must be a positive int, not -1", {"min_peers": -1}),
    ("optimizer must be a torch.optim.Optimizer, not NoneType", {"optimizer": None}),
    ("AsyncDataParallel takes a pccl_trio.Communicator",
     {"communicator": pccl.Communicator("127.0.0.1:48148")}),
], ids=lambda value: value if isinstance(value, str) else "")
def test_wrong_arguments_are_named(words: str, changes: dict[str, object]) -> None:
    model = Net()
    arguments: dict[str, object] = {
        "communicator": pccl_trio.sync.Communicator("127.0.0.1:48148"),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    }
    arguments.update(changes)
    with pytest.raises(pccl.InvalidArgument, match=words):
        pccl_torch.DataParallel(model, **arguments)  # type: ignore[arg-type]


def test_the_async_wrapper_wants_the_async_communicator() -> None:
    model = Net()
    with pytest.raises(pccl.InvalidArgument, match="DataParallel takes a pccl_trio.sync"):
        pccl_torch.AsyncDataParallel(
            model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            communicator=pccl_trio.sync.Communicator("127.0.0.1:48148"),  # type: ignore[arg-type]
        )
