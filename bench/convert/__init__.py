"""``bench convert``: a checkpoint carried to another stack or layout through the canonical training
state (``command``), the per-rank export and import (``worker``), and readers of the checkpoints
DeepSpeed and Megatron-LM save themselves (``deepspeed_checkpoint``, ``megatron_checkpoint``)."""
