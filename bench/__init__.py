"""parabench: one harness, one Llama, many distributed-training stacks.

Importing this package is cheap on purpose: torch, DeepSpeed, Megatron and MindSpore are imported
only by the code paths that need them (``bench --help`` must stay fast).
"""

__version__ = "0.1.0"
