"""The former home of the runtime redirection, kept so that code written against it still runs.

The redirection is :mod:`parabench.redirect` (bench/redirect.py, see docs/runtime.md); this module
only re-exports its public names. New code imports ``parabench.redirect``.
"""

from __future__ import annotations

from parabench.redirect import RedirectError, Redirection, current, install, redirect

__all__ = ["RedirectError", "Redirection", "current", "install", "redirect"]
