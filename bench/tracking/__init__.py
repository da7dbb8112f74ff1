"""Tracking, a building block of every command that records into MLflow: a job's run, its spool and
``bench sync`` (``runs``), and the store itself - checked before launch, its credentials kept out of
what is written, opened safely when many jobs share it (``store``)."""
