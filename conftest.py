"""Repository-only pytest settings. The parity plugin itself is registered by its `pytest11`
entry point (`pip install -e .`); from a checkout without installing, pass `-p parity.plugin`."""
