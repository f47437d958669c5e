"""Pieces every planner shares: loads and targets, spill and candidates, quotas.

Loads, spill and quotas are integer-only and written against an array namespace `xp` (jax.numpy
inside jit, numpy for the host planner), so the device and host versions of a planner agree bit for
bit. The rest of the shared machinery has its own module: pricing (the cost model's transfer clock),
routing (locality-tiered token routing), copies (the copy-placement loop state) and swaps
(load-neutral locality swaps).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jtopoep.costmodel import ExpertDims, copy_break_even_pairs
from jtopoep.ordering import descending_key, key_range, stable_order
from jtopoep.plan import Plan, home_plan
from jtopoep.planners.pricing import transfer_costs
from jtopoep.topology import Topology


@dataclasses.dataclass(frozen=True)
class PlannerBase:
    """Static settings shared by every planner. Subclasses implement `_plan(counts, placement, held)`.

    min_gain: a copy must save at least min_gain x the time of shipping its weights out and its
    gradients back (copy_break_even_pairs), ignoring any overlap; 0 turns the check off. It needs `dims`.
    """

    topology: Topology
    num_experts: int
    guest_slots: int
    min_gain: float = 0.0
    dims: ExpertDims | None = None
    # Refuse copies that expose more weight-transfer time than the GEMM time they save (cost model,
    # TransferClock). False balances load regardless of transfer cost. Needs dims to have an effect.
    price_transfers: bool = True
    # Share of the token-exchange time a copy saves (pricing.exchange_saving: the fall of the
    # largest scale-out receive, tracked as copies are made) that counts toward paying for its
    # weight transfer; 0 counts only the GEMM time saved. A quarter, not all of it: the tracked
    # receives only estimate the routing that follows, and where many ranks receive about as much
    # the whole saving overstates it (benchmarks.cluster's sensitivity tables chose the value).
    # Needs dims and price_transfers.
    exchange_credit: float = 0.25
    # Locality-tiered routing (topoep, taot) re-divides the pairs each expert sends across nodes
    # among its copies to level the ranks' scale-out receive (routing.level_receive), raising ranks
    # up to the busiest rank's load but not past it, so the GEMM term stays (capped at T* instead,
    # it barely levels anything). False keeps every slot at its quota.
    level_receive: bool = True

    def __post_init__(self):
        ranks = self.topology.num_ranks
        if self.num_experts < 1 or self.num_experts % ranks:
            raise ValueError(f"num_experts = {self.num_experts} must be a positive multiple of the "
                             f"{ranks} ranks of the topology")
        if self.guest_slots < 0:
            raise ValueError(f"guest_slots = {self.guest_slots} must be >= 0")
        if self.min_gain < 0:
            raise ValueError(f"min_gain = {self.min_gain} must be >= 0")
        if not self.exchange_credit >= 0:
            raise ValueError(f"exchange_credit = {self.exchange_credit} must be >= 0")
        if self.min_gain > 0 and self.dims is None:
            raise ValueError("min_gain > 0 needs dims (ExpertDims) to price a copy's weight transfer")

    @property
    def num_ranks(self) -> int:
        return self.topology.num_ranks

    def transfer_costs(self):
        """(link seconds [R, R], forward and forward+backward seconds per pair, credited scale-out
        exchange seconds per pair) for pricing copies."""
        link_s, pair_fwd_s, pair_s, pair_xchg_s = transfer_costs(self.topology, self.dims if self.price_transfers
                                                                 else None)
        return link_s, pair_fwd_s, pair_s, self.exchange_credit * pair_xchg_s

    @property
    def home_slots(self) -> int:
        return self.num_experts // self.num_ranks

    def gain_thresholds(self) -> tuple[float, float]:
        """Least pairs a copy must take over an (intra-node, inter-node) link to be worth making."""
        if self.min_gain == 0:
            return 0.0, 0.0
        intra, inter = copy_break_even_pairs(self.topology, self.dims)
        return self.min_gain * intra, self.min_gain * inter

    def __call__(self, counts, placement=None, held=None) -> Plan:
        """The plan for counts [R, E] with home experts placement [R, H] (default contiguous).

        held: [R, K] the guest experts each rank holds from the previous micro-batch of the same
        optimizer step (-1 empty; moe.keep_copies), which it can keep without a transfer. topoep
        puts a copy on a rank that holds it wherever that balances as well, taot charges such a copy
        only its gradients' transfer, eplb places copies without regard to it."""
        num_ranks, num_experts = counts.shape
        if (num_ranks, num_experts) != (self.num_ranks, self.num_experts):
            raise ValueError(f"counts has shape {counts.shape}; this planner expects "
                             f"({self.num_ranks}, {self.num_experts})")
        if held is not None and tuple(held.shape) != (self.num_ranks, self.guest_slots):
            raise ValueError(f"held has shape {tuple(held.shape)}; it must be [R, K] = "
                             f"({self.num_ranks}, {self.guest_slots}), the guest experts of each rank")
        if placement is None:
            placement = jnp.arange(num_experts, dtype=jnp.int32).reshape(num_ranks, self.home_slots)
        counts, placement = jnp.asarray(counts, jnp.int32), jnp.asarray(placement, jnp.int32)
        if self.guest_slots == 0:  # no slot to copy into: every planner reduces to the home plan
            return home_plan(counts, placement, 0)
        return self._plan(counts, placement, None if held is None else jnp.asarray(held, jnp.int32))

    def _plan(self, counts, placement, held) -> Plan:
        raise NotImplementedError


