"""The ``cpshard`` command line and what it runs: the plan and packing summaries, their figures,
``cpshard verify`` and its models."""
