"""The tile-load ring split of scripts/two_epilogues.py (the two-epilogue experiment): each pingpong
warpgroup keeps quack's running ring index, which skips the other warpgroup's tile, so its half of
the ring must see every slot used with alternating phases, as a ring of its own would."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
_spec = importlib.util.spec_from_file_location(
    "two_epilogues", Path(__file__).resolve().parents[1] / "scripts" / "two_epilogues.py")
two_epilogues = importlib.util.module_from_spec(_spec)
sys.modules["two_epilogues"] = two_epilogues  # its dataclasses resolve their module by name
_spec.loader.exec_module(two_epilogues)


def _uses(subtiles: int, depth: int, warp_group: int, tiles: int = 6) -> list[tuple[int, int]]:
    """(slot, phase) of each load of one warpgroup's tiles, from quack's running index: warpgroup 1
    starts one tile in, and each warpgroup skips the other's tile after its own."""
    index = warp_group * subtiles
    uses = []
    for _ in range(tiles):
        for i in range(index, index + subtiles):
            uses.append((i % depth, (i // depth) % 2))
        index += 2 * subtiles
    return uses


@pytest.mark.parametrize("subtiles", [2, 4, 6, 8, 12, 16, 24])
@pytest.mark.parametrize("at_most", [1, 2, 3, 4, 5])
def test_ring_depth_gives_each_warp_group_a_ring_of_its_own(subtiles, at_most):
    depth = two_epilogues.ring_depth(subtiles, at_most)
    assert 1 <= depth <= at_most and subtiles % depth == 0
    for wg in (0, 1):
        uses = _uses(subtiles, depth, wg)
        own = [(k % depth, (k // depth) % 2) for k in range(len(uses))]  # a ring used by this warpgroup alone
        assert uses == own


def test_ring_depth_is_the_deepest_even_split():
    assert [two_epilogues.ring_depth(s, 4) for s in (8, 12, 16, 6, 2)] == [4, 3, 4, 3, 1]
    assert two_epilogues.ring_depth(8, 2) == 2
    # no even split of an odd subtile count: that kernel keeps quack's turn-taking
    assert two_epilogues.ring_depth(3, 4) == 0 and two_epilogues.ring_depth(1, 4) == 0
