"""CP-aware micro-batch packing: the problem, the search and its exact refinement (``cpshard.pack``)."""
