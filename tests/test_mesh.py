"""Mesh declaration: parsing, validation, coordinates and intra/inter-node links."""
from __future__ import annotations

import pytest

from autopar import Mesh, PlanError


def test_string_and_keyword_forms_agree():
    assert Mesh.parse("dp=2,tp=4") == Mesh(dp=2, tp=4)
    assert Mesh.parse("dp=2,tp=4").names == ("dp", "tp")
    assert Mesh(dp=2, tp=4).world_size == 8


def test_coordinates_are_row_major_outermost_first():
    mesh = Mesh(dp=2, tp=4)
    assert [mesh.coordinate(r, "tp") for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [mesh.coordinate(r, "dp") for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_links_follow_the_node_size():
    mesh = Mesh.parse("dp=4,tp=8;node=8")
    assert mesh.link("tp") == "intra" and mesh.link("dp") == "inter"
    assert Mesh(dp=2, tp=2, ranks_per_node=4).link("dp") == "intra"
    assert Mesh(dp=2, tp=2, ranks_per_node=2).link("dp") == "inter"


@pytest.mark.parametrize("bad, words", [
    ("dp=0", "positive integer"),
    ("dp=2,dp=2", "declared twice"),
    ("dp:2", "name=size"),
    ("", "at least one axis"),
])
def test_bad_mesh_strings_are_refused(bad, words):
    with pytest.raises(PlanError, match=words):
        Mesh.parse(bad)


def test_world_size_mismatch_is_refused():
    with pytest.raises(PlanError, match="world size 3"):
        Mesh(dp=2, tp=2).check_world_size(3)


def test_unknown_axis_names_the_axis_and_the_mesh():
    with pytest.raises(PlanError, match=r"unknown mesh axis 'pp'.*\['dp', 'tp'\]"):
        Mesh(dp=2, tp=2).require_axis("pp")


def test_node_size_fills_in_but_never_overrides_a_declared_one():
    assert Mesh.parse(Mesh(dp=2, tp=2), ranks_per_node=2).link("dp") == "inter"
    assert Mesh.parse("dp=2,tp=2;node=4", ranks_per_node=2).link("dp") == "intra"


def test_a_gradient_partial_over_several_axes_is_reduced_once_per_link():
    # all inside one node: one key over both axes, in mesh order, whatever order they come in
    mesh = Mesh(dp=2, cp=2, tp=2)
    assert mesh.sync_keys(("cp", "dp")) == ("dp+cp",)
    assert mesh.sync_keys(("tp", "cp", "dp")) == ("dp+cp+tp",)
    assert mesh.sync_keys(("dp",)) == ("dp",)
    # dp crosses nodes, cp does not: the node-local reduction first, the two kept apart
    across = Mesh(dp=2, cp=2, tp=2, ranks_per_node=4)
    assert across.sync_keys(("dp", "cp", "tp")) == ("cp+tp", "dp")
    # a pipeline sub-group stays its own step, last; an axis of one rank joins nothing
    assert mesh.sync_keys(("dp", "pp@0,1")) == ("dp", "pp@0,1")
    assert Mesh(dp=1, cp=2).sync_keys(("dp", "cp")) == ("cp",)


def test_a_key_over_several_axes_is_their_flattened_group():
    mesh = Mesh(dp=2, cp=2, tp=2, ranks_per_node=4)
    assert mesh.group_size("dp+cp") == 4 and mesh.group_size("cp+tp") == 4
    # rank 5 = (dp 1, cp 0, tp 1): its dp × cp group varies dp and cp, keeps tp
    assert (1, 3, 5, 7) in mesh.group_slices("dp+cp")
    assert mesh.group_slices("cp+tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert mesh.group_slices("dp+cp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    # a sub-group of an axis: the ranks at those coordinates, for each coordinate of the others
    assert Mesh(pp=4, dp=2).group_slices("pp@0,3") == [(0, 6), (1, 7)]
    assert mesh.link("cp+tp") == "intra" and mesh.link("dp+cp") == "inter"
