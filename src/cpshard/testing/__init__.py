"""The process launcher (``run_ranks``) and the reference computations checks compare against: CP
attention and the CP linear scan. Public as ``cpshard.spawn``, ``cpshard.attention``, ``cpshard.scan``."""
