"""A backend of another package, registered with parabench through an entry point only
(toy_backend-0.1.dist-info/entry_points.txt) and configured through Hydra's search path
(hydra_plugins/toy_backend_searchpath): tests/test_cli.py checks that bench env, bench run and
bench comm find it with no edit to parabench's own files."""

from __future__ import annotations

from parabench.adapters.base import Availability, Capabilities
from parabench.adapters.ddp import DDPAdapter


class ToyAdapter(DDPAdapter):
    """Toy backend of tests/data/toy_backend: DDP under another name, for the plugin tests"""

    name = "toy"
    capabilities = Capabilities(devices=frozenset({"cpu"}), precisions=frozenset({"fp32"}))
    distributions = ("torch", "toy-backend")
    known_good = ({"source": "tests/data/toy_backend", "torch": "2", "toy-backend": "0.1"},)

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "a toy: always here", {"toy-backend": "0.1"})
