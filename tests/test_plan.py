import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jtopoep.plan import Plan, check_plan, contiguous_placement, home_plan, rank_loads


def make(counts, guest_slots=1):
    counts = jnp.asarray(counts, jnp.int32)
    return home_plan(counts, contiguous_placement(counts.shape[0], counts.shape[1]), guest_slots)


@given(st.integers(0, 2**16), st.sampled_from([(4, 4), (4, 8), (8, 16)]), st.integers(0, 3))
def test_home_plan_is_valid(seed, shape, guest_slots):
    counts = np.random.default_rng(seed).integers(0, 100, size=shape).astype(np.int32)
    plan = make(counts, guest_slots)
    check_plan(plan, counts)
    loads = counts.sum(0).reshape(shape[0], -1).sum(1)
    assert np.array_equal(np.asarray(rank_loads(plan)), loads)


COUNTS = np.arange(32, dtype=np.int32).reshape(4, 8) % 5 + 1


def broken(mutate):
    plan = make(COUNTS, guest_slots=2)
    slot_expert, route = np.array(plan.slot_expert), np.array(plan.route)
    mutate(slot_expert, route)
    return Plan(slot_expert, route)


@pytest.mark.parametrize("mutate,message", [
    (lambda se, r: se.__setitem__((1, 2), 2), r"rank 1 holds expert 2 in more than one slot"),
    (lambda se, r: se.__setitem__((0, 3), 8), r"guest slot \(rank 0, slot 3\) holds expert id 8"),
    (lambda se, r: se.__setitem__((0, 3), -2), r"guest slot \(rank 0, slot 3\) holds expert id -2"),
    (lambda se, r: se.__setitem__((2, 0), 0), r"home slot \(rank 2, slot 0\) holds expert 0"),
    (lambda se, r: r.__setitem__((1, 2, 0), -1), r"route\[1, 2, 0\] = -1 is negative"),
    (lambda se, r: r.__setitem__((3, 1, 2), 4), r"route\[3, 1, 2\] = 4 sends pairs into an empty slot"),
    (lambda se, r: r.__setitem__((2, 3, 1), r[2, 3, 1] + 1), r"source 2 to expert 7 are not conserved"),
    (lambda se, r: r.__setitem__((0, 0, 0), 0), r"source 0 to expert 0 are not conserved"),
])
def test_check_plan_rejects(mutate, message):
    with pytest.raises(ValueError, match=message):
        check_plan(broken(mutate), COUNTS)


def test_guest_copy_conserves():
    def move(se, r):  # one pair of expert 0 from source 1 handled by a copy on rank 3
        se[3, 2] = 0
        r[1, 0, 0] -= 1
        r[1, 3, 2] += 1
    check_plan(broken(move), COUNTS)


def test_plan_fingerprint_changes_with_any_entry():
    import jax.numpy as jnp

    from jtopoep.plan import home_plan, plan_fingerprint

    counts = jnp.arange(8 * 16, dtype=jnp.int32).reshape(8, 16) % 5
    plan = home_plan(counts, jnp.arange(16, dtype=jnp.int32).reshape(8, 2), 2)
    base = int(plan_fingerprint(plan))
    assert base == int(plan_fingerprint(home_plan(counts, jnp.arange(16, dtype=jnp.int32).reshape(8, 2), 2)))
    moved = plan._replace(route=plan.route.at[0, 0, 0].add(-1).at[0, 1, 2].add(1))  # same totals, moved
    assert int(plan_fingerprint(moved)) != base
    copied = plan._replace(slot_expert=plan.slot_expert.at[3, 2].set(0))
    assert int(plan_fingerprint(copied)) != base
