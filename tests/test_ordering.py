import jax
import jax.numpy as jnp
import numpy as np

from jtopoep.ordering import descending_key, inverse_permutation, key_range, stable_order


def test_stable_order_is_a_stable_argsort():
    rng = np.random.default_rng(0)
    order = jax.jit(stable_order, static_argnums=1)
    for n, num_keys in ((1, 1), (7, 3), (256, 256), (1000, 5)):
        keys = rng.integers(0, num_keys, n)
        np.testing.assert_array_equal(np.asarray(order(jnp.asarray(keys), num_keys)),
                                      np.argsort(keys, stable=True))


def test_stable_order_falls_back_when_the_packing_would_overflow():
    keys = np.array([2**30, 5, 2**30, 0])
    np.testing.assert_array_equal(np.asarray(stable_order(jnp.asarray(keys), 2**31)), [3, 1, 0, 2])


def test_descending_key_orders_largest_first_and_saturates():
    values = jnp.asarray([3, 10, 10, 0, 99])
    bound = 50
    np.testing.assert_array_equal(np.asarray(stable_order(descending_key(values, bound), bound)), [4, 1, 2, 0, 3])
    assert key_range(256) * 256 <= 2**31


def test_inverse_permutation():
    order = jnp.asarray(np.random.default_rng(1).permutation(50))
    np.testing.assert_array_equal(np.asarray(inverse_permutation(order))[np.asarray(order)], np.arange(50))
