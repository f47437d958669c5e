"""Moving home experts to a new placement: their weights and optimizer moments, by all-to-all.

An expert-axis array (expert weights, AdamW's first and second moments) is stored in home-slot order:
row r * H + h holds expert placement[r, h], and rank r holds rows [r * H, (r + 1) * H). A new placement
moves each expert from its old slot to its new one. Every rank sends each of its H rows to the expert's
new rank in one ragged all-to-all over the expert-parallel axes (jtopoep.transport; the sizes [R, R]
follow from the two placements, which every rank holds), then puts the H rows it received in its new
slots. No host round trip, and the values arrive bit for bit: the result equals a gather of the old
array by the permutation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P
from jax.typing import ArrayLike
from jaxtyping import Array, Int, Shaped

from jtopoep.homes import replace_homes
from jtopoep.layer import ExpertParam, MoELayer
from jtopoep.ordering import inverse_permutation
from jtopoep.plan import home_rank_of_experts
from jtopoep.topology import EP_AXES, Topology
from jtopoep.transport import exchange


def migration_sizes(old: Int[ArrayLike, "R H"], new: Int[ArrayLike, "R H"]) -> Int[Array, "R R"]:
    """[s, d]: experts whose home moves from rank s to rank d (the diagonal: those that stay)."""
    old, new = jnp.asarray(old), jnp.asarray(new)
    num_ranks = old.shape[0]
    source, dest = home_rank_of_experts(old), home_rank_of_experts(new)
    return jnp.zeros((num_ranks, num_ranks), jnp.int32).at[source, dest].add(1)


def slot_permutation(old: Int[ArrayLike, "R H"], new: Int[ArrayLike, "R H"]) -> Int[Array, " E"]:
    """[E]: for each new home slot, the old slot its expert comes from (new_array = old_array[perm])."""
    old, new = jnp.asarray(old), jnp.asarray(new)
    return inverse_permutation(old.reshape(-1))[new.reshape(-1)]


def migrate_local(rows: Shaped[Array, "H *feat"], old: Int[Array, "R H"], new: Int[Array, "R H"], *,
                  gpus_per_node: int, backend: str = "auto",
                  axes: tuple[str, str] = EP_AXES) -> Shaped[Array, "H *feat"]:
    """This rank's home rows under the new placement; call inside shard_map over `axes`."""
    home = old.shape[1]
    me = jax.lax.axis_index(axes[0]) * gpus_per_node + jax.lax.axis_index(axes[1])
    new_rank = home_rank_of_experts(new)
    # Send: my rows in order of their new rank (stable, so by slot within a destination).
    dest = new_rank[jax.lax.dynamic_index_in_dim(old, me, 0, keepdims=False)]
    send_order = jnp.argsort(dest, stable=True)
    received = exchange(rows[send_order], migration_sizes(old, new), out_rows=home, gpus_per_node=gpus_per_node,
                        backend=backend, capacity=home, axes=axes)
    # Received: by source rank, within a source by its slot, so in order of the experts' old global
    # slot. My new slot j takes the row whose old slot ranks where expert new[me, j]'s does.
    old_slot = slot_permutation(old, new).reshape(new.shape)
    mine = jax.lax.dynamic_index_in_dim(old_slot, me, 0, keepdims=False)
    position = jnp.argsort(jnp.argsort(mine))
    return received[position]


def migrate(array: Shaped[Array, "E *feat"], old: Int[Array, "R H"], new: Int[Array, "R H"], mesh: Mesh,
            topology: Topology, *, backend: str = "auto") -> Shaped[Array, "E *feat"]:
    """An expert-axis array, sharded over the expert-parallel axes, moved to the new placement."""
    return migrate_layers(array[None], old[None], new[None], mesh, topology, backend=backend)[0]


def migrate_layers(array: Shaped[Array, "L E *feat"], old: Int[Array, "L R H"], new: Int[Array, "L R H"], mesh: Mesh,
                   topology: Topology, *, backend: str = "auto") -> Shaped[Array, "L E *feat"]:
    """migrate for layers stacked on a leading axis, one layer after another (jax.lax.map: compiled
    once whatever the depth), each to its own new placement."""
    def local(rows, old, new):
        return jax.lax.map(lambda a: migrate_local(*a, gpus_per_node=topology.gpus_per_node, backend=backend),
                           (rows, old, new))

    spec = P(None, EP_AXES)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), P()), out_specs=spec)(array, old, new)


def migration_traffic(old: Int[ArrayLike, "R H"], new: Int[ArrayLike, "R H"], gpus_per_node: int
                      ) -> dict[str, Array]:
    """Experts that move home, within a node and across nodes, and which ones ([E] bool)."""
    old, new = jnp.asarray(old), jnp.asarray(new)
    source, dest = home_rank_of_experts(old), home_rank_of_experts(new)
    moved = source != dest
    across = moved & (source // gpus_per_node != dest // gpus_per_node)
    return {"moved": moved, "moved_intra": (moved & ~across).sum(), "moved_inter": across.sum()}


def rehome(model: nnx.Module, optimizer: nnx.Optimizer | None = None, *, backend: str = "auto"
           ) -> dict[str, Array]:
    """Re-place the home experts of every MoE layer of `model` that keeps routing averages
    (moe.replace_every) and move its expert weights, and the optimizer's state of them (AdamW's
    moments: every optimizer leaf at a weight's path with its shape), to the new ranks. A layer's
    variables may be stacked over several layers on a leading axis (models.moe_transformer); each
    layer is re-placed from its own averages. Call inside nnx.jit; every rank computes the same
    placements. Returns, per layer in model order, stacked [layers, ...], the experts that moved
    (jtopoep.migration.migration_traffic)."""
    opt_state = None if optimizer is None else nnx.state(optimizer)
    opt_leaves = [] if opt_state is None else nnx.to_flat_state(opt_state)
    traffic = []
    for path, layer in nnx.iter_graph(model):
        if not isinstance(layer, MoELayer) or not layer.tracks_routing:
            continue
        stacked = layer.placement.get_value().ndim == 3
        lift = (lambda a: a) if stacked else (lambda a: a[None])  # noqa: E731
        old = lift(layer.placement.get_value())
        topology = layer.topology
        new = jax.lax.map(lambda a: replace_homes(*a, topology),
                          (lift(layer.load_average.get_value()), lift(layer.coactivation_average.get_value()), old))

        def move(a):
            moved = migrate_layers(lift(a), old, new, layer.mesh, topology, backend=backend)
            return moved if stacked else moved[0]

        for name, weight in vars(layer).items():
            if not isinstance(weight, ExpertParam):
                continue
            weight_path = tuple(path) + (name,)
            for leaf_path, leaf in opt_leaves:
                if tuple(leaf_path[-len(weight_path):]) == weight_path and leaf.get_value().shape == weight.shape:
                    leaf.set_value(move(leaf.get_value()))
            weight.set_value(move(weight.get_value()))
        layer.placement.set_value(new if stacked else new[0])
        traffic.append(jax.vmap(lambda o, n: migration_traffic(o, n, topology.gpus_per_node))(old, new))
    if optimizer is not None:
        nnx.update(optimizer, opt_state)
    return {key: jnp.concatenate([t[key] for t in traffic]) for key in ("moved", "moved_intra", "moved_inter")}
