"""`planner.balance.split_layers`: the shared uneven-stage split (planner and pipeline executor)."""

import itertools

import pytest

from meshrun.errors import ConfigError
from meshrun.planner.balance import split_layers, stage_cost


def _brute(n, p, **kw):
    """The smallest possible slowest-stage cost over every split of n layers into p stages (>= 1 each)."""
    best = None
    for cut in itertools.combinations(range(1, n), p - 1):
        split = [b - a for a, b in zip((0, *cut), (*cut, n))]
        worst = max(stage_cost(tuple(split), **kw))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("n,p", [(8, 4), (10, 4), (7, 3), (13, 5), (5, 5), (9, 1)])
@pytest.mark.parametrize("first,last", [(0.0, 0.0), (0.5, 2.5), (3.0, 0.2)])
def test_split_is_optimal(n, p, first, last):
    kw = dict(layer_cost=1.0, first_cost=first, last_cost=last)
    split = split_layers(n, p, **kw)
    assert len(split) == p and sum(split) == n and min(split) >= 1
    assert max(stage_cost(split, **kw)) == pytest.approx(_brute(n, p, **kw))


def test_even_and_head_heavy_splits():
    assert split_layers(8, 4, layer_cost=1.0) == (2, 2, 2, 2)
    assert split_layers(10, 4, layer_cost=1.0) == (3, 3, 2, 2)
    # A vocabulary head worth ~2 layers moves two layers off the last stage.
    assert split_layers(10, 4, layer_cost=1.0, first_cost=0.1, last_cost=2.0) == (3, 3, 3, 1)
    assert split_layers(3, 3, layer_cost=1.0, last_cost=9.0) == (1, 1, 1)


@pytest.mark.parametrize("n,p,kw", [(3, 4, {}), (4, 0, {}), (4, 2, {"layer_cost": 0.0}), (4, 2, {"last_cost": -1.0})])
def test_bad_input(n, p, kw):
    with pytest.raises(ConfigError):
        split_layers(n, p, **{"layer_cost": 1.0, **kw})


def test_balanced_split_of_a_model():
    """Costs from the planner's time model: Megatron's 530B (105 layers) over 32 stages; the head and
    the vocabulary cross-entropy cost a fraction of a layer, so the first and last stages get the fewest."""
    from meshrun.config import load_config
    from meshrun.planner.balance import balanced_split, stage_costs

    model = load_config("configs/models/megatron-530b.yaml").model
    layer, first, last = stage_costs(model, 2048, tensor=8)
    assert 0 < first < last < layer
    split = balanced_split(model, 32, 2048, tensor=8)
    assert sum(split) == 105 and min(split) == 3 and max(split) == 4
    assert split[0] == split[-1] == 3
