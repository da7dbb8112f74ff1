"""``bench comm``: the collectives benchmark in the style of nccl-tests - the front end that checks,
launches and reports every job of the command (``command``) and one rank's timed, checked
collectives (``worker``). What it measures with (operations, sizes, bus factors, the alpha-beta fit:
:mod:`parabench.collectives`) is a building block below it, shared with ``bench run``'s
communication log."""
