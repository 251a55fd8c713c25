"""The CPU symmetric heap (docs/moonep.md §4.1) at R = 2 in one spawn: alias mappings of the same physical
chunks see the same bytes (own chunk, a peer's chunk, pieces of two segments side by side, typed
and strided views), alloc is zero-initialised and checked across ranks, destroy() unmaps every
view, is idempotent, and any use afterwards raises.

Each rank records failures as strings and keeps making the same collective calls; the parent
reports them per check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moonep import Buffer, BufferConfig, BufferOptions
from moonep.heap import Piece, create_heap, strided_view, view

PAGE = 4096


def _pattern(rank: int, nbytes: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def _mapped(addr: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= addr < hi:
            return True
    return False


def _outcome(fn) -> tuple[str | None, str]:
    try:
        fn()
    except Exception as exc:  # the parent checks type and message
        return type(exc).__name__, str(exc)
    return None, ""


def _heap_rank(rank: int, world: int) -> dict:
    fails: dict[str, list[str]] = {}

    def check(name: str, cond: bool, msg: str) -> None:
        fails.setdefault(name, [])
        if not cond:
            fails[name].append(f"rank {rank}: {msg}")

    peer = 1 - rank
    heap = create_heap(dist.group.WORLD, torch.device("cpu"), timeout_s=30)
    out: dict = {}
    check("granularity", heap.granularity == PAGE, f"granularity {heap.granularity}")
    a = heap.alloc("a", 2 * PAGE)
    b = heap.alloc("b", PAGE)
    every_a = heap.map([Piece(a, r, 0, 2 * PAGE) for r in range(world)])  # [R, 2 pages]
    mixed = heap.map([Piece(a, rank, PAGE, PAGE), Piece(b, rank, 0, PAGE)])  # own a[page 1], own b
    peer_a = heap.map([Piece(a, peer, 0, 2 * PAGE)])
    peer_b = heap.map([Piece(b, peer, 0, PAGE)])
    maps = [every_a, mixed, peer_a, peer_b]
    check("zero-initialised", all(bool((m.bytes_u8 == 0).all()) for m in maps), "fresh segments are not zero")
    heap.barrier("test:checked zero")  # before any rank writes into chunks its peer is reading

    # write own chunks through one view, read them through every alias
    own = every_a.bytes_u8[rank * 2 * PAGE:(rank + 1) * 2 * PAGE]
    own.copy_(_pattern(rank, 2 * PAGE))
    mixed.bytes_u8[PAGE:].copy_(_pattern(rank, PAGE, salt=1))  # own b, through the mixed view
    heap.barrier("test:written")
    check("alias", torch.equal(mixed.bytes_u8[:PAGE], _pattern(rank, 2 * PAGE)[PAGE:]),
          "own a page 1 differs between the all-ranks view and the mixed view")
    check("alias", torch.equal(every_a.bytes_u8[peer * 2 * PAGE:(peer + 1) * 2 * PAGE], _pattern(peer, 2 * PAGE)),
          "peer's a differs in the all-ranks view")
    check("alias", torch.equal(peer_a.bytes_u8, _pattern(peer, 2 * PAGE)), "peer's a differs in its own mapping")
    check("alias", torch.equal(peer_b.bytes_u8, _pattern(peer, PAGE, salt=1)), "peer's b (written via mixed) differs")
    # typed views: a float32 write through the strided [R, ...] view is seen by the peer's mappings
    rows = strided_view(every_a, PAGE, 2 * PAGE, world, (4, 8), torch.float32)  # page 1 of every rank's a
    heap.barrier("test:read")
    rows[peer].copy_(torch.arange(32, dtype=torch.float32).view(4, 8) + 100 * rank)  # write into the PEER
    heap.barrier("test:written2")
    mine_typed = view(mixed, 0, (4, 8), torch.float32)  # own a page 1 again
    want = torch.arange(32, dtype=torch.float32).view(4, 8) + 100 * peer
    check("alias", torch.equal(mine_typed, want), f"the peer's write is not visible: {mine_typed[0].tolist()}")
    check("alias", torch.equal(rows[rank], want), "strided view of own rows differs")
    heap.barrier("test:read2")

    # bad input at the heap level
    out["alloc not a multiple of the granularity"] = _outcome(lambda: heap.alloc("bad", PAGE + 100))
    out["map piece not aligned"] = _outcome(lambda: heap.map([Piece(a, rank, 100, PAGE)]))
    out["alloc differs across ranks"] = _outcome(lambda: heap.alloc("c", PAGE * (1 + rank)))

    # destroy: unmaps every view, idempotent, any later use raises
    addrs = [m.addr for m in maps]
    check("destroy unmaps", all(_mapped(x) for x in addrs), "a view is not mapped before destroy")
    heap.destroy()
    check("destroy unmaps", not any(_mapped(x) for x in addrs), "a view is still mapped after destroy")
    out["destroy twice"] = _outcome(heap.destroy)
    out["alloc after destroy"] = _outcome(lambda: heap.alloc("late", PAGE))
    out["map after destroy"] = _outcome(lambda: heap.map([Piece(b, rank, 0, PAGE)]))
    out["barrier after destroy"] = _outcome(lambda: heap.barrier("late"))

    # the Buffer on top: destroy twice is fine, a call afterwards raises
    buf = Buffer(BufferConfig(max_tokens=4, hidden=8, topk=1, num_experts=2, options=BufferOptions(timeout_s=30)))
    buf.destroy()
    out["buffer destroy twice"] = _outcome(buf.destroy)
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    out["buffer dispatch after destroy"] = _outcome(lambda: buf.dispatch(x, None, torch.zeros(4, 1, dtype=torch.int32)))
    out["buffer combine after destroy"] = _outcome(lambda: buf.combine(None, x))
    out["failures"] = fails
    return out


@pytest.fixture(scope="module")
def heap_results() -> list[dict]:
    from tests.dist_utils import run_ranks

    return run_ranks(_heap_rank, 2, timeout_s=120)


@pytest.mark.parametrize("check", ["granularity", "zero-initialised", "alias", "destroy unmaps"])
def test_heap_views(heap_results: list[dict], check: str) -> None:
    for rank, o in enumerate(heap_results):
        assert check in o["failures"], f"rank {rank} never ran {check!r}"
        assert not o["failures"][check], "\n".join(o["failures"][check])


@pytest.mark.parametrize(("case", "kind", "match"), [
    ("alloc not a multiple of the granularity", "ValueError",
     r"symmetric segment 'bad' of 4196 bytes is not a positive multiple of the 4096-byte mapping granularity"),
    ("map piece not aligned", "ValueError", r"piece of segment 'a' \(offset 100, 4096 bytes\) is not aligned"),
    ("alloc differs across ranks", "ValueError", r"symmetric alloc differs across ranks: \[\('c', 4096\), \('c', 8192\)\]"),
    ("destroy twice", None, r""),
    ("alloc after destroy", "RuntimeError", r"moonep symmetric heap used after destroy\(\) \(in alloc\(late\)\)"),
    ("map after destroy", "RuntimeError", r"used after destroy\(\) \(in map\)"),
    ("barrier after destroy", "RuntimeError", r"used after destroy\(\) \(in late\)"),
    ("buffer destroy twice", None, r""),
    ("buffer dispatch after destroy", "RuntimeError", r"moonep Buffer used after destroy\(\) \(in dispatch\)"),
    ("buffer combine after destroy", "RuntimeError", r"moonep Buffer used after destroy\(\) \(in combine\)"),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_heap_errors(heap_results: list[dict], rank: int, case: str, kind: str | None, match: str) -> None:
    got_kind, msg = heap_results[rank][case]
    assert got_kind == kind, f"{case}: {got_kind}: {msg}"
    if kind is not None:
        exc_type = {"ValueError": ValueError, "RuntimeError": RuntimeError}[kind]
        with pytest.raises(exc_type, match=match):
            raise exc_type(msg)
