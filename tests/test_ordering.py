import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtopoep.ordering import descending_key, first_argmax, first_argmin, inverse_permutation, key_range, stable_order


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


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.bool_])
def test_first_argmax_and_argmin_match_numpy_with_ties(dtype):
    rng = np.random.default_rng(2)
    for shape in ((1,), (9,), (4, 6), (3, 5, 2)):
        x = rng.integers(0, 3, shape).astype(dtype)  # few values: many ties, first index wins
        for axis in (None, *range(len(shape)), -1):
            np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x), axis)), np.argmax(x, axis=axis))
            np.testing.assert_array_equal(np.asarray(first_argmin(jnp.asarray(x), axis)), np.argmin(x, axis=axis))
    masked = jnp.full((4, 4), -jnp.inf)  # nothing feasible: index 0, as argmax gives
    assert int(first_argmax(masked)) == 0 and int(first_argmax(masked.at[2, 3].set(-5.0))) == 11
