"""The words every layer uses: clear errors, shared type aliases, the dtype rules, the optional
dependencies, and the layouts with their padding arithmetic. Imports nothing of cpshard's."""
