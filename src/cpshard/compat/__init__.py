"""Drop-in replacements for the sequence-packing helpers of frameworks built on Megatron-core.

- :mod:`cpshard.compat.verl`: verl 0.9.1's ``preprocess_thd_engine`` and friends, and ``patch()``.

Nothing here is imported by the core; each adapter builds a plan and calls the core.
"""
