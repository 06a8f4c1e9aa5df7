"""The engine's p2p program (``mtds.pipe.exchange``) under NCCL's semantics (``lab.pipe_sim.nccl_sim``),
without processes: every schedule the engine runs finishes (p ∈ {2,3,4}, v ∈ {1,2,3}, several m, training
and evaluation, lazy and eager communicators) and costs no time beyond the transfers, the order before
the fix deadlocks, and the simulator's rules on small hand-made programs."""
import pytest

from mtds.pipe.exchange import (ACT, GRAD, POLICIES, Compute, Message, Post, Transfer, colour, exchange_program,
                                group_names)
from lab.pipe_sim.nccl_sim import MismatchedTransfer, NcclDeadlock, simulate_programs, simulate_schedule_nccl
from mtds.pipe.schedules import SCHEDULES, Action, forward_actions, schedule_actions
from lab.pipe_sim.simulate import simulate_schedule
from tests.test_pipe_schedules import supported

GRID = [(name, p, v, m) for name in SCHEDULES for p in (2, 3, 4) for v in (1, 2, 3)
        for m in sorted({1, p, 2 * p, 2 * p + 1, 3 * p + 1, 4 * p}) if supported(name, p, v, m)]


def test_grid_covers_every_engine_schedule():
    assert {(name, v) for name, _, v, _ in GRID} == {("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)}
    assert {(p, m) for name, p, v, m in GRID if name == "interleaved" and v == 3} == \
        {(p, m) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p)}
    assert {m for name, p, v, m in GRID if name == "1f1b" and p == 3} == {1, 3, 6, 7, 10, 12}


@pytest.mark.parametrize("name,p,v,m", GRID)
def test_engine_program_finishes_under_nccl(name, p, v, m):
    for mode in ("lazy", "eager"):
        for forward_only in (False, True):
            for serial in (False, True):        # serial: CUDA_DEVICE_MAX_CONNECTIONS=1
                simulate_schedule_nccl(name, p, v, m, mode=mode, forward_only=forward_only, serial=serial)
    # NCCL's waits cost nothing beyond the transfers: while a transfer takes no longer than a forward,
    # the step ends exactly when it does with gloo's buffered sends (lab.pipe_sim.simulate)
    for comm in (0, 0.5, 1):
        assert simulate_schedule_nccl(name, p, v, m, comm=comm).step_time == simulate_schedule(name, p, v, m, comm=comm).step_time
    # and no send is held back: with free transfers every send starts the moment its compute ends
    assert simulate_schedule_nccl(name, p, v, m).send_delay == [0] * p


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 3)])
def test_evaluation_order_for_any_micro_batch_count_finishes(p, v):
    # the engine evaluates chunk by chunk where the schedule cannot take m (forward_actions' fallback)
    for name in SCHEDULES:
        for m in (1, p - 1, p + 1, 3 * p + 1):
            simulate_schedule_nccl(name, p, v, m, forward_only=True)


@pytest.mark.parametrize("name,p,v,m", GRID)
def test_program_streams_are_one_way_and_sends_leave_at_once(name, p, v, m):
    for rank in range(p):
        actions = schedule_actions(name, p, v, m, rank)
        program = exchange_program(actions, p=p, v=v, rank=rank)
        before = exchange_program(actions, p=p, v=v, rank=rank, policy="two-groups")
        assert [i.action for i in program if isinstance(i, Compute)] == actions
        posts = [t for i in program if isinstance(i, Post) for t in i.transfers]
        assert all(isinstance(i, Compute) or (not i.batched and len(i.transfers) == 1) for i in program)
        ends = {}
        for t in posts:   # on each group this rank only sends, to one peer, or only receives, from one
            ends.setdefault(t.group, set()).add((t.op, t.peer))
        assert all(len(e) == 1 for e in ends.values()), (rank, ends)
        assert set(ends) <= set(group_names(p, v))
        for kind in (ACT, GRAD):   # the same transfers in the same order as before the fix, per kind and op
            for op in ("send", "recv"):
                assert [t.message for t in posts if t.message.kind == kind and t.op == op] == \
                    [t.message for i in before if isinstance(i, Post) for t in i.transfers
                     if t.message.kind == kind and t.op == op]
        for k, item in enumerate(program):
            if isinstance(item, Compute) and item.makes is not None:   # its send is the very next item
                assert program[k + 1].transfers[0].message == item.makes, (rank, item)
        assert _most_receives_in_flight(program) <= 2


def _most_receives_in_flight(program):
    held, most = {ACT: 0, GRAD: 0}, 0
    for item in program:
        if isinstance(item, Post):
            held[item.transfers[0].message.kind] += item.transfers[0].op == "recv"
        elif item.needs is not None:
            held[item.needs.kind] -= 1
        most = max(most, *held.values())
    return most


