"""Hydra configuration tree shipped as package data (searched as pkg://parabench.conf)."""
