"""Migration rules: one rule per file."""
