"""The execution half of the engine core (core/__init__.py)."""
