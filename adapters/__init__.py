"""Backend adapters: one file per training stack behind a small registry (see registry.py)."""