def test_colours_and_groups():
    for p in range(2, 9):   # ring neighbours differ, so no rank sends and receives on one group
        assert all(colour(r, p) != colour((r + 1) % p, p) for r in range(p))
    assert group_names(2, 1) == ["act0", "grad1"]
    assert group_names(2, 2) == ["act0", "act1", "grad0", "grad1"]
    assert group_names(3, 2) == ["act0", "act1", "act2", "grad0", "grad1", "grad2"]
    assert group_names(4, 3) == ["act0", "act1", "grad0", "grad1"]
    assert group_names(4, 3, policy="two-groups") == [ACT, GRAD]


def test_order_before_the_fix_deadlocks_under_nccl():
    # activations on one group, gradients on another, each receive right before its compute: interleaved
    # p = 2 posts two crossing sends on the activation group (rank 0 its micro-batch 1, rank 1 stage 1's
    # micro-batch 0)
    with pytest.raises(NcclDeadlock) as err:
        simulate_schedule_nccl("interleaved", 2, 2, 4, policy="two-groups")
    message = str(err.value)
    assert "rank 0 at [send act(stage 0, micro 1) to rank 1 on act]: no matching post started" in message
    assert "rank 1 at [send act(stage 1, micro 0) to rank 0 on act]: no matching post started" in message
    assert "\n" not in message
    failing = {g for g in GRID if _deadlocks(g, mode="lazy")}
    assert {g for g in GRID if g[0] == "interleaved" and g[1] == 2} == failing   # the pair that crosses
    # with every op of a group on one stream (a group made with a device_id): interleaved at every p
    eager = {g for g in GRID if _deadlocks(g, mode="eager")}
    assert eager == {g for g in GRID if g[0] == "interleaved"}


def _deadlocks(g, **kwargs):
    try:
        simulate_schedule_nccl(*g, policy="two-groups", **kwargs)
        return False
    except NcclDeadlock:
        return True


# -- the simulator's rules, on hand-made programs ----------------------------------------------------------
A0, A1 = Message(ACT, 0, 0), Message(ACT, 1, 0)   # rank 0's output for rank 1, rank 1's for rank 0 (p = 2, v = 2)
COSTS = {"F": 1, "B": 2, "W": 1}


def send(message, peer, group="g"):
    return Transfer("send", peer, message, group)


def recv(message, peer, group="g"):
    return Transfer("recv", peer, message, group)


def compute(chunk, needs=None, makes=None, kind="F", micro=0):
    return Compute(Action(kind, chunk, micro), needs, makes)


def crossing(batched):
    """Each rank computes and sends its output, then receives the other's, all on group g."""
    def program(rank, mine, theirs):
        posts = [Post((send(mine, 1 - rank),), batched), Post((recv(theirs, 1 - rank),), batched)]
        if batched:
            posts = [Post(posts[0].transfers + posts[1].transfers, True)]
        return [compute(0, makes=mine)] + posts + [compute(1, needs=theirs)]
    return [program(0, A0, A1), program(1, A1, A0)]


def test_crossing_sends_deadlock_unless_batched():
    with pytest.raises(NcclDeadlock, match=r"rank 0 at \[send act.*: no matching post started.*rank 1 at"):
        simulate_programs(crossing(batched=False), costs=COSTS)
    result = simulate_programs(crossing(batched=True), costs=COSTS, comm=3)
    assert result.step_time == 1 + 3 + 1 and result.compute_end == [5, 5]


def test_send_completes_when_its_receive_starts_and_holds_the_stream():
    # rank 1 posts its receive only after computes of 5: rank 0's send waits, and so does rank 0's next
    # post on the stream (a second send)
    a, b = Message(ACT, 0, 0), Message(ACT, 0, 1)
    rank0 = [compute(0, makes=a), Post((send(a, 1),)), compute(0, makes=b, micro=1), Post((send(b, 1),))]
    rank1 = [compute(0, kind="B"), compute(0, kind="B", micro=1),
             Post((recv(a, 0),)), compute(1, needs=a), Post((recv(b, 0),)), compute(1, needs=b, micro=1)]
    result = simulate_programs([rank0, rank1], costs=dict(COSTS, B=2.5), comm=1)
    assert result.send_delay == [5 + 1 - 2, 0]     # the second send starts when the first completes (t = 6)
    assert result.compute_end == [2, 9]            # recv a 5..6, F 6..7, recv b 7..8 (waits for that F), F 8..9
    assert result.step_time == 9


