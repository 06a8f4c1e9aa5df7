"""ParallelLayout: validation messages, rank arithmetic identical to DeepSpeed's grid, real groups."""
import pytest
import torch
import torch.distributed as dist

from mtds.parallel.layout import LayoutError, ParallelLayout
from tests.dist import spawn


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=4), "world size 6 is not divisible by tp*pp = 4*1 = 4"),
    (dict(world_size=8, tp=2, pp=2, dp=3), "world size 8 != tp*pp*dp = 2*2*3 = 12"),
    (dict(world_size=4, tp=0), "tp and pp must be >= 1"),
    (dict(world_size=4, tp=1, pp=1, dp=4, vp=2), "virtual stages (vp=2) need pipeline parallelism"),
    (dict(world_size=6, tp=2, cp=2), "world size 6 is not divisible by tp*cp*pp = 2*2*1 = 4: launch a multiple of 4 "
                                     "ranks or change --tp/--cp/--pp"),
])
def test_bad_world_layouts_give_one_line_errors(kwargs, message):
    with pytest.raises(LayoutError) as err:
        ParallelLayout.for_world(**kwargs)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model, message", [
    (dict(num_heads=12, hidden_size=768, num_layers=4), "does not divide the 12 attention heads: choose --tp from 1, 2, 3, 4, 6, 12"),
    (dict(num_heads=16, kv_heads=2, hidden_size=1024, num_layers=4), "does not divide the 2 key/value heads"),
    (dict(num_heads=8, hidden_size=1024, num_layers=4, ffn_size=2732), "does not divide FFN size 2732"),
    (dict(num_heads=8, hidden_size=1024, num_layers=1), "1 layers cannot fill pp*vp = 2 pipeline stages"),
])
def test_model_checks(model, message):
    """The rulebook's shard rule (mtds.rules.layout) on the sizes a layout must divide."""
    from mtds import rules
    facts = rules.ModelFacts(**{"kv_heads": model["num_heads"], "ffn_size": 4 * model["hidden_size"], **model})
    tp, pp = (1, 2) if model["num_layers"] == 1 else (8 if "kv_heads" not in model else 4, 1)
    found = rules.problems(rules.Job(facts, tp * pp, tp=tp, pp=pp))
    assert [p.rule for p in found] == ["model-shards"] and message in found[0].message, found


def test_derives_data_parallel_size():
    assert ParallelLayout.for_world(8, tp=2, pp=2).dp == 2
    assert ParallelLayout.for_world(8, tp=1, pp=4).dp == 2
    assert ParallelLayout.for_world(1).world_size == 1


@pytest.mark.parametrize("tp, pp, dp", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 4, 1)])
def test_rank_order_matches_deepspeed_topology(tp, pp, dp):
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    topo = layout.topology()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        coord = topo.get_coord(rank)
        assert (c.tp_rank, c.dp_rank, c.pp_rank) == (coord.model, coord.data, coord.pipe)
    assert sorted(map(sorted, layout.tp_groups())) == sorted(map(sorted, topo.get_axis_comm_lists("model")))
    assert sorted(map(sorted, layout.dp_groups())) == sorted(map(sorted, topo.get_axis_comm_lists("data")))
    assert sorted(map(sorted, layout.pp_groups())) == sorted(map(sorted, topo.get_axis_comm_lists("pipe")))


@pytest.mark.parametrize("tp, cp, pp, dp", [(2, 2, 2, 1), (1, 4, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2)])
def test_context_parallel_ranks_sit_inside_deepspeeds_data_axis(tp, cp, pp, dp):
    """c ranks adjacent after TP; DeepSpeed's data coordinate is dp_rank * c + cp_rank, so its data axis is
    the d·c gradient replicas; every rank in exactly one group of each kind."""
    layout = ParallelLayout.for_world(tp * cp * pp * dp, tp=tp, pp=pp, cp=cp)
    assert layout.dp == dp and layout.dp_cp == dp * cp
    topo = layout.topology()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert rank == layout.rank_of(c.tp_rank, c.dp_rank, c.pp_rank, c.cp_rank)
        assert rank == ((c.pp_rank * dp + c.dp_rank) * cp + c.cp_rank) * tp + c.tp_rank
        coord = topo.get_coord(rank)
        assert (c.tp_rank, c.dp_rank * cp + c.cp_rank, c.pp_rank) == (coord.model, coord.data, coord.pipe)
    assert sorted(map(sorted, layout.dp_cp_groups())) == sorted(map(sorted, topo.get_axis_comm_lists("data")))
    for lists, size in ((layout.cp_groups(), cp), (layout.dp_groups(), dp), (layout.tp_groups(), tp)):
        assert sorted(r for g in lists for r in g) == list(range(layout.world_size))
        assert {len(g) for g in lists} == {size}
    # a cp group: same t, d, p coordinates, consecutive cp ranks tp apart
    for group in layout.cp_groups():
        assert [layout.coords(r).cp_rank for r in group] == list(range(cp))
        assert len({(layout.coords(r).tp_rank, layout.coords(r).dp_rank, layout.coords(r).pp_rank)
                    for r in group}) == 1


def _groups_worker():
    layout = ParallelLayout.for_world(dist.get_world_size(), tp=2, pp=2)
    groups = layout.build_groups()
    out = {}
    for name, group in (("tp", groups.tp_group), ("dp", groups.dp_group), ("pp", groups.pp_group)):
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=group)
        out[name] = x.item()
    out["mpu"] = (groups.get_model_parallel_world_size(), groups.get_data_parallel_world_size(),
                  groups.get_pipe_parallel_world_size(), groups.get_model_parallel_rank())
    try:
        ParallelLayout(tp=2, pp=1, dp=1).build_groups()
    except LayoutError as err:
        out["error"] = str(err)
    return out


def test_build_groups_on_eight_real_ranks():
    results = spawn(_groups_worker, 8, timeout=120)
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    for rank, out in enumerate(results):
        for name, lists in (("tp", layout.tp_groups()), ("dp", layout.dp_groups()), ("pp", layout.pp_groups())):
            members = next(g for g in lists if rank in g)
            assert out[name] == sum(members), (rank, name)
        assert out["mpu"] == (2, 2, 2, rank % 2)
        assert "launched 8 ranks but layout (tp=2, pp=1, dp=1) needs 2" in out["error"]