def carry_like(state, ref):
    """The loop state with the same device-variance as `ref`.

    Inside shard_map, counts all-gathered over the mesh are typed as varying over its axes, and a
    loop carry must keep one type: constants in the initial state are made to vary the same way by
    adding a zero derived from `ref`."""
    zero = ref.reshape(-1)[:1].sum() * 0
    return jax.tree.map(lambda x: x | (zero != 0) if x.dtype == bool else x + zero.astype(x.dtype), state)


def set_entry(array, index: tuple, value):
    """array with the one entry at `index` (a tuple of scalar indices, in bounds) set to value.

    For the loops that change one entry of a state array per step. Written as a masked select over
    the whole array, (row == r) & (column == c), XLA:CPU rewrites every entry each step, and those
    stores stalled in some compilations; a dynamic_update_slice of one entry writes one, in place.
    It is no scatter, so the loop still compiles as one kernel (jtopoep.xla_cpu)."""
    value = jnp.asarray(value, array.dtype).reshape((1,) * array.ndim)
    return jax.lax.dynamic_update_slice(array, value, index)


def holds_home(home_rank, num_ranks: int, xp=jnp):
    """[R, n] True where the rank is the home of each of n experts, given their home ranks [n]."""
    return home_rank[None, :] == xp.arange(num_ranks, dtype=xp.int32)[:, None]


def holds_held(held, cand):
    """[R, C] True where the rank holds candidate expert cand[c] from the step's previous micro-batch
    (held [R, K], -1 empty; its copy needs no transfer); None without held."""
    return None if held is None else (held[:, :, None] == cand[None, None, :]).any(1)


def scatter_set(size: int, index, values, xp):
    """zeros(size) with values written at index; every index at most once, so order cannot matter.
    A scatter of n values costs n, where a one-hot reduction costs n * size."""
    if xp is np:
        out = np.zeros(size, values.dtype)
        out[index] = values
        return out
    return jnp.zeros(size, values.dtype).at[index].set(values, unique_indices=True)


def one_hot(ids, n, xp=jnp):
    """int32 one-hot of ids along a new last axis; id -1 gives an all-zero row."""
    return (ids[..., None] == xp.arange(n, dtype=xp.int32)).astype(xp.int32)


