"""elastic_ddp.checkpoint.exchange: what one rank read reaches every rank, bitwise, once.

The one-process case runs here; the broadcasts run once as three gloo ranks (``_RANKS``, every
scenario in that one launch), and the tests below read what each rank received and sent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastic_ddp.checkpoint import exchange
from elastic_ddp.checkpoint.exchange import Transport, distribute
from elastic_ddp.checkpoint.index import Index, IndexFile
from elastic_ddp.checkpoint.layout import Piece
from elastic_ddp.checkpoint.staging import byte_view
from elastic_ddp.checkpoint.tree import TensorSpec
from tests.helpers.ranks import run_ranks

REPO = str(Path(__file__).resolve().parents[2])

# Shared with the ranks' script (it imports this module): the saved tensors and the files holding them.
SPECS = (
    TensorSpec(torch.float32, (33,)),
    TensorSpec(torch.bfloat16, (7, 3)),
    TensorSpec(torch.int64, (5,)),
    TensorSpec(torch.bool, (11,)),
    TensorSpec(torch.uint8, (13,)),
    TensorSpec(torch.float32, (0,)),  # empty: no piece in any file
    TensorSpec(torch.complex64, (4,)),
    TensorSpec(torch.float32, (exchange.DIRECT_BYTES // 4 + 3,)),  # broadcast straight into its destination
    TensorSpec(torch.int8, (3,)),
    TensorSpec(torch.float64, (4, 5)),  # cut between two files
)
LARGE = 7


def files_of(specs):
    return (
        ("f0", (Piece(0, 0, 33), Piece(1, 0, 21), Piece(2, 0, 5), Piece(3, 0, 11), Piece(9, 0, 8))),
        ("f1", (Piece(9, 8, 20), Piece(4, 0, 13), Piece(LARGE, 0, specs[LARGE].numel), Piece(8, 0, 3))),
        ("f2", (Piece(6, 0, 4),)),
    )


FILES = files_of(SPECS)
# For limits of a few hundred bytes (TINY_PACK, TINY_DIRECT): a large tensor of 16 slices, not 16,000.
TINY_PACK, TINY_DIRECT = 256, 128
TINY_SPECS = (*SPECS[:LARGE], TensorSpec(torch.float32, (1000,)), *SPECS[LARGE + 1 :])
TINY_FILES = files_of(TINY_SPECS)
# Hundreds of small tensors in one file.
MANY_SPECS = tuple(TensorSpec(torch.float32, (1 + i % 5,)) for i in range(300))
MANY_FILES = (("m0", tuple(Piece(i, 0, s.numel) for i, s in enumerate(MANY_SPECS))),)


def sources(specs=SPECS) -> list[torch.Tensor]:
    """The saved tensors: random bytes, the same in every process."""
    g = torch.Generator().manual_seed(11)
    out = []
    for spec in specs:
        t = torch.empty(spec.shape, dtype=spec.dtype)
        byte_view(t, 0, spec.numel).copy_(torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=g))
        out.append(t)
    return out


def index_of(files=FILES, specs=SPECS) -> Index:
    listed = []
    for k, (name, pieces) in enumerate(files):
        size = sum((p.stop - p.start) * specs[p.tensor].itemsize for p in pieces)
        listed.append(IndexFile(name, k, size, pieces))  # the writer is not who holds it at a load
    return Index(tuple(specs), {}, tuple(listed))


def file_bytes(pieces, tensors) -> torch.Tensor:
    """A data file as read: its pieces' bytes back to back."""
    return torch.cat([byte_view(tensors[p.tensor], p.start, p.stop) for p in pieces])


def destinations(wanted, specs=SPECS) -> dict[int, torch.Tensor]:
    """Destinations of the saved dtype and shape, every byte 0xA5: a byte that survives where nothing
    was copied (a random source holds it in places, never throughout)."""
    out = {}
    for t in wanted:
        d = torch.empty(specs[t].shape, dtype=specs[t].dtype)
        byte_view(d, 0, specs[t].numel).fill_(0xA5)
        out[t] = d
    return out


def wrong(dests, tensors) -> list[int]:
    """The destinations whose bytes are not their source's."""
    same = [torch.equal(byte_view(d, 0, d.numel()), byte_view(tensors[t], 0, d.numel())) for t, d in dests.items()]
    return [t for t, ok in zip(dests, same) if not ok]


# --- one process -----------------------------------------------------------------------------

LOCAL = Transport(torch.device("cpu"), None, lambda r: r, False)


def _no_broadcast(*args, **kwargs):
    raise AssertionError("one process must copy locally, not broadcast")


