"""A character-level transformer language model trained with ``pccl_trio.torch.DiLoCo``:
peers die and join mid-run, and every peer ends with the same bits.

Run ``python examples/char_lm.py`` for the whole demo on this machine (a few minutes on
two cores): a master and three peers on loopback train the model on a text that ships
with Python; one peer is SIGKILLed mid-run, a new one joins later, the held-out loss of
every outer step is printed, and at the end every peer's shared state (outer
parameters and outer optimizer state) is checked to be bit-identical. ``--overlap``
lets each outer all-reduce run while the next round computes (applied a round late);
``--compress uint8`` or ``--compress topk:F`` shrinks what crosses the network.
``--peer HOST:PORT`` is one peer of a run: ``train``, the part to copy into a trainer
(``docs/diloco.md``, "A language model with the wrapper").

Theory of operation
-------------------
The text is the Python documentation's topics, which every CPython carries
(``pydoc_data.topics``, about 465,000 characters): no download. Its characters are the
tokens (the vocabulary: every character of the text, sorted); the last 5 % is held out.
The model is a small causal transformer: token and position embeddings, pre-norm
encoder layers under a causal mask, a linear head over the vocabulary.

Each peer draws its own windows of the training text (a generator seeded by ``--seed``
and ``--shard``), takes ``--inner-steps`` AdamW steps per round, and calls
``diloco.step()`` after each; every ``--inner-steps`` calls the peers average their
pseudo-gradients and take the outer step together (``pccl_trio.torch.DiLoCo``: Nesterov
SGD, lr 0.7, momentum 0.9). After each outer step the model holds the outer
parameters, the same on every peer, so the held-out loss it prints (fixed windows) is
the same on every peer too. A joiner receives the outer parameters, the outer
optimizer's state and the outer step count in its first boundary.

The demo's churn, decided by what the peers report and never by time: the victim
stops after outer step ``--kill-at`` (so that the others wait for it in an
all-reduce) and is SIGKILLed; the survivors go on without it; a joiner is started once
they took a step without it; at ``--hold-at`` every peer asks the wrapper to hold
until the run has ``--world`` peers again (``diloco.hold``), so that the joiner takes
part for certain.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
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

if TYPE_CHECKING:  # torch is imported where it is used: the launcher never needs it
    import torch
    from torch import nn

HELD_OUT = 0.05  # the share of the text held out for the printed loss
EVAL_WINDOWS = 32  # held-out windows the loss is measured on


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


# ---------------------------------------------------------------------------------------
# Data and model


class Text:
    """The text as token ids, split into training and held-out parts."""

    def __init__(self) -> None:
        import pydoc_data.topics

        import torch

        text = "\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
        self.vocabulary = sorted(set(text))
        index = {char: i for i, char in enumerate(self.vocabulary)}
        ids = torch.tensor([index[char] for char in text], dtype=torch.long)
        cut = int(len(ids) * (1 - HELD_OUT))
        self.train, self.held_out = ids[:cut], ids[cut:]

    def windows(self, ids: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[
        torch.Tensor, torch.Tensor
    ]:
        """Inputs and next-character targets of the windows starting at ``starts``."""
        import torch

        rows = starts[:, None] + torch.arange(context + 1)
        chunk = ids[rows]
        return chunk[:, :-1], chunk[:, 1:]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocabulary[i] for i in ids)


def make_model(vocabulary: int, args: argparse.Namespace) -> nn.Module:
    import torch
    from torch import nn

    class CharTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.context = args.context
            self.embed = nn.Embedding(vocabulary, args.width)
            self.position = nn.Embedding(args.context, args.width)
            layer = nn.TransformerEncoderLayer(
                args.width, args.heads, 4 * args.width, dropout=0.0, batch_first=True,
                norm_first=True,
            )
            self.layers = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(args.width)
            self.head = nn.Linear(args.width, vocabulary)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            length = ids.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(length)
            hidden = self.embed(ids) + self.position(torch.arange(length))
            return self.head(self.norm(self.layers(hidden, mask=mask, is_causal=True)))

    torch.manual_seed(args.seed)  # every peer starts from the same weights
    return CharTransformer()


def held_out_loss(model: nn.Module, text: Text, args: argparse.Namespace) -> float:
    """The loss on fixed held-out windows (the same on every peer holding the same
    parameters)."""
    import torch

    starts = torch.linspace(0, len(text.held_out) - args.context - 2, EVAL_WINDOWS).long()
    inputs, targets = text.windows(text.held_out, starts, args.context)
    with torch.no_grad():
        logits = model(inputs)
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def sample(model: nn.Module, text: Text, prompt: str, length: int) -> str:
    """Greedy continuation of ``prompt``: the same characters on every peer."""
    import torch

    ids = [text.vocabulary.index(char) for char in prompt]
    with torch.no_grad():
        for _ in range(length):
            window = torch.tensor([ids[-model.context:]])
            ids.append(int(model(window)[0, -1].argmax()))
    return text.decode(ids)


# ---------------------------------------------------------------------------------------
# One peer of a run: the part to copy


def compression(args: argparse.Namespace) -> Any:
    import pccl_trio as pccl

    if args.compress == "uint8":
        return pccl.QuantizationOptions()  # uint8, min-max
    if args.compress is not None:
        return pccl.TopK(args.compress)
    return None


def train(master: str, args: argparse.Namespace) -> None:
    import torch

    import pccl_trio as pccl
    import pccl_trio.sync
    import pccl_trio.torch

    torch.set_num_threads(1)  # several peers share this machine's cores
    emit(event="loading")
    text = Text()
    model = make_model(len(text.vocabulary), args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + args.shard)

    outer_optimizer = torch.optim.SGD(model.parameters(), lr=args.outer_lr,
                                      momentum=args.outer_momentum,
                                      nesterov=args.outer_momentum > 0)

    comm = pccl_trio.sync.Communicator(master, p2p_host="127.0.0.1")
    with pccl_trio.torch.DiLoCo(
        model, optimizer, communicator=comm, outer_optimizer=outer_optimizer,
        sync_every=args.inner_steps, overlap=args.overlap, compression=compression(args),
        min_peers=args.world,
    ) as diloco:
        emit(event="joined", peer=diloco.communicator.peer_id, step=diloco.outer_steps)
        held = False
        while diloco.outer_steps < args.outer_steps:
            starts = torch.randint(0, len(text.train) - args.context - 1, (args.batch,),
                                   generator=generator)
            inputs, targets = text.windows(text.train, starts, args.context)
            loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1),
                                                     targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            before = diloco.outer_steps
            diloco.step()  # every --inner-steps calls: the outer step, with every peer
            if diloco.outer_steps == before:
                continue
            comm = diloco.communicator  # a new one if this peer was kicked and came back
            world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
            emit(event="step", peer=comm.peer_id, step=diloco.outer_steps, world=world,
                 peers=sorted(comm.ring), inner_loss=round(loss.item(), 4),
                 loss=round(held_out_loss(model, text, args), 4))
            if diloco.outer_steps == args.stall_after:
                emit(event="stalled", peer=comm.peer_id, step=diloco.outer_steps)
                threading.Event().wait()  # the demo's victim: SIGKILLed here
            if diloco.outer_steps == args.hold_at and not held and world < args.world:
                held = True  # the demo's hold: every peer asks at this outer step
                emit(event="waiting", peer=comm.peer_id, step=diloco.outer_steps,
                     world=world, wanted=args.world)
                diloco.hold(args.world)  # until one joined: it is admitted here
        emit(event="finished", peer=diloco.communicator.peer_id, step=diloco.outer_steps,
             loss=round(held_out_loss(model, text, args), 4),
             digest=pccl.state_digest(diloco.shared_state),
             sample=sample(model, text, "The ", 60))


def run_peer(master: str, args: argparse.Namespace) -> None:
    import pccl_trio as pccl

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        train(master, args)
    except pccl.PCCLError as exc:
        emit(event="error", kind=type(exc).__name__, message=str(exc))


# ---------------------------------------------------------------------------------------
# The launcher: a master and peers on loopback, one killed, one joining


def narrate(worlds: dict[int, int]) -> Any:
    """Print what a peer's record says (each outer step once); note each step's world."""
    waits: set[int] = set()

    def on_record(peer: Peer, record: dict[str, Any]) -> None:
        event = record["event"]
        if event == "loading":
            say(peer.name, "importing torch and reading the text")
        elif event == "joined":
            say(peer.name, f"joined the run as peer {record['peer']} at outer step {record['step']}")
        elif event == "waiting" and record["step"] not in waits:
            waits.add(record["step"])
            say("run", f"at outer step {record['step']} the run has {record['world']} of "
                       f"{record['wanted']} peers: waiting for the joiner")
        elif event == "step" and record["step"] not in worlds:
            worlds[record["step"]] = record["world"]
            say("run", f"outer step {record['step']:>3}  peers {record['peers']}  held-out "
                       f"loss {record['loss']:.4f}  (inner loss {record['inner_loss']:.4f})")
        elif event == "stalled":
            say(peer.who, f"stops after outer step {record['step']} (it is about to be killed)")
        elif event == "error":
            say(peer.who, json.dumps(record))

    return on_record


async def launch(args: argparse.Namespace) -> int:
    env = demo_environment()
    master, address = await start_master(env)
    shared = [
        "--outer-steps", str(args.outer_steps), "--inner-steps", str(args.inner_steps),
        "--batch", str(args.batch), "--context", str(args.context), "--width", str(args.width),
        "--layers", str(args.layers), "--heads", str(args.heads), "--seed", str(args.seed),
        "--inner-lr", str(args.inner_lr), "--outer-lr", str(args.outer_lr),
        "--outer-momentum", str(args.outer_momentum), "--world", str(args.world),
        "--hold-at", str(args.hold_at),
        *(["--overlap"] if args.overlap else []),
        *(["--compress", args.compress_text] if args.compress is not None else []),
    ]
    worlds: dict[int, int] = {}
    churn = args.kill_at > 0
    peers: list[Peer] = []
    try:
        with trio.fail_after(args.timeout):
            peers = await run_churn(
                lambda index, extra: [sys.executable, __file__, "--peer", address,
                                      "--shard", str(index), *shared, *extra],
                env, world=args.world, kill_at=args.kill_at, on_record=narrate(worlds),
            )
        finished = [(p, r) for p in peers if (r := p.last("finished")) is not None]
        for peer, record in finished:
            say(peer.who, f"finished at outer step {record['step']}: held-out loss "
                          f"{record['loss']:.4f}, shared state {record['digest'][:16]}")
        digests = {record["digest"] for _, record in finished}
        identical = len(finished) == len(peers) - churn and len(digests) == 1
        if finished:
            say("sample", repr(finished[0][1]["sample"]))
        say("launch", "every peer holds bit-identical outer parameters and optimizer state"
            if identical else "FAILED: the peers did not end bit-identical")
        steps = [r for p in peers for r in p.records if r["event"] == "step"]
        result = {
            "identical": identical, "peers": len(finished), "killed": churn,
            "joiner_finished": any(p.name == "joiner" for p, _ in finished),
            "first_loss": steps[0]["loss"] if steps else None,
            "final_loss": finished[0][1]["loss"] if finished else None,
            "worlds": [worlds[step] for step in sorted(worlds)],
        }
        print("RESULT " + json.dumps(result), flush=True)
        return 0 if identical else 1
    finally:
        await end(peers, master)


# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A character-level transformer trained with pccl_trio.torch.DiLoCo: "
                    "with no --peer, a whole demo on loopback (a master, peers, one "
                    "killed, one joining), ending with a RESULT line (docs/diloco.md).")
    parser.add_argument("--peer", metavar="HOST:PORT", help="run one peer of the run at this master")
    parser.add_argument("--outer-steps", type=int, default=30,
                        help="outer steps of the run (default %(default)s)")
    parser.add_argument("--inner-steps", type=int, default=20,
                        help="AdamW steps per outer step (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16,
                        help="windows per inner step and peer (default %(default)s)")
    parser.add_argument("--context", type=int, default=64,
                        help="characters per window (default %(default)s)")
    parser.add_argument("--width", type=int, default=64,
                        help="the transformer's width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2,
                        help="transformer layers (default %(default)s)")
    parser.add_argument("--heads", type=int, default=4,
                        help="attention heads (default %(default)s)")
    parser.add_argument("--inner-lr", type=float, default=3e-3,
                        help="AdamW learning rate (default %(default)s)")
    parser.add_argument("--outer-lr", type=float, default=0.7,
                        help="the outer SGD's learning rate (default %(default)s)")
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="the outer SGD's Nesterov momentum, 0 for none (default 0.9; "
                             "with --overlap 0: a delayed update with 0.9 diverges)")
    parser.add_argument("--world", type=int, default=3,
                        help="peers the demo starts; the run waits for this many before outer "
                             "step 1 (default %(default)s)")
    parser.add_argument("--overlap", action="store_true",
                        help="each outer all-reduce runs while the next round computes, "
                             "applied one round late")
    parser.add_argument("--compress", default=None, metavar="uint8|topk:F",
                        help="the pseudo-gradient as uint8 (min-max), or Top-k sparse with "
                             "error feedback keeping the fraction F of its entries")
    parser.add_argument("--seed", type=int, default=0,
                        help="model init and batches (default %(default)s)")
    parser.add_argument("--shard", type=int, default=0,
                        help="which peer's batches: with --seed, seeds its generator")
    add_churn_flags(parser, timeout=600.0)
    args = parser.parse_args(argv)
    args.compress_text = args.compress
    if args.outer_momentum is None:
        args.outer_momentum = 0.0 if args.overlap else 0.9
    if not 0 <= args.outer_momentum < 1:
        parser.error(f"--outer-momentum must be in [0, 1), not {args.outer_momentum}")
    if args.compress not in (None, "uint8"):
        kind, _, value = args.compress.partition(":")
        try:
            fraction = float(value)
        except ValueError:
            fraction = math.nan
        if kind != "topk" or not 0 < fraction <= 1:
            parser.error(f"--compress: expected uint8 or topk:F with F in (0, 1], got "
                         f"{args.compress!r}")
        args.compress = fraction
    for name in ("outer_steps", "inner_steps", "batch", "context", "width", "layers", "heads",
                 "world"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.width % args.heads:
        parser.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    churn_arguments(parser, args, churn=args.peer is None)
    return args


def main() -> None:
    args = parse_args()
    if args.peer is not None:
        run_peer(args.peer, args)
    else:
        raise SystemExit(trio.run(launch, args))


if __name__ == "__main__":
    main()
