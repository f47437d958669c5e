import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtopoep.router import bias_update, route


def test_softmax_topk_and_normalised_gates():
    logits = jnp.array([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.9]])
    out = route(logits, 2, "softmax", normalize=True)
    np.testing.assert_array_equal(np.asarray(out.expert_ids), [[1, 2], [0, 3]])
    np.testing.assert_allclose(np.asarray(out.gates.sum(-1)), 1.0, rtol=1e-6)
    p = jax.nn.softmax(logits[0])
    np.testing.assert_allclose(float(out.gates[0, 0]), float(p[1] / (p[1] + p[2])), rtol=1e-6)


def test_aux_loss_is_one_when_uniform_and_z_loss_matches():
    logits = jnp.zeros((8, 4))
    # ties broken by index: every token picks experts 0 and 1, but the probabilities are uniform
    out = route(logits, 2, "softmax")
    assert float(out.aux_loss) == pytest.approx(1.0)
    assert float(out.z_loss) == pytest.approx(float(jnp.log(4.0) ** 2))


def test_bias_steers_choice_not_gates():
    logits = jnp.array([[2.0, 1.0, 0.0]])
    plain = route(logits, 1, "sigmoid", normalize=False)
    biased = route(logits, 1, "sigmoid", normalize=False, bias=jnp.array([0.0, 0.0, 5.0]))
    assert int(plain.expert_ids[0, 0]) == 0 and int(biased.expert_ids[0, 0]) == 2
    assert float(biased.gates[0, 0]) == pytest.approx(float(jax.nn.sigmoid(0.0)))


def test_bias_update_raises_cold_lowers_hot():
    counts = jnp.array([[9, 1, 2], [9, 1, 2]])
    new = bias_update(jnp.zeros(3), counts, 0.1)
    np.testing.assert_allclose(np.asarray(new), [-0.1, 0.1, 0.1])


def test_unknown_score_fn():
    with pytest.raises(ValueError, match="unknown score_fn 'relu'"):
        route(jnp.zeros((2, 4)), 1, "relu")


def test_node_limited_routing_picks_the_nodes_with_the_best_experts_in_sum():
    """4 nodes of 2 experts, k = 4, M = 2: a node scores the sum of its ceil(4 / 2) = 2 best experts.
    Node 0 holds the single best expert but node 1 and 2 the best pairs: the token goes to 1 and 2."""
    scores = jnp.array([[0.90, 0.00, 0.60, 0.50, 0.55, 0.45, 0.30, 0.20]])
    out = route(jnp.log(scores + 1e-9), 4, "softmax", max_nodes=2, num_nodes=4)
    assert sorted(np.asarray(out.expert_ids)[0].tolist()) == [2, 3, 4, 5]
    free = route(jnp.log(scores + 1e-9), 4, "softmax", max_nodes=0, num_nodes=4)
    assert sorted(np.asarray(free.expert_ids)[0].tolist()) == [0, 2, 3, 4]


def test_node_limited_routing_keeps_each_token_on_at_most_max_nodes_nodes():
    logits = jax.random.normal(jax.random.key(0), (256, 32))
    for max_nodes in (1, 2, 3):
        out = route(logits, 6, "sigmoid", max_nodes=max_nodes, num_nodes=4)
        nodes = np.asarray(out.expert_ids) // 8
        assert max(len(set(row)) for row in nodes) == max_nodes
    same = route(logits, 6, "sigmoid", max_nodes=4, num_nodes=4)
    np.testing.assert_array_equal(np.asarray(same.expert_ids), np.asarray(route(logits, 6, "sigmoid").expert_ids))


def test_node_limited_routing_needs_room_for_k_experts():
    with pytest.raises(ValueError, match=r"max_nodes = 1 needs .* max_nodes \* E / nodes >= top_k = 6"):
        route(jnp.zeros((2, 16)), 6, max_nodes=1, num_nodes=4)