@pytest.mark.parametrize("small_constants", [False, True], ids=["default", "tiny-packs"])
def test_one_process_copies_every_wanted_byte_without_a_collective(monkeypatch, small_constants):
    monkeypatch.setattr(torch.distributed, "broadcast", _no_broadcast)
    specs, files = SPECS, FILES
    if small_constants:  # every path: slices of large pieces, packs cut at their limit
        monkeypatch.setattr(exchange, "PACK_BYTES", TINY_PACK)
        monkeypatch.setattr(exchange, "DIRECT_BYTES", TINY_DIRECT)
        specs, files = TINY_SPECS, TINY_FILES
    tensors = sources(specs)
    held = {name: file_bytes(pieces, tensors) for name, pieces in files}
    kept = {name: h.clone() for name, h in held.items()}
    dests = destinations(range(len(specs)), specs)
    moved = distribute(index_of(files, specs), {name: 0 for name, _ in files}, held, dests, 0, LOCAL)
    assert wrong(dests, tensors) == []
    assert moved == sum(s.nbytes for s in specs)
    assert all(torch.equal(held[name], kept[name]) for name in held)  # what was read is left as read


def test_one_process_fills_only_the_wanted_tensors():
    tensors = sources()
    held = {name: file_bytes(pieces, tensors) for name, pieces in FILES}
    wanted = (0, 3, LARGE, 9)
    dests = destinations(wanted)
    moved = distribute(index_of(), {name: 0 for name, _ in FILES}, held, dests, 0, LOCAL)
    assert wrong(dests, tensors) == [] and moved == sum(SPECS[t].nbytes for t in wanted)
    # A file with nothing wanted is neither needed nor looked up.
    assert distribute(index_of(), {"f0": 0}, {"f0": held["f0"]}, destinations([2]), 0, LOCAL) == SPECS[2].nbytes


def test_nothing_wanted_moves_nothing():
    assert distribute(index_of(), {}, {}, {}, 0, LOCAL) == 0


def test_a_holder_without_its_read_buffer_is_an_error_not_uninitialised_bytes_sent():
    tensors = sources()
    held = {name: file_bytes(pieces, tensors) for name, pieces in FILES}
    missing = FILES[0][0]
    del held[missing]
    with pytest.raises(RuntimeError, match=rf"Rank 0 is to send checkpoint file {missing}, but holds no read buffer"):
        distribute(index_of(), {name: 0 for name, _ in FILES}, held, destinations(range(len(SPECS))), 0, LOCAL)


# --- three ranks -----------------------------------------------------------------------------

