"""``bench env``: every backend, available or not and exactly why, the devices, and the installed
versions against the ranges parabench supports (``command``). The facts the backends also need
(package and CANN versions, device presence) live below it, in :mod:`parabench.devices`."""
