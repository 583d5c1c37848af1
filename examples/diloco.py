"""DiLoCo over pccl_trio: peers that join and die at any moment train one model together,
talking to each other once every H local steps.

Run ``python examples/diloco.py`` for the whole demo on this machine: a master and three
peers on loopback train a small MLP on scikit-learn's digits (shipped inside the
package, no download); one peer is SIGKILLed mid-run, a new one joins later, and at the
end every peer's parameters are checked to be bit-identical. ``--single`` trains the
same model in one process for comparison (``docs/diloco.md``). ``--peer HOST:PORT`` is
one peer of a run: the part to copy into a trainer.

Theory of operation
-------------------
Each outer step, every peer:

1. admits waiting peers (``are_peers_pending`` / ``update_topology``) and re-orders the
   ring (``optimize_topology``), like every pccl_trio trainer;
2. syncs the shared state: the *outer* parameters and the outer optimizer's Nesterov
   momentum, at revision = outer steps done. A joiner (fresh tensors, revision 0) receives both
   and the revision here; between peers that stepped together nothing moves;
3. copies the outer parameters into its local model and takes H AdamW steps on its
   slice of the data (its inner optimizer state stays its own, as in the paper);
4. all-reduces (AVG, optionally uint8-quantized, optionally Top-k sparse with error
   feedback) the pseudo-gradient, outer parameters minus local parameters, as one
   flat tensor: one all-reduce, one verdict;
5. applies the outer step, ``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)``,
   in place to the shared tensors, and advances the revision by one. With Top-k the
   outer step is plain SGD at ``lr=4`` (``--outer-lr``, ``--outer-momentum``): the
   residual already carries what momentum would (it keeps every update not yet sent,
   as SparseLoCo argues), and each step moves only the entries sent, so it takes a
   longer stride.

Why every peer stays bit-identical: the all-reduce gives every peer the same bits, and
the outer step is a deterministic function of those bits and the (identical) shared
state, so every peer computes the same new outer parameters and momentum. The
revision rule (``docs/shared-state.md``) wants one step per sync: the revision moves
only after a successful all-reduce, which every survivor gets the same verdict on. When
a peer dies mid all-reduce every survivor gets ``CollectiveAborted`` with its buffer
restored, and retries the same all-reduce with the survivors (no revision moved, the
pseudo-gradient is still the one from this outer step's inner steps). A peer left
alone (``TooFewPeers``) is its own average. A membership call or a sync that fails
with a retryable error is called again; a sync at the same revision again is allowed
(nobody holds the next one), which the waits for company rely on too.

The data: the training set is shuffled once by ``--seed``; at each outer step the
current members (the ring, sorted by peer id) split it into W interleaved slices, and
the peer of rank k in that order trains on slice k. Whatever the membership, the slices
partition the training set: a dead peer's samples go to the survivors, a joiner takes a
slice at once, and no sample is read by two peers in one outer step. The inner batches
are drawn from a generator seeded by (seed, outer step, rank), so a run is
reproducible given its membership history, up to rounding (the all-reduce sums in ring
order).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from _launcher import (
    Peer,
    add_churn_flags,
    churn_arguments,
    demo_environment,
    end,
    run_churn,
    say,
    start_master,
)

import pccl_trio as pccl

if TYPE_CHECKING:  # torch is imported where it is used: the launcher never needs it
    import torch
    from torch import nn

TEST_FRACTION = 0.2


# ---------------------------------------------------------------------------------------
# Data and model (shared by every mode)


@dataclass(frozen=True)
class Data:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_data(seed: int) -> Data:
    """scikit-learn's 8x8 digits (1797 images, in the wheel), scaled to [0, 1], shuffled
    by ``seed`` and split 80/20 into train and test."""
    import torch
    from sklearn.datasets import load_digits  # imported here: only the trainer needs it

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = int(len(y) * TEST_FRACTION)
    return Data(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def make_model(seed: int, hidden: int) -> nn.Module:
    import torch
    from torch import nn

    torch.manual_seed(seed)  # every peer starts from the same weights
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def flat_parameters(model: nn.Module) -> torch.Tensor:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the model's parameters (copies: the model never aliases it)."""
    import torch

    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``."""
    import torch
    from torch import nn

    with torch.no_grad():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return loss, accuracy


def inner_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
    steps: int, batch: int, generator: torch.Generator,
) -> float:
    """``steps`` AdamW steps on batches drawn from ``(x, y)``; the mean batch loss."""
    import torch
    from torch import nn

    total = 0.0
    for _ in range(steps):
        index = torch.randint(len(y), (batch,), generator=generator)
        loss = nn.functional.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        total += loss.item()
    return total / steps


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


# ---------------------------------------------------------------------------------------
# One peer of a run


@dataclass
class Trainer:
    """What one peer trains: its data, its local model and inner optimizer, the outer
    model and momentum (the run's shared state) and the outer optimizer."""

    data: Data
    model: nn.Module
    inner: torch.optim.Optimizer
    outer: torch.Tensor
    momentum: torch.Tensor
    outer_optimizer: torch.optim.Optimizer
    state: pccl.SharedState
    quantization: pccl.QuantizationOptions | None
    # ``--compress topk:F``: the share of entries sent, and this peer's residual (what
    # it has not sent yet: its own, never shared; a joiner's starts at zero).
    topk: float | None
    residual: torch.Tensor
    value_bits: int | None  # ``--value-bits``: the kept values' codes packed to so many bits


def make_trainer(args: argparse.Namespace) -> Trainer:
    import torch

    torch.set_num_threads(1)  # several peers share this machine's cores
    data = load_data(args.seed)
    model = make_model(args.seed, args.hidden)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    # The outer model: one flat tensor, its Nesterov momentum pre-allocated so that
    # SGD updates it in place (a buffer the shared state already points at).
    outer = flat_parameters(model).clone()
    momentum = torch.zeros_like(outer)
    outer_optimizer = torch.optim.SGD([outer], lr=args.outer_lr, momentum=args.outer_momentum,
                                      nesterov=args.outer_momentum > 0)
    if args.outer_momentum > 0:
        outer_optimizer.state[outer]["momentum_buffer"] = momentum
    state = pccl.SharedState([pccl.TensorInfo("outer.params", outer),
                              pccl.TensorInfo("outer.momentum", momentum)])
    quantization = (
        pccl.QuantizationOptions(quantized_datatype=pccl.DataType.UINT8,
                                  algorithm=pccl.QuantizationAlgorithm.MIN_MAX)
        if args.quantize else None
    )
    return Trainer(data, model, inner, outer, momentum, outer_optimizer, state, quantization,
                   args.compress, torch.zeros_like(outer), args.value_bits)


def reduce_options(trainer: Trainer) -> dict[str, Any]:
    """How the pseudo-gradient is all-reduced: dense (uint8 with ``--quantize``), or
    Top-k with error feedback (its kept values uint8 with ``--quantize``)."""
    if trainer.topk is None:
        return {"quantization": trainer.quantization}
    return {"compression": pccl.TopK(trainer.topk, residual=trainer.residual,
                                     values=trainer.quantization, value_bits=trainer.value_bits)}


async def train_peer(master: str, args: argparse.Namespace) -> None:
    """One peer, in the hand-written loop of docs/loop.md: a communicator per stay in the run; a peer
    kicked after it stepped joins again as a newcomer (revision 0, so its first sync
    brings the run's outer model)."""
    emit(event="loading")  # importing torch and the data takes a few seconds
    trainer = make_trainer(args)
    while trainer.state.revision < args.outer_steps:
        async with pccl.Communicator(master, 0, p2p_host="127.0.0.1") as comm:
            emit(event="joined", peer=comm.peer_id)
            await train_in_run(comm, trainer, args)
            if trainer.state.revision >= args.outer_steps:
                emit_finished(comm, trainer)


async def train_in_run(comm: pccl.Communicator, trainer: Trainer, args: argparse.Namespace) -> None:
    """Outer steps with one communicator; returns when this peer must join again.

    The hand-written loop of docs/loop.md, with what DiLoCo changes: the run holds for company before
    outer step 0 and at ``--hold-at`` (testing the revision after the sync, which
    every peer shares), a peer alone otherwise takes the outer step on its own
    pseudo-gradient (``TooFewPeers`` from the all-reduce), and an aborted all-reduce
    is made again with the same pseudo-gradient, without redoing the inner steps.
    """
    state, outer = trainer.state, trainer.outer
    me = comm.peer_id
    assert me is not None  # connected
    # connect() returned at the end of the others' update_topology: a joiner's first
    # call is the optimize_topology they make next.
    joined, resync, stepped, waiting = True, False, False, False
    pending: torch.Tensor | None = None  # a pseudo-gradient whose all-reduce aborted
    inner_loss = math.nan
    while state.revision < args.outer_steps:
        try:
            if not resync:
                # Admit the peers waiting to join; while the run waits for company, the
                # master holds the question until one asks (no polling).
                if joined or await comm.are_peers_pending(wait=math.inf if waiting else 0):
                    if not joined:
                        await comm.update_topology()
                    joined = False
                    await comm.optimize_topology()
            resync = False
            synced = await comm.sync_shared_state(state)
            if synced.rx_bytes:
                emit(event="synced", peer=comm.peer_id, step=state.revision, rx=synced.rx_bytes)
                pending = None  # the outer model changed under it
            members = sorted(comm.ring)
            world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
            # Before the first outer step (and, in the demo, at --hold-at): wait for
            # company. The revision is the run's after the sync, so every peer takes
            # the same branch.
            holding = state.revision in (0, args.hold_at) and world < args.world
            if holding and not waiting:
                emit(event="waiting", peer=comm.peer_id, step=state.revision, world=world,
                     wanted=args.world)
            waiting = holding
            if waiting:
                continue
            if state.revision == args.stall_after:
                emit(event="stalled", peer=comm.peer_id, step=state.revision)
                await trio.sleep_forever()  # the demo's victim: SIGKILLed here

            if pending is None:
                # Inner steps, off the event loop, on this peer's slice of the data.
                pending, inner_loss = await trio.to_thread.run_sync(
                    local_round, trainer, args, state.revision, members.index(me),
                    len(members),
                )
            # The pseudo-gradient, averaged over the peers.
            try:
                info = await comm.all_reduce(pending, op=pccl.ReduceOp.AVG,
                                             **reduce_options(trainer))
                world, sent = info.world_size, info.tx_bytes
            except pccl.TooFewPeers:
                world, sent = 1, 0  # alone: its own pseudo-gradient is the average
        except (pccl.CollectiveAborted, pccl.SharedStateSyncFailed) as exc:
            # Aborted for every peer (a peer died, or one's sync failed), or this peer's
            # sync failed: the step starts over at its sync, at the same revision,
            # which moves nothing between peers that hold the same outer model; the
            # pseudo-gradient, restored to its input, is all-reduced again.
            emit(event="aborted", peer=comm.peer_id, step=state.revision, reason=str(exc))
            resync = True
            continue
        except (pccl.UpdateTopologyFailed, pccl.TopologyOptimizationFailed) as exc:
            emit(event="retry", peer=comm.peer_id, error=type(exc).__name__, message=str(exc))
            continue  # every voter got the same verdict: the step starts over at the top
        except pccl.Kicked as exc:
            if not stepped:
                raise  # kicked before any step: a mistake to fix (the reason names it)
            emit(event="error", kind=type(exc).__name__, message=f"{exc}; joining again")
            state.revision = 0  # a newcomer: its first sync brings the run's state
            return

        # The outer step, in place on the shared tensors; then the next revision.
        outer.grad, pending = pending, None
        trainer.outer_optimizer.step()
        state.revision += 1
        stepped = True
        load_flat(trainer.model, outer)
        loss, _ = evaluate(trainer.model, trainer.data.train_x, trainer.data.train_y)
        emit(event="step", peer=comm.peer_id, step=state.revision, peers=sorted(comm.ring),
             world=world, inner_loss=round(inner_loss, 4), loss=round(loss, 4), tx=sent)


def local_round(
    trainer: Trainer, args: argparse.Namespace, revision: int, rank: int, ranks: int
) -> tuple[torch.Tensor, float]:
    """The inner steps of outer step ``revision`` on the slice of rank ``rank`` of
    ``ranks``: the pseudo-gradient and the mean inner loss."""
    import torch

    data = trainer.data
    shard = slice(rank, None, ranks)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + revision * 1009 + rank)
    load_flat(trainer.model, trainer.outer)
    inner_loss = inner_steps(trainer.model, trainer.inner, data.train_x[shard],
                             data.train_y[shard], args.inner_steps, args.batch, generator)
    return trainer.outer - flat_parameters(trainer.model), inner_loss