def test_streams_per_mode():
    # lazy: a lone op to another peer runs on the pair's communicator, its own stream; eager: the group's
    a, c = Message(ACT, 0, 0), Message(ACT, 0, 1)
    rank0 = [compute(0, makes=a), Post((send(a, 1),)), compute(0, makes=c, micro=1), Post((send(c, 2),))]
    rank1 = [compute(0, kind="B"), Post((recv(a, 0),)), compute(1, needs=a)]
    rank2 = [Post((recv(c, 0),)), compute(1, needs=c, micro=1)]
    costs = dict(COSTS, B=10)
    assert simulate_programs([rank0, rank1, rank2], costs=costs).compute_end[2] == 2 + 1
    assert simulate_programs([rank0, rank1, rank2], costs=costs, mode="eager").compute_end[2] == 10 + 1
    # batched and lone transfers use different communicators under lazy init: they never match
    rank2[0] = Post(rank2[0].transfers, True)
    with pytest.raises(MismatchedTransfer, match="1 sends from rank 0 to rank 2 on g but 0 receives"):
        simulate_programs([rank0, rank1, rank2], costs=costs)


def test_lazy_communicators_created_in_opposite_orders_hang():
    # rank 0 receives a gradient (group h) before it sends an activation (group g); rank 1 uses g first:
    # under lazy initialisation each host waits in its first communicator's creation for the other
    g0 = Message(GRAD, 1, 0)
    rank0 = [Post((recv(g0, 1, "h"),)), compute(0, makes=A0), Post((send(A0, 1),)), compute(0, needs=g0, kind="B")]
    rank1 = [Post((recv(A0, 0),)), compute(1, needs=A0), compute(1, makes=g0, kind="B"), Post((send(g0, 0, "h"),))]
    with pytest.raises(NcclDeadlock, match="its host waits for the other ranks to create the communicator"):
        simulate_programs([rank0, rank1], costs=COSTS)
    assert simulate_programs([rank0, rank1], costs=COSTS, mode="eager").step_time == 1 + 1 + 2 + 2
    # the engine's program never moves a rank's first receive on a group ahead of its other first posts
    assert exchange_program(schedule_actions("1f1b", 2, 1, 1, 0), p=2, v=1, rank=0)[0] == \
        Compute(Action("F", 0, 0), None, Message(ACT, 0, 0))
    # a batch creates the group's communicator: every rank of the group must post on it
    lone = [[Post((send(A0, 1),), True), compute(0)], [Post((recv(A0, 0),), True), compute(0)], [compute(0)]]
    with pytest.raises(NcclDeadlock, match="create the communicator"):
        simulate_programs(lone, costs=COSTS)


def test_mismatched_order_is_reported():
    a, b = Message(ACT, 0, 0), Message(ACT, 0, 1)
    rank0 = [compute(0, makes=a), Post((send(a, 1),)), compute(0, makes=b, micro=1), Post((send(b, 1),))]
    rank1 = [Post((recv(b, 0),)), Post((recv(a, 0),)), compute(1, needs=a), compute(1, needs=b, micro=1)]
    with pytest.raises(MismatchedTransfer, match=r"rank 0 sends act\(stage 0, micro 0\) where rank 1 receives "
                                                 r"act\(stage 0, micro 1\) on g"):
        simulate_programs([rank0, rank1], costs=COSTS)


def test_policies_and_bad_arguments():
    assert POLICIES == ("one-way", "two-groups")
    with pytest.raises(ValueError, match="unknown p2p policy 'x'"):
        exchange_program([], p=2, v=1, rank=0, policy="x")
    with pytest.raises(ValueError, match="mode must be one of lazy, eager"):
        simulate_programs([], costs=COSTS, mode="x")
    with pytest.raises(ValueError, match="needs act.*which no earlier post receives"):
        simulate_programs([[compute(1, needs=A0)]], costs=COSTS)
    # forward_actions: the schedule's forwards, or chunk by chunk where the schedule cannot take m
    assert forward_actions("interleaved", 3, 2, 2, 0) == [Action("F", c, i) for i in range(2) for c in range(2)]
    assert forward_actions("1f1b", 2, 1, 2, 1) == [Action("F", 0, 0), Action("F", 0, 1)]


def test_one_hardware_queue_holds_later_kernels_behind_a_waiting_one():
    # CUDA_DEVICE_MAX_CONNECTIONS=1: rank 0's send z (group h) is issued after send y, which waits behind
    # send x on g's stream; x waits for rank 1's receive, posted after a compute that needs z. With
    # separate queues z leaves at once and everything finishes; with one queue z waits for y: a deadlock.
    x, y, z = Message(ACT, 0, 0), Message(ACT, 0, 1), Message(ACT, 0, 2)
    rank0 = [compute(0, makes=x), compute(0, makes=y, micro=1), compute(0, makes=z, micro=2),
             Post((send(x, 1),)), Post((send(y, 1),)), Post((send(z, 1, "h"),))]
    rank1 = [Post((recv(z, 0, "h"),)), compute(1, needs=z, micro=2), Post((recv(x, 0),)), Post((recv(y, 0),))]
    assert simulate_programs([rank0, rank1], costs=COSTS, mode="eager").step_time > 0
    with pytest.raises(NcclDeadlock, match="rank 1 at .recv act.stage 0, micro 2.*: no matching post started"):
        simulate_programs([rank0, rank1], costs=COSTS, mode="eager", serial=True)
