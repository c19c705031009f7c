"""KV block transfer between two real processes (pagedkv.distributed), per transport.

The pytest process is the reader (rank 0 for gloo, which also hosts the gloo store); a spawned
process is the holder. Both build their caches from the same seeds, so the reader knows the
holder's bytes without moving them any other way. Every spawned process is killed and joined
in a finally block; every wait has a timeout.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagedkv.distributed.kv_transport import (
    KVLayout,
    KVTransport,
    coalesce_runs,
    nixl_available,
    run_regions,
)
from pagedkv.distributed.transports import make_transport
from pagedkv.errors import ConfigError, InvalidBlockError, KVTransferError, PagedKVError

TIMEOUT = 20.0  # seconds; any single wait in this file


@dataclass(frozen=True)
class Spec:
    seed: int
    num_blocks: int = 64
    dtype: str = "float32"
    layers: int = 4
    block_size: int = 16
    heads: int = 2
    head_dim: int = 64


SPECS = [Spec(seed=1), Spec(seed=2, num_blocks=48, dtype="int8")]
# The reader's int8 pool is larger than the holder's: pools may differ in size, not in layout.
READER_SPECS = [Spec(seed=1), Spec(seed=2, num_blocks=64, dtype="int8")]


def make_cache(spec: Spec) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(spec.seed)
    shape = (spec.layers, 2, spec.num_blocks, spec.block_size, spec.heads, spec.head_dim)
    if spec.dtype == "int8":
        kv = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
        return kv, torch.rand(shape[:5], generator=g) + 0.01
    return torch.randn(shape, generator=g), None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def new_transport(kind: str, port: int | None, rank: int) -> KVTransport:
    if kind == "gloo":
        return make_transport("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=TIMEOUT)
    return make_transport("nixl", engine_id=f"test-{'reader' if rank == 0 else 'holder'}-{os.getpid()}")


def _holder(kind: str, ports: list[int | None], specs: list[Spec], conn: Any) -> None:
    """The holding engine: one transport per cache; publishes metadata, then serves until told."""
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    transports = []
    for port, spec in zip(ports, specs):
        t = new_transport(kind, port, rank=1)
        t.register_kv_cache(*make_cache(spec))
        # A holder serves only granted blocks (an engine grants a claimed lease's): all of them
        # to the reader here; the engine-level grant checks are in test_kv_transfer_security.py.
        t.allow_reads("gloo-rank0" if kind == "gloo" else f"test-reader-{os.getppid()}", "all", range(spec.num_blocks))
        transports.append(t)
        conn.send(t.local_metadata())
    # Serve until the reader says stop or goes away (EOF when the pytest process ends: no orphan).
    try:
        conn.recv()
    except EOFError:
        pass
    for t in transports:
        t.close()


@dataclass
class Pair:
    kind: str
    proc: Any
    readers: list[KVTransport]
    peers: list[str]
    metadata: list[bytes]
    conn: Any = None  # the holder serves while this pipe end is open
    caches: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None  # the readers' registered caches


def start_pair(kind: str, specs: list[Spec], reader_specs: list[Spec] | None = None) -> Pair:
    ports = [free_port() if kind == "gloo" else None for _ in specs]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(kind, ports, specs, child), daemon=True)
    proc.start()
    readers, metadata, caches = [], [], []
    try:
        for port, spec in zip(ports, reader_specs or specs):
            t = new_transport(kind, port, rank=0)  # gloo: blocks until the holder's rank joins
            readers.append(t)
            caches.append(make_cache(Spec(seed=spec.seed + 100, **_geometry(spec))))
            t.register_kv_cache(*caches[-1])
            if not parent.poll(TIMEOUT * 2):
                raise TimeoutError("holder did not publish its metadata")
            metadata.append(parent.recv())
        peers = [t.add_peer(m) for t, m in zip(readers, metadata)]
    except BaseException:
        stop_pair(Pair(kind, proc, readers, [], [], parent))
        raise
    return Pair(kind, proc, readers, peers, metadata, parent, caches)


def _geometry(spec: Spec) -> dict[str, Any]:
    return {k: v for k, v in spec.__dict__.items() if k != "seed"}


def stop_pair(pair: Pair) -> None:
    for t in pair.readers:
        t.close()
    if pair.conn is not None:
        pair.conn.close()
        pair.proc.join(timeout=5)
    if pair.proc.is_alive():
        pair.proc.kill()
    pair.proc.join(timeout=TIMEOUT)


KINDS = [
    "gloo",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")),
]


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    p = start_pair(request.param, SPECS, READER_SPECS)
    try:
        yield p
    finally:
        stop_pair(p)


@pytest.mark.parametrize("which", [0, 1], ids=["float32", "int8+scales"])
def test_pull_runs_and_scattered_blocks_is_exact(pair: Pair, which: int) -> None:
    spec = SPECS[which]
    reader, peer = pair.readers[which], pair.peers[which]
    assert pair.caches is not None
    kv, scale = pair.caches[which]
    before_kv, before_scale = kv.clone(), None if scale is None else scale.clone()
    remote_kv, remote_scale = make_cache(spec)
    # A run of 8, a run of 3 (into a reversed-ish target), scattered singles, the last block.
    remote = [*range(4, 12), 20, 21, 22, 40, 7, 33, spec.num_blocks - 1]
    local = [*range(30, 38), 2, 3, 4, 60, 0, 17, 50]
    assert len(coalesce_runs(remote, local)) == 6
    reader.wait(reader.read_blocks(peer, remote, local), timeout=TIMEOUT)
    for r, loc in zip(remote, local):
        assert torch.equal(kv[:, :, loc], remote_kv[:, :, r]), (r, loc)
        if scale is not None:
            assert remote_scale is not None and torch.equal(scale[:, :, loc], remote_scale[:, :, r])
    untouched = [b for b in range(kv.shape[2]) if b not in local]
    assert torch.equal(kv[:, :, untouched], before_kv[:, :, untouched])
    if scale is not None:
        assert before_scale is not None and torch.equal(scale[:, :, untouched], before_scale[:, :, untouched])
    # A second, overlapping read is independent of the first; done() polls it to completion.
    h = reader.read_blocks(peer, [0, 1], [30, 31])
    deadline = time.monotonic() + TIMEOUT
    while not reader.done(h):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert torch.equal(kv[:, :, 30:32], remote_kv[:, :, 0:2])


def test_out_of_range_ids_are_refused_before_any_transfer(pair: Pair) -> None:
    reader, peer = pair.readers[1], pair.peers[1]  # remote 48 blocks, local 64
    assert pair.caches is not None
    kv, _ = pair.caches[1]
    before = kv.clone()
    with pytest.raises(InvalidBlockError, match="remote block id 48 out of range"):
        reader.read_blocks(peer, [1, 48], [1, 2])
    with pytest.raises(InvalidBlockError, match="local block id -1"):
        reader.read_blocks(peer, [1], [-1])
    with pytest.raises(InvalidBlockError, match="duplicates"):
        reader.read_blocks(peer, [1, 2], [3, 3])
    with pytest.raises(PagedKVError, match="2 remote block ids but 1 local"):
        reader.read_blocks(peer, [1, 2], [3])
    assert torch.equal(kv, before)


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", 8), ("dtype", "float16"), ("num_kv_heads", 4), ("head_dim", 128), ("num_layers", 2)],
)
def test_layout_mismatch_is_refused_at_handshake(pair: Pair, field: str, value: Any) -> None:
    meta = json.loads(pair.metadata[0])
    meta["layout"][field] = value
    with pytest.raises(ConfigError, match=f"{field}: local .* != remote {value!r}"):
        pair.readers[0].add_peer(json.dumps(meta).encode())


def test_scale_presence_and_transport_kind_mismatch_are_refused(pair: Pair) -> None:
    with pytest.raises(ConfigError, match="scale_dtype"):
        pair.readers[0].add_peer(pair.metadata[1].replace(b'"num_blocks": 48', b'"num_blocks": 64'))
    other = b"gloo" if pair.kind == "nixl" else b"nixl"
    with pytest.raises(ConfigError, match="peer uses KV transport"):
        pair.readers[0].add_peer(pair.metadata[0].replace(f'"{pair.kind}"'.encode(), b'"' + other + b'"'))


@pytest.mark.parametrize("kind", KINDS)
def test_dead_peer_gives_a_clear_error_within_the_timeout(kind: str) -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    p = start_pair(kind, [Spec(seed=5)])
    try:
        reader, peer = p.readers[0], p.peers[0]
        # Freeze the holder so the request is pending, start a read of every block, then kill it.
        os.kill(p.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            h = reader.read_blocks(peer, list(range(64)), list(range(64)))
            os.kill(p.proc.pid, signal.SIGKILL)
            p.proc.join(timeout=TIMEOUT)
            if kind == "gloo":  # the holder never answered: the read must fail
                with pytest.raises(KVTransferError, match="failed|closed|reset|within"):
                    reader.wait(h, timeout=TIMEOUT)
            else:  # one-sided: NIXL may have finished before the kill; it must not hang
                try:
                    reader.wait(h, timeout=TIMEOUT)
                except KVTransferError:
                    pass
        except KVTransferError:
            pass
        assert time.monotonic() - t0 < TIMEOUT + 5
        # Once the peer is gone, a new read fails within the timeout too (at start or in wait).
        t0 = time.monotonic()
        with pytest.raises(KVTransferError):
            reader.wait(reader.read_blocks(peer, [0, 1], [2, 3]), timeout=TIMEOUT)
        assert time.monotonic() - t0 < TIMEOUT + 5
    finally:
        stop_pair(p)


def test_make_transport_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="unknown KV transport"):
        make_transport("tcp")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs rank"):
        make_transport("gloo")


def test_holder_side_range_check_catches_a_lying_peer(pair: Pair) -> None:
    # Metadata that claims more blocks than the holder has gets past the reader's check; the
    # holder (gloo) or NIXL (outside the registered memory) must still refuse, not copy garbage.
    reader = pair.readers[1]
    lying = pair.metadata[1].replace(b'"num_blocks": 48', b'"num_blocks": 64')
    peer = reader.add_peer(lying)
    try:
        with pytest.raises(KVTransferError):
            reader.wait(reader.read_blocks(peer, [63], [0]), timeout=TIMEOUT)
    finally:
        assert reader.add_peer(pair.metadata[1]) == peer
    h = reader.read_blocks(peer, [1], [1])
    reader.wait(h, timeout=TIMEOUT)


def test_gloo_hung_holder_times_out_and_its_late_reply_is_dropped() -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    p = start_pair("gloo", [Spec(seed=6)])
    try:
        assert p.caches is not None
        reader, peer, (kv, _) = p.readers[0], p.peers[0], p.caches[0]
        before = kv.clone()
        os.kill(p.proc.pid, signal.SIGSTOP)  # alive, sockets open, serving nothing
        h = reader.read_blocks(peer, [1, 2, 3], [10, 11, 12])
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="did not finish within 0.5s"):
            reader.wait(h, timeout=0.5)
        assert time.monotonic() - t0 < 3
        os.kill(p.proc.pid, signal.SIGCONT)  # now the holder answers the abandoned request...
        assert h.state["event"].wait(TIMEOUT)
        assert torch.equal(kv, before)  # ...and the reply is not written into the blocks
        reader.wait(reader.read_blocks(peer, [1], [10]), timeout=TIMEOUT)  # the pair still works
        assert torch.equal(kv[:, :, 10], make_cache(Spec(seed=6))[0][:, :, 1])
    finally:
        if p.proc.is_alive():
            os.kill(p.proc.pid, signal.SIGCONT)
        stop_pair(p)


def test_coalescing_and_regions_match_the_tensor_layout() -> None:
    assert coalesce_runs([5, 6, 7, 9, 10, 3], [0, 1, 2, 3, 4, 9]) == [(5, 0, 3), (9, 3, 2), (3, 9, 1)]
    assert coalesce_runs([1, 2], [4, 3]) == [(1, 4, 1), (2, 3, 1)]  # consecutive on one side only
    assert coalesce_runs([], []) == []
    kv, _ = make_cache(Spec(seed=3, num_blocks=10))
    layout = KVLayout.from_tensors(kv, None)
    regions = list(run_regions(kv.data_ptr(), layout.num_layers, layout.num_blocks, layout.block_bytes, 4, 3))
    expected = [(kv[lyr, k, 4:7].data_ptr(), kv[lyr, k, 4:7].nbytes) for lyr in range(kv.shape[0]) for k in range(2)]
    assert regions == expected
    kv8, scale = make_cache(Spec(seed=3, dtype="int8"))
    l8 = KVLayout.from_tensors(kv8, scale)
    assert l8.bytes_per_block == kv8[:, :, 0].nbytes + scale[:, :, 0].nbytes  # type: ignore[index]