def ceil_div(a, b):
    return -(-a // b)


def spill_per_expert(loads, placement, target, xp=jnp):
    """[E] pairs above target on each rank, attributed to its home experts hottest first (ties to
    the lower slot)."""
    home_loads = loads[placement]  # [R, H]
    slot = xp.arange(placement.shape[1])
    mine, other = home_loads[:, :, None], home_loads[:, None, :]
    # Pairs of the rank's experts that shed before each one: a pairwise count over the H home
    # slots, which is cheaper than a per-row sort for the few slots a rank has.
    ahead = (other > mine) | ((other == mine) & (slot[None, None, :] < slot[None, :, None]))  # [R, H, H]
    before = (ahead * other).sum(2)
    excess = xp.maximum(home_loads.sum(1) - target, 0)[:, None]
    spill = xp.minimum(home_loads, xp.maximum(excess - before, 0))
    return scatter_set(loads.shape[0], placement.reshape(-1), spill.reshape(-1).astype(loads.dtype), xp)


def num_copy_candidates(num_experts: int, num_ranks: int, guest_slots: int) -> int:
    """How many experts a copy loop considers: min(E, R * K, R).

    Spill is attributed to each overloaded rank's hottest experts first, so each rank's spill spans
    few experts, fewer than R on every benchmark load family. With more than R, the ones with the
    least spill keep it at home (a plan that is less balanced, never a lost pair). Capping at R
    bounds taot's per-step [C, R] work without changing the plans on those families."""
    return min(num_experts, num_ranks * guest_slots, num_ranks)


def spill_candidates(spill, loads, num: int):
    """The `num` experts with the most spill, ties by load, then by lowest index.

    A copy loop copies experts among these only (num = num_copy_candidates(...)), so its cost does
    not grow with E. The hottest non-spilling experts fill the list after the spilling ones, which is
    what the locality swaps look at. Two packed single-key sorts (jtopoep.ordering) instead of one
    sort with two keys and a payload."""
    bound = key_range(spill.shape[0])  # counts of pairs stay far below it (8M for E = 256)
    by_load = stable_order(descending_key(loads, bound), bound)
    # A stable sort by spill of the experts in load order keeps load order among equal spills.
    return by_load[stable_order(descending_key(spill[by_load], bound), bound)][:num]


def prefix_sum(x, axis: int = 0, xp=jnp):
    """Inclusive prefix sums along `axis`. XLA:CPU lowers jnp.cumsum to a reduce-window whose cost
    grows with the square of the axis; an associative scan does log2(n) passes instead and gives
    the same integers on any backend."""
    if xp is np:
        return np.cumsum(x, axis=axis)
    return jax.lax.associative_scan(jnp.add, x, axis=axis)


def scatter_add(shape, index: tuple, values, xp=jnp):
    """zeros(shape) with values added at index; integer, so the result does not depend on order."""
    if xp is np:
        out = np.zeros(shape, values.dtype)
        np.add.at(out, index, values)
        return out
    return jnp.zeros(shape, values.dtype).at[index].add(values)


def even_quotas(slot_expert, loads, xp=jnp):
    """[R, S] split each expert's load evenly over its copies; the first copies in (d, j) order take
    one pair more when the load does not divide."""
    num_ranks, num_slots = slot_expert.shape
    flat = slot_expert.reshape(-1)
    hot = one_hot(flat, loads.shape[0], xp)  # [R*S, E]
    copies = hot.sum(0)  # [E]
    index_in_expert = ((prefix_sum(hot, 0, xp) - hot) * hot).sum(1)
    safe = xp.maximum(flat, 0)
    n = xp.maximum(copies[safe], 1)
    quota = loads[safe] // n + (index_in_expert < loads[safe] % n).astype(xp.int32)
    return xp.where(flat >= 0, quota, 0).reshape(num_ranks, num_slots).astype(xp.int32)


def guest_quotas_to_slots(placement, guest_expert, guest_quota, loads, xp=jnp):
    """Slots [R, S] and quotas [R, S] from guest copies: each home slot keeps what its guests do not take."""
    num_experts = loads.shape[0]
    slot_expert = xp.concatenate([placement, guest_expert], axis=1).astype(xp.int32)
    taken = scatter_add((num_experts,), (xp.maximum(guest_expert, 0),), xp.where(guest_expert >= 0, guest_quota, 0), xp)
    home_quota = loads[placement] - taken[placement]
    return slot_expert, xp.concatenate([home_quota, guest_quota], axis=1).astype(xp.int32)


def uncovered_node_pairs(counts, loads, spill, cand, cand_home, gpus_per_node: int):
    """[N, C] pairs of each candidate expert from each node that no copy on that node takes yet: on
    remote nodes all of them (they cross the scale-out link to the home), on the home node those
    beyond what the home slot keeps after spilling. A copy placed on node n and fed by n's own pairs
    (locality-tiered routing) turns up to this many pairs into intra-node traffic."""
    node_pairs = counts[:, cand].reshape(-1, gpus_per_node, cand.shape[0]).sum(1).astype(jnp.float32)
    remote = jnp.arange(node_pairs.shape[0])[:, None] != (cand_home // gpus_per_node)[None, :]
    kept = (loads[cand] - spill[cand]).astype(jnp.float32)
    return jnp.where(remote, node_pairs, jnp.maximum(node_pairs - kept[None, :], 0.0))
