"""lrattnres.ranks: the one grammar of a routing-key width r, as config.yaml, the stages' specs and a
conversion write it; and the rank of a model given none."""

from __future__ import annotations

import pytest

from lrattnres.config import ConfigError
from lrattnres.errors import SpecError
from lrattnres.ranks import resolve_rank


def test_integers_widths_and_fractions_of_the_width():
    assert resolve_rank(16, 64, where="x") == 16
    assert resolve_rank("d", 64, where="x") == 64
    assert resolve_rank("d/8", 1024, where="x") == 128


@pytest.mark.parametrize("bad, why", [("d/3", "divide"), ("d/0", "divide"), (0, "between 1"), (65, "between 1"),
                                      ("half", "not an integer"), ("d / 8", "not an integer"), ("128", "not an integer"),
                                      (2.5, "not an integer"), (True, "not an integer"), (None, "not an integer")])
def test_anything_else_is_refused_naming_where(bad, why):
    with pytest.raises(ValueError, match=why) as e:
        resolve_rank(bad, 64, where="grid.ranks[0]")
    assert str(e.value).startswith("grid.ranks[0]: rank ")


def test_k_is_the_joint_rank_only_where_a_conversion_gives_one():
    assert resolve_rank("k", 64, where="spec.rank", joint_rank=5) == 5
    assert resolve_rank("k", 64, where="spec.rank", joint_rank=0) == 1  # queries all zero: one coordinate kept
    with pytest.raises(ValueError, match="not an integer, 'd' or 'd/<k>'$"):
        resolve_rank("k", 64, where="grid.ranks[0]")


def test_the_error_is_the_callers():
    with pytest.raises(ConfigError):
        resolve_rank("d/3", 64, where="x", error=ConfigError)
    with pytest.raises(SpecError, match="'k' \\(the joint query rank\\)"):
        resolve_rank("e", 64, where="spec.rank", joint_rank=3, error=SpecError)


def test_a_model_given_no_rank():
    from lrattnres.model import DEFAULT_RANK, ModelConfig, model_config

    shape = dict(vocab_size=100, n_layers=2, d_model=32, n_heads=2, d_ff=88, max_seq_len=64, blocks=2)
    assert ModelConfig(**shape, method="attnres").rank == 32  # standard AttnRes: r = d
    assert model_config({**shape, "method": "attnres"}).rank == 32
    assert ModelConfig(**dict(shape, d_model=256, d_ff=704), method="lr").rank == DEFAULT_RANK == 128
    assert ModelConfig(**shape, method="baseline").rank == DEFAULT_RANK  # recorded, unused
    with pytest.raises(ValueError, match="r = d_model = 32"):
        ModelConfig(**shape, method="attnres", rank=16)
