"""Request fields the door does not know: accepted, ignored, and logged once per name.

Routers and gateways add their own fields to every request they forward (vllm-router
adds SGLang's ``no_stop_trim``, ``return_text_in_logprobs``, ...). vLLM's server accepts
such fields and logs them as ignored; so does this door, so that putting a router in
front of a replica never turns every request into a 400. Known fields are still
validated strictly, and nested objects (``stream_options``, ``response_format``, tools)
still refuse what they do not know: only the top level of a body is open.

A hostile client could send a new name with every request; the set of names already
logged is bounded so that it cannot grow the process without limit.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)

MAX_REMEMBERED_NAMES = 256
MAX_LOGGED_NAME_LENGTH = 64

_logged: set[str] = set()
_lock = threading.Lock()


def note_ignored_fields(route: str, names: Iterable[str]) -> None:
    """Log each of ``names`` the first time any request to ``route`` carries it."""
    with _lock:
        new = [name for name in names if name not in _logged]
        room = MAX_REMEMBERED_NAMES - len(_logged)
        new = new[:max(room, 0)]
        _logged.update(new)
    if new:
        shown = ", ".join(repr(name[:MAX_LOGGED_NAME_LENGTH]) for name in sorted(new))
        log.warning("%s: ignoring request fields this server does not know: %s (logged once per name)", route, shown)