_RANKS = """
import json, sys
sys.path.insert(0, sys.argv[3])  # the repository under test (and tests.unit.test_exchange)
import torch
import torch.distributed as dist
from elastic_ddp.checkpoint import exchange
from elastic_ddp.checkpoint.exchange import Transport, distribute
from tests.unit.test_exchange import (FILES, LARGE, MANY_FILES, MANY_SPECS, SPECS, TINY_DIRECT, TINY_FILES, TINY_PACK,
                                      TINY_SPECS, destinations, file_bytes, index_of, sources, wrong)

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3)
sends = []
real_broadcast = dist.broadcast
def recording(tensor, src, group=None, **kwargs):
    sends.append({"bytes": tensor.numel(), "ptr": tensor.data_ptr(), "src": src})
    return real_broadcast(tensor, src=src, group=group, **kwargs)
dist.broadcast = recording

def run(wanted, holders, transport, my_rank, files=FILES, specs=SPECS):
    tensors = sources(specs)
    held = {name: file_bytes(pieces, tensors) for name, pieces in files if holders[name] == my_rank}
    kept = {name: h.clone() for name, h in held.items()}
    dests = destinations(wanted, specs)
    sends.clear()
    moved = distribute(index_of(files, specs), holders, held, dests, my_rank, transport)
    spans = {f"held {name}": (h.data_ptr(), h.data_ptr() + h.numel()) for name, h in held.items()}
    spans.update({f"dest {t}": (d.data_ptr(), d.data_ptr() + d.nbytes) for t, d in dests.items() if d.numel()})
    return {
        "wrong": wrong(dests, tensors),
        "moved": moved,
        "wanted_bytes": sum(specs[t].nbytes for t in wanted),
        "sends": [s["bytes"] for s in sends],
        "srcs": [s["src"] for s in sends],
        # Where each send's buffer lies: in a destination, in what this rank read, or elsewhere (a pack).
        "into": [next((where for where, (lo, hi) in spans.items() if lo <= s["ptr"] < hi), "pack") for s in sends],
        "held_unchanged": all(torch.equal(held[n], kept[n]) for n in held),
    }

world = Transport(torch.device("cpu"), None, lambda r: r, True)
holders = {"f0": 1, "f1": 2, "f2": 0}
every = list(range(len(SPECS)))
out = {}
out["all"] = run(every, holders, world, rank)
out["some"] = run([0, 2, 4, LARGE, 9], holders, world, rank)

# Hundreds of small tensors in one file: packed, not one collective each.
out["many"] = run(range(len(MANY_SPECS)), {"m0": 1}, world, rank, MANY_FILES, MANY_SPECS)

# Limits of a few hundred bytes: large pieces in slices, packs cut where they would grow past the limit.
limits = exchange.PACK_BYTES, exchange.DIRECT_BYTES
exchange.PACK_BYTES, exchange.DIRECT_BYTES = TINY_PACK, TINY_DIRECT
out["tiny_packs"] = run(every, holders, world, rank, TINY_FILES, TINY_SPECS)
out["many_tiny_packs"] = run(range(len(MANY_SPECS)), {"m0": 1}, world, rank, MANY_FILES, MANY_SPECS)
exchange.PACK_BYTES, exchange.DIRECT_BYTES = limits

# A group that is not the default one: its ranks 0 and 1 are global ranks 1 and 2.
group = dist.new_group([1, 2], backend="gloo")
if rank in (1, 2):
    sub = Transport(torch.device("cpu"), group, lambda r: dist.get_global_rank(group, r), True)
    out["subgroup"] = run(every, {"f0": 1, "f1": 0, "f2": 1}, sub, rank - 1)

print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return [json.loads(r.stdout) for r in run_ranks(tmp_path_factory.mktemp("exchange"), _RANKS, 3, REPO)]


def test_every_rank_receives_every_tensor_bitwise_whoever_read_it(ranks):
    for rank, out in enumerate(ranks):
        assert out["all"]["wrong"] == [], rank
        assert out["all"]["moved"] == out["all"]["wanted_bytes"] == sum(s.nbytes for s in SPECS), rank
        assert out["all"]["held_unchanged"], rank


def test_each_wanted_byte_is_sent_once_in_packs_and_one_large_piece(ranks):
    sends = [out["all"]["sends"] for out in ranks]
    assert sends[0] == sends[1] == sends[2]  # the same collectives on every rank, in the same order
    assert sum(sends[0]) == sum(s.nbytes for s in SPECS)
    large = SPECS[LARGE].nbytes
    small = [(p.stop - p.start) * SPECS[p.tensor].itemsize for _, pieces in FILES for p in pieces]
    # f0 whole; f1's pieces before the large one, the large one, the piece after it; f2 whole.
    assert sends[0] == [sum(small[:5]), sum(small[5:7]), large, small[8], small[9]]
    assert [out["all"]["srcs"] for out in ranks] == [[1, 2, 2, 2, 0]] * 3


def test_a_large_piece_lands_in_its_destination_and_the_holder_sends_from_what_it_read(ranks):
    for rank, out in enumerate(ranks):
        into = out["all"]["into"]
        assert into[2] == f"dest {LARGE}", rank  # no staging copy, on receivers and holder alike
        held = {"f0": 1, "f1": 2, "f2": 0}
        for k, name in ((0, "f0"), (1, "f1"), (3, "f1"), (4, "f2")):
            assert into[k] == (f"held {name}" if held[name] == rank else "pack"), (rank, k)


def test_only_the_wanted_tensors_are_sent_and_filled(ranks):
    for rank, out in enumerate(ranks):
        some = out["some"]
        assert some["wrong"] == [] and some["moved"] == some["wanted_bytes"], rank
        assert sum(some["sends"]) == some["wanted_bytes"], rank
        assert some["sends"] == ranks[0]["some"]["sends"], rank


def test_hundreds_of_small_tensors_take_one_collective(ranks):
    for rank, out in enumerate(ranks):
        many = out["many"]
        assert many["wrong"] == [] and many["moved"] == many["wanted_bytes"], rank
        assert many["sends"] == [many["wanted_bytes"]], rank


@pytest.mark.parametrize("case", ["tiny_packs", "many_tiny_packs"])
def test_collectives_stay_within_the_pack_limit(ranks, case):
    for rank, out in enumerate(ranks):
        tiny = out[case]
        assert tiny["wrong"] == [] and tiny["moved"] == tiny["wanted_bytes"], rank
        assert sum(tiny["sends"]) == tiny["wanted_bytes"] and max(tiny["sends"]) <= TINY_PACK, rank
        assert tiny["sends"] == ranks[0][case]["sends"], rank
    sends = ranks[0][case]["sends"]
    if case == "tiny_packs":  # the large tensor in slices of the limit, straight into its destination
        slices = [n for n, into in zip(sends, ranks[0][case]["into"]) if into == f"dest {LARGE}"]
        assert slices == [TINY_PACK] * (TINY_SPECS[LARGE].nbytes // TINY_PACK) + [TINY_SPECS[LARGE].nbytes % TINY_PACK]
    else:  # packs as full as pieces allow: fewer than twice the minimum
        assert -(-sum(sends) // TINY_PACK) <= len(sends) < 2 * -(-sum(sends) // TINY_PACK)


def test_holders_are_ranks_of_the_transport_group_mapped_to_global_ranks(ranks):
    assert "subgroup" not in ranks[0]
    for rank in (1, 2):
        sub = ranks[rank]["subgroup"]
        assert sub["wrong"] == [] and sub["moved"] == sum(s.nbytes for s in SPECS), rank
        assert sub["srcs"] == [2, 1, 1, 1, 2], rank  # f0 and f2 from group rank 1 (global 2), f1 from global 1
