"""Protocol timers and limits, in one frozen record.

Async calls take no ``timeout=`` arguments: protocol timers live here, and callers
bound their own work with ``trio.fail_after`` / ``trio.move_on_after``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal

from ._core.channel import check_secret
from ._core.identity import IDENTITY_SIZE
from ._core.messages import MAX_POOL_SIZE, MAX_TIMER
from ._errors import InvalidArgument

__all__ = ["SECRET_ENVIRONMENT", "Config"]

#: The environment variable the master CLI and ``Communicator`` read the run secret from
#: when none is given otherwise.
SECRET_ENVIRONMENT = "PCCL_TRIO_RUN_SECRET"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Timers and limits shared by the master and the peers.

    The master's ``heartbeat_interval`` and ``liveness_timeout`` win: a peer adopts the
    values the master sends when it registers, so both ends judge silence alike.

    Attributes:
        heartbeat_interval: seconds between heartbeats on an otherwise quiet master link.
        liveness_timeout: a link that delivers nothing for this long is declared dead,
            and (at the master) its peer is removed from the run. A peer keeps
            heartbeating from a thread while its trainer blocks the event loop, so
            only a peer dead, stopped or cut off is removed, however long it computes.
        connect_timeout: bound on establishing one TCP connection (master or p2p).
        round_timeout: (master) a peer that has not reported on its p2p connections
            this long after an establishment round started is removed from the run.
        max_control_frame: largest control frame accepted, in bytes.
        max_data_frame: largest data frame accepted, in bytes.
        establish_attempts: how many failed p2p establishment rounds ``update_topology``
            rides out internally before raising ``UpdateTopologyFailed``.
        p2p_connection_pool_size: TCP connections per ring neighbour when the
            communicator is asked for "a good default" (0). 0 here too (the default):
            each pool sized to its path, from the round trip its first connection's
            handshake took (one connection on a LAN, up to 16 over a long fat link:
            ``peer/_p2p.py``); 1 to 1024: exactly that many.
        slice_bytes: payload of one all-reduce data frame (and the span of one
            quantized block); a slice is forwarded as soon as it arrived. Each frame
            costs the data path a fixed amount of work, so smaller slices cost more
            per byte, and GPU buffers lose the most (``docs/gpu.md``); the default of
            4 MiB was chosen by measurement (``docs/benchmarks.md``, "Slice size"). The
            same on every peer: the master rejects an all-reduce whose members differ.
        bucket_bytes: (peers) ``all_reduce_multiple_with_retry`` fuses tensors smaller
            than this, of one dtype, into buckets of up to this many bytes, each reduced
            as one all-reduce (``docs/allreduce.md``, "Fusion"); 0: no fusion, one
            all-reduce per tensor. Every peer of a group must use the same value (its
            buckets must match the others'). The default was chosen by
            ``benchmarks/steps.py`` (``docs/benchmarks.md``).
        threaded_data_path: drive TCP data connections from worker threads blocking
            in the kernel (they release the GIL, as numpy's kernels do), which keeps
            every direction of every connection moving while others reduce; False
            keeps them in trio tasks. Streams without a socket of their own (the
            in-memory network) always use trio tasks.
        topology_solve_seconds: (master) time budget of an optimization's first ring
            search; groups up to ``topology.EXACT_LIMIT`` peers are solved exactly, and
            faster.
        topology_search_seconds: (master) time budget of the background search that
            follows a first ring not provably optimal (0: none).
        topology_reference_bytes: (master) the all-reduce size rings are optimized and
            their time predicted for; it weighs latency against bandwidth.
        run_secret: the credential shared by the master and every peer of one run
            (``bytes``, or a ``str`` taken as its UTF-8 bytes; at least 16 bytes, e.g.
            32 random bytes as hex). With it, every connection starts with a mutual
            handshake and its frames are authenticated (see ``docs/security.md``).
            ``Communicator`` falls back to ``$PCCL_TRIO_RUN_SECRET``. Never shown in
            ``repr``.
        data_protection: with a run secret, ``"mac"`` tags every data frame (the
            payload still goes zero-copy) and ``"encrypt"`` encrypts payloads too, at
            one copy per frame; control frames are always encrypted.
        insecure: without a run secret, listen on every interface and connect to
            masters on other hosts anyway (unauthenticated); without it, a run with no
            secret stays on loopback.
        stall_timeout: (master) a vote (an all-reduce, ``are_peers_pending``,
            ``update_topology``, ``sync_shared_state``, ``optimize_topology``) that some
            members have not joined this long after its first voter is refused for its
            voters, with an error naming each missing peer and the call it waits in
            (``inf``: wait forever). Calls the master can prove will never complete fail
            at once; this bounds the rest. 30 minutes: trainers may compute for many
            minutes between two collective calls, and peers of unequal speed reach a
            call minutes apart, so a shorter bound would fail healthy runs; the
            warnings below name the culprits much sooner.
        stall_warning: (master) a vote waiting this long for members is logged, naming
            them and what each waits in; again after twice as long, four times, ...
        shared_state_min_rate: bytes per second a shared-state distributor must deliver
            to a fetching peer, on average after ``shared_state_grace``; a slower one
            is dropped and its pieces go to the other distributors (the sync fails when
            none is left). 64 KiB/s, far below any link training runs on, even shared by
            dozens of distributors, yet a distributor trickling bytes to hold the sync
            forever is cut after a bounded time. 0 turns the check off.
        shared_state_grace: seconds a distributor is given before its rate counts, on
            top of the time one data frame takes at the minimum rate: it covers
            connecting, the distributor waiting for its own plan (up to the liveness
            timeout) and the first bytes.
        master_grace: (peers) seconds a member keeps trying to get its master back
            after losing it (the same address, then the next of several): meanwhile
            calls wait, and a collective in flight is aborted with its input restored;
            a master restarted (or a standby) takes it back as the member it was. 0:
            losing the master ends the communicator at once. A minute: long enough to
            restart a master by hand or by a supervisor, short enough that a run whose
            master is gone for good says so.
        identity: the file of this node's Ed25519 identity key (created there, mode
            0600, on first use; ``pccl-trio identity`` prints its public half). Every
            handshake proves it; the master binds it to the peer's id and names it to
            the peers that connect to this one, who check it. Needs a run secret.
            Several peers on one node may share one key.
        allowed_identities: (master) the public identity keys (32 bytes each) allowed
            to join; a peer without one of them is refused with a reason. None: any
            holder of the run secret. Needs a run secret.
        master_identities: (peers) the public identity keys a master of this run may
            prove (the master started with ``--identity``, or a standby's); a master
            proving none of them is not talked to (``MasterConnectionError``, or the
            next address). None: any holder of the run secret. Needs a run secret.
        content_digest: (master) make shared-state syncs compare content by a
            cryptographic digest as well as by the 32-bit simplehash, which anyone can
            forge offline: the master tells every peer when it registers, each peer then
            votes a BLAKE2b-256 digest of every tensor whose content must match, a peer
            voting without is kicked, two tensors with equal simplehashes but different
            digests count as different content, and a fetched tensor must match the
            popular digest too (else the fetch fails like a hash mismatch and the old
            state is kept). It costs one BLAKE2b pass over every compared tensor per sync
            at every peer, roughly 1 GB/s per core (in a worker thread, beside the
            simplehash; a GPU tensor is copied to host memory for it, one piece at a
            time), plus 32 bytes per tensor in each vote.
        discovery_timeout: (peer) how long ``Communicator(discover=RUN)`` looks for a
            master advertising the run over mDNS before ``connect()`` fails with
            ``MasterConnectionError``; a browse usually finds it within a fraction of a
            second, then listens half a second more for other masters of the run.
        election_timeout: (peers with ``host_master=True``) how long a candidate waits
            for each candidate ranked before it to answer as the run's master before it
            hosts the master itself (the first candidate hosts at once); also how long
            candidates look for each other before the first election. Longer than the
            time candidates take to notice a lost master apart (a heartbeat interval,
            or the liveness timeout for a silent one) plus a connection.
        leases: (peers) ask the master for a lease on each tag that succeeds, so that
            the group's next all-reduces of that tag with the same descriptor run
            without the master (no vote, no verdict: the members agree among
            themselves; ``docs/allreduce.md``, "Leases"). A lease is granted only when
            every member asks. False: every all-reduce goes through the master.
        congestion_control: (peers) the TCP congestion control of this peer's
            connections (Linux's ``TCP_CONGESTION``: ``"cubic"``, ``"bbr"``, ...); None
            (the default): the system's (``net.ipv4.tcp_congestion_control``). It
            matters over long links: BBR without the ``fq`` qdisc paces the bursts of
            an all-reduce that moves a few MiB per step slowly after each pause (on
            the WAN emulator, 100 ms RTT, 1 Gbit/s: a 1 MiB all-reduce takes 0.44 s
            with BBR, 0.32 s with CUBIC), while BBR rides out random loss that CUBIC
            slows down for (``docs/benchmarks.md``, "Over long fat links"). A name the
            kernel does not offer, or does not let this process choose (without
            ``CAP_NET_ADMIN``, those in ``net.ipv4.tcp_allowed_congestion_control``),
            makes ``Communicator`` raise ``InvalidArgument`` saying which. Applies to
            the TCP network the communicator makes itself (``network=None``).
        metrics: (peers) Prometheus metrics of this peer's calls (all-reduces by
            outcome with durations and bytes, restores, retries, syncs, master
            reconnects; ``docs/observability.md``): None, off; a ``prometheus_client``
            ``CollectorRegistry`` to register them in; or ``"HOST:PORT"`` to serve them
            at ``http://HOST:PORT/metrics`` while connected (port 0: any free port).
            Needs the ``observability`` extra.
    """

    heartbeat_interval: float = 0.5
    liveness_timeout: float = 3.0
    connect_timeout: float = 5.0
    round_timeout: float = 30.0
    max_control_frame: int = 1 << 20
    max_data_frame: int = (64 << 20) + 64
    establish_attempts: int = 5
    p2p_connection_pool_size: int = 0
    slice_bytes: int = 4 << 20
    bucket_bytes: int = 25 << 20
    threaded_data_path: bool = True
    topology_solve_seconds: float = 1.0
    topology_search_seconds: float = 60.0
    topology_reference_bytes: int = 64 << 20
    run_secret: bytes | str | None = dataclasses.field(default=None, repr=False)
    data_protection: Literal["mac", "encrypt"] = "mac"
    insecure: bool = False
    stall_timeout: float = 1800.0
    stall_warning: float = 60.0
    shared_state_min_rate: float = 64 * 1024
    shared_state_grace: float = 30.0
    master_grace: float = 60.0
    identity: str | os.PathLike[str] | None = None
    allowed_identities: frozenset[bytes] | None = None
    master_identities: frozenset[bytes] | None = None
    content_digest: bool = False
    discovery_timeout: float = 10.0
    election_timeout: float = 2.0
    leases: bool = True
    congestion_control: str | None = None
    metrics: Any = None

    @property
    def secret(self) -> bytes | None:
        """``run_secret`` as bytes (None without one)."""
        if isinstance(self.run_secret, str):
            return self.run_secret.encode()
        return self.run_secret

    def with_environment_secret(self) -> Config:
        """This config, with ``$PCCL_TRIO_RUN_SECRET`` as its run secret if it has none
        and the variable is set (and not empty)."""
        if self.run_secret is not None or not os.environ.get(SECRET_ENVIRONMENT):
            return self
        try:
            return dataclasses.replace(self, run_secret=os.environ[SECRET_ENVIRONMENT])
        except InvalidArgument as exc:
            raise InvalidArgument(f"${SECRET_ENVIRONMENT}: {exc}") from None

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_interval", "liveness_timeout", "connect_timeout", "round_timeout",
            "discovery_timeout", "election_timeout",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidArgument(f"Config.{name} must be a positive number of seconds, got {value!r}")
        check_metrics(self.metrics)
        if self.heartbeat_interval >= self.liveness_timeout:
            raise InvalidArgument(
                "Config.heartbeat_interval must be shorter than Config.liveness_timeout "
                f"({self.heartbeat_interval} >= {self.liveness_timeout}); otherwise a healthy, "
                "quiet link would be declared dead"
            )
        if self.liveness_timeout > MAX_TIMER:
            raise InvalidArgument(
                f"Config.liveness_timeout must be at most {MAX_TIMER}s, got "
                f"{self.liveness_timeout}; peers refuse longer timers from a master"
            )
        for name in ("topology_solve_seconds", "topology_search_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidArgument(
                    f"Config.{name} must be a non-negative number of seconds, got {value!r}"
                )
        if self.topology_solve_seconds == 0:
            raise InvalidArgument("Config.topology_solve_seconds must be positive")
        for name in (
            "max_control_frame", "max_data_frame", "establish_attempts", "slice_bytes",
            "topology_reference_bytes",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise InvalidArgument(f"Config.{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.p2p_connection_pool_size, int)
                and not isinstance(self.p2p_connection_pool_size, bool)
                and 0 <= self.p2p_connection_pool_size <= MAX_POOL_SIZE):
            raise InvalidArgument(
                f"Config.p2p_connection_pool_size must be an integer from 0 (sized to each "
                f"path) to {MAX_POOL_SIZE}, got {self.p2p_connection_pool_size!r}"
            )
        if not (isinstance(self.bucket_bytes, int) and not isinstance(self.bucket_bytes, bool)
                and self.bucket_bytes >= 0):
            raise InvalidArgument(
                "Config.bucket_bytes must be a non-negative integer (0: no fusion), got "
                f"{self.bucket_bytes!r}"
            )
        if self.slice_bytes + 64 > self.max_data_frame:
            raise InvalidArgument("Config.slice_bytes must fit in Config.max_data_frame")
        if self.congestion_control is not None and not (
            isinstance(self.congestion_control, str) and self.congestion_control.isascii()
            and 0 < len(self.congestion_control) < 16
        ):
            raise InvalidArgument(
                "Config.congestion_control must be None (the system's) or the name of a TCP "
                f"congestion control, 1 to 15 letters such as 'cubic', got {self.congestion_control!r}"
            )
        if self.run_secret is not None:
            if not isinstance(self.run_secret, bytes | str):
                raise InvalidArgument(
                    f"Config.run_secret must be bytes or str, got {type(self.run_secret).__name__}"
                )
            try:
                check_secret(self.secret or b"")
            except ValueError as exc:  # the channel's own check, which the core raises
                raise InvalidArgument(str(exc)) from None
        if self.data_protection not in ("mac", "encrypt"):
            raise InvalidArgument(
                f"Config.data_protection must be 'mac' or 'encrypt', got {self.data_protection!r}"
            )
        for name in ("insecure", "content_digest", "leases"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.master_grace, int | float) and math.isfinite(self.master_grace)
                and self.master_grace >= 0):
            raise InvalidArgument(
                "Config.master_grace must be a non-negative number of seconds (0: no "
                f"recovery), got {self.master_grace!r}"
            )
        if self.identity is not None and not isinstance(self.identity, str | os.PathLike):
            raise InvalidArgument(f"Config.identity must be a path, got {self.identity!r}")
        for name in ("allowed_identities", "master_identities"):
            keys = getattr(self, name)
            if keys is None:
                continue
            keys = frozenset(keys)
            bad = [key for key in keys if not (isinstance(key, bytes) and len(key) == IDENTITY_SIZE)]
            if bad:
                raise InvalidArgument(
                    f"Config.{name} must hold {IDENTITY_SIZE}-byte public keys, got {bad[0]!r}"
                )
            object.__setattr__(self, name, keys)
        for name in ("stall_timeout", "stall_warning"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not math.isnan(value) and value > 0):
                raise InvalidArgument(
                    f"Config.{name} must be a positive number of seconds (inf: never), "
                    f"got {value!r}"
                )
        if not (isinstance(self.shared_state_min_rate, int | float)
                and math.isfinite(self.shared_state_min_rate) and self.shared_state_min_rate >= 0):
            raise InvalidArgument(
                "Config.shared_state_min_rate must be a non-negative number of bytes per "
                f"second (0: no minimum), got {self.shared_state_min_rate!r}"
            )
        if not (isinstance(self.shared_state_grace, int | float)
                and math.isfinite(self.shared_state_grace) and self.shared_state_grace > 0):
            raise InvalidArgument(
                "Config.shared_state_grace must be a positive number of seconds, got "
                f"{self.shared_state_grace!r}"
            )


def read_run_secret(path: str | None) -> str | bytes | None:
    """The run secret from ``path`` (surrounding whitespace dropped) or, without one,
    from the environment; None if neither names one."""
    if path is None:
        return os.environ.get(SECRET_ENVIRONMENT) or None
    try:
        with open(path, "rb") as file:
            secret = file.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the run secret from {path}: {exc.strerror}") from None
    if not secret:
        raise ValueError(f"the secret file {path} is empty")
    return secret


def check_metrics(metrics: Any) -> None:
    """``Config.metrics`` is None, ``"HOST:PORT"`` or a registry.

    Raises:
        InvalidArgument: it is none of them.
    """
    if metrics is None or callable(getattr(metrics, "register", None)):
        return
    if isinstance(metrics, str):
        host, _, port = metrics.rpartition(":")
        if host and port.isdigit() and int(port) <= 65535:
            return
    raise InvalidArgument(
        "Config.metrics must be None, 'HOST:PORT' (serve them there) or a prometheus_client "
        f"CollectorRegistry (register them there), got {metrics!r}"
    )
