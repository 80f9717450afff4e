"""`jaxdist.compat.routed`: while inside, this thread's calls to a function through any module's
reference to it run the replacement; other threads, and every call after, run the original."""

import sys
import threading
import types

import jax

from jaxdist.compat import routed


def test_a_call_through_any_modules_reference_is_routed_in_this_thread_only():
    original = jax.nn.dot_product_attention
    user = types.ModuleType("user_model_module")
    user.dot_product_attention = original  # `from jax.nn import dot_product_attention`
    sys.modules[user.__name__] = user
    seen_elsewhere = []

    def replacement(*args, **kwargs):
        return "routed"

    def other_thread():
        seen_elsewhere.append(user.dot_product_attention is original or user.dot_product_attention.__wrapped__)
        try:
            user.dot_product_attention(None, None, None)
        except Exception as e:  # the original ran (and refused the Nones)
            seen_elsewhere.append(type(e).__name__)

    try:
        with routed(original, replacement):
            assert jax.nn.dot_product_attention(None, None, None) == "routed"
            assert user.dot_product_attention(None, None, None) == "routed"
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
        assert seen_elsewhere[-1] != "routed" and len(seen_elsewhere) == 2
        assert jax.nn.dot_product_attention is original and user.dot_product_attention is original
    finally:
        del sys.modules[user.__name__]
