"""Policy: what a model's config asks of the plan (its layout, its layers' layouts), decided once per
step above the plan, extensible by registration (``policy/layouts.py``)."""
