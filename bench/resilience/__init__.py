"""Resilience, a building block of ``bench run`` and ``bench convert``: step checkpoints around the
backend's native format and the resume plan (``checkpoint``), injected faults and the recovery
figures measured around them (``faults``), and the stability table a comparison shows of them
(``stability``; docs/resilience.md)."""