def emit_finished(comm: pccl.Communicator, trainer: Trainer) -> None:
    data, model = trainer.data, trainer.model
    test_loss, test_accuracy = evaluate(model, data.test_x, data.test_y)
    digest = hashlib.sha256(trainer.outer.numpy().tobytes() + trainer.momentum.numpy().tobytes())
    emit(event="finished", peer=comm.peer_id, step=trainer.state.revision,
         loss=round(evaluate(model, data.train_x, data.train_y)[0], 4),
         test_loss=round(test_loss, 4), test_accuracy=round(test_accuracy, 4),
         digest=digest.hexdigest())


async def run_peer(master: str, args: argparse.Namespace) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def stop() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop)
            try:
                await train_peer(master, args)
            except pccl.PCCLError as exc:
                emit(event="error", kind=type(exc).__name__, message=str(exc))
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------
# The same model in one process


def train_single(args: argparse.Namespace) -> None:
    """Plain AdamW, no peers: as many sequential steps as a DiLoCo peer takes
    (outer x inner), each on ``world`` x ``batch`` samples, so the same samples as the
    whole DiLoCo run, and what synchronous data-parallel training (a gradient
    all-reduce every step) over ``world`` peers computes."""
    import torch

    torch.set_num_threads(1)
    data = load_data(args.seed)
    model = make_model(args.seed, args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    generator = torch.Generator().manual_seed(args.seed)
    batch = args.world * args.batch
    for step in range(1, args.outer_steps + 1):
        inner_steps(model, optimizer, data.train_x, data.train_y, args.inner_steps, batch, generator)
        loss, _ = evaluate(model, data.train_x, data.train_y)
        print(f"step {step * args.inner_steps:5d} (= outer step {step:3d})  loss {loss:.4f}")
    loss, _ = evaluate(model, data.train_x, data.train_y)
    test_loss, accuracy = evaluate(model, data.test_x, data.test_y)
    print(f"single process, AdamW, {args.outer_steps * args.inner_steps} steps of batch {batch}: "
          f"train loss {loss:.4f}, test loss {test_loss:.4f}, test accuracy {accuracy:.4f}")


# ---------------------------------------------------------------------------------------
# The launcher: a master and peers on loopback, one killed, one joining

def narrate(worlds: dict[int, int]) -> Callable[[Peer, dict[str, Any]], None]:
    """Print what a peer's record says (each outer step once); note each step's world.
    A process is named by its launch label until it joined, then by its peer id."""
    waits: set[int] = set()

    def on_record(peer: Peer, record: dict[str, Any]) -> None:
        event = record["event"]
        if event == "loading":
            say(peer.name, "importing torch and loading the data (a few seconds)")
        elif event == "joined":
            say(peer.name, f"joined the run as peer {record['peer']}")
        elif event == "synced":
            say(peer.who, f"received {record['rx']} bytes of shared state: the outer model "
                          f"and momentum at outer step {record['step']}")
        elif event == "waiting" and record["step"] not in waits:
            waits.add(record["step"])
            say("run", f"at outer step {record['step']} the run has {record['world']} of "
                       f"{record['wanted']} peers: waiting for the others to join")
        elif event == "step" and record["step"] not in worlds:
            worlds[record["step"]] = record["world"]
            say("run", f"outer step {record['step']:>3}  peers {record['peers']}  "
                       f"loss {record['loss']:.4f}  (inner loss {record['inner_loss']:.4f})")
        elif event == "aborted":
            say(peer.who, f"all-reduce of outer step {record['step'] + 1} aborted, "
                          f"again after a sync: {record['reason']}")
        elif event == "stalled":
            say(peer.who, f"stops after outer step {record['step']} (it is about to be killed)")
        elif event in ("error", "retry"):
            say(peer.who, json.dumps(record))

    return on_record


async def launch(args: argparse.Namespace) -> int:
    env = demo_environment()
    master, address = await start_master(env)

    shared = [
        "--outer-steps", str(args.outer_steps), "--inner-steps", str(args.inner_steps),
        "--batch", str(args.batch), "--seed", str(args.seed), "--hidden", str(args.hidden),
        "--inner-lr", str(args.inner_lr), "--outer-lr", str(args.outer_lr),
        "--outer-momentum", str(args.outer_momentum),
        "--world", str(args.world), "--hold-at", str(args.hold_at),
        *(["--quantize"] if args.quantize else []),
        *(["--compress", f"topk:{args.compress}"] if args.compress is not None else []),
        *(["--value-bits", str(args.value_bits)] if args.value_bits is not None else []),
    ]
    worlds: dict[int, int] = {}
    churn = args.kill_at > 0  # kill proc-1 after --kill-at, then add a joiner
    peers: list[Peer] = []
    try:
        with trio.fail_after(args.timeout):
            peers = await run_churn(
                lambda index, extra: [sys.executable, __file__, "--peer", address, *shared,
                                      *extra],
                env, world=args.world, kill_at=args.kill_at, on_record=narrate(worlds),
            )
        finished = [r for p in peers if (r := p.last("finished")) is not None]
        digests = {str(r["digest"]) for r in finished}
        for peer in peers:
            record = peer.last("finished")
            if record is not None:
                say(peer.who, f"finished at outer step {record['step']}: train loss "
                               f"{record['loss']:.4f}, test loss {record['test_loss']:.4f}, test "
                               f"accuracy {record['test_accuracy']:.4f}, outer parameters and "
                               f"momentum sha256 {str(record['digest'])[:16]}")
        first_step = next((r for p in peers for r in p.records if r["event"] == "step"), None)
        identical = len(finished) == len(peers) - churn and len(digests) == 1
        say("launch", "every peer holds bit-identical outer parameters and momentum"
            if identical else "FAILED: the peers did not end bit-identical")
        result = {
            "identical": identical, "peers": len(finished), "killed": churn,
            "joiner_finished": any(p.name == "joiner" for p in peers if p.last("finished")),
            "first_loss": None if first_step is None else first_step["loss"],
            "final_loss": finished[0]["loss"] if finished else None,
            "test_loss": finished[0]["test_loss"] if finished else None,
            "test_accuracy": finished[0]["test_accuracy"] if finished else None,
            "worlds": [worlds[step] for step in sorted(worlds)],
            # Payload bytes one peer sent per outer step of three peers (median).
            "tx_bytes_per_step": statistics.median(
                r["tx"] for p in peers for r in p.records
                if r["event"] == "step" and r["world"] == 3 and r["tx"]
            ) if any(r["event"] == "step" and r["world"] == 3 and r["tx"]
                     for p in peers for r in p.records) else None,
        }
        print("RESULT " + json.dumps(result), flush=True)
        return 0 if identical else 1
    finally:
        await end(peers, master)


# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="DiLoCo on pccl_trio: with no mode flag, a whole demo on loopback "
                    "(a master, peers, one killed, one joining), ending with a RESULT line "
                    "(docs/diloco.md).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--peer", metavar="HOST:PORT", help="run one peer of the run at this master")
    mode.add_argument("--single", action="store_true",
                      help="train the same model with plain AdamW in one process, for comparison")
    parser.add_argument("--outer-steps", type=int, default=30,
                        help="outer steps of the run, T (default %(default)s)")
    parser.add_argument("--inner-steps", type=int, default=20,
                        help="AdamW steps per outer step, H (default %(default)s)")
    parser.add_argument("--batch", type=int, default=32,
                        help="samples per inner step and peer (default %(default)s)")
    parser.add_argument("--world", type=int, default=3,
                        help="peers the demo starts; a peer waits for this many before outer "
                             "step 0; --single takes batches of world x batch (default %(default)s)")
    parser.add_argument("--quantize", action="store_true",
                        help="all-reduce the pseudo-gradient as uint8 (min-max); with "
                             "--compress, the kept values")
    parser.add_argument("--compress", type=parse_compress, default=None, metavar="topk:F",
                        help="all-reduce the pseudo-gradient Top-k sparse with error "
                             "feedback, keeping the fraction F of its entries (e.g. topk:0.01)")
    parser.add_argument("--value-bits", type=int, choices=[2, 4], default=None,
                        help="with --compress and --quantize: the kept values' codes in 2 or "
                             "4 bits instead of 8")
    parser.add_argument("--seed", type=int, default=0,
                        help="data split, model init and batches (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=64,
                        help="hidden units of the MLP (default %(default)s)")
    parser.add_argument("--inner-lr", type=float, default=1e-3,
                        help="AdamW learning rate (default %(default)s)")
    parser.add_argument("--outer-lr", type=float, default=None,
                        help="outer SGD learning rate (default 0.7; with --compress 4.0)")
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="outer SGD's Nesterov momentum, 0 for none (default 0.9; with "
                             "--compress 0: the residual carries it)")
    add_churn_flags(parser, timeout=300.0)
    args = parser.parse_args(argv)
    sparse = args.compress is not None
    if args.value_bits is not None and not (sparse and args.quantize):
        parser.error("--value-bits needs --compress and --quantize")
    if args.outer_lr is None:
        args.outer_lr = 4.0 if sparse else 0.7
    if args.outer_momentum is None:
        args.outer_momentum = 0.0 if sparse else 0.9
    if not 0 <= args.outer_momentum < 1:
        parser.error(f"--outer-momentum must be in [0, 1), not {args.outer_momentum}")
    for name in ("outer_steps", "inner_steps", "batch", "world", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    churn_arguments(parser, args, churn=args.peer is None and not args.single)
    return args


def parse_compress(text: str) -> float:
    """``topk:F`` -> F, a fraction in (0, 1]."""
    kind, _, value = text.partition(":")
    try:
        fraction = float(value)
    except ValueError:
        fraction = math.nan
    if kind != "topk" or not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"expected topk:F with F in (0, 1], got {text!r}")
    return fraction


def main() -> None:
    args = parse_args()
    if args.peer is not None:
        trio.run(run_peer, args.peer, args)
    elif args.single:
        train_single(args)
    else:
        raise SystemExit(trio.run(launch, args))


if __name__ == "__main__":
    main()
