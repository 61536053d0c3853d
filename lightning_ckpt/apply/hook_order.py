"""Where the hooks of checkpointed regions sit among a block's forward hooks.

A region opens at a forward pre-hook that must run before every other pre-hook of its first
block (it takes the arguments as the caller passed them) and closes at a forward hook that
must run after every other forward hook of its last block (it sees the output the caller
receives). The region then holds the whole module call: the pre-hooks of users and strategies,
the forward and the forward hooks. The recompute calls the block as a module, so each of those
hooks runs once there too, on the same arguments, as in the forward.

Hooks registered after the regions' are put back in place at each call: forward hooks before
they run (`put_last`), pre-hooks for the next call (`put_first`); `stands_behind` tells a region
that a pre-hook put in front of it (`prepend=True`) already ran on this call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

__all__ = ["put_first", "put_last", "stands_behind"]


def put_first(hooks: OrderedDict, ranks: Mapping[int, Any]) -> None:
    """Move the hooks whose ids are in `ranks` to the front of `hooks`, ordered by their rank."""
    want = sorted(ranks, key=ranks.__getitem__)
    if list(hooks)[: len(want)] != want:
        for hid in reversed(want):
            hooks.move_to_end(hid, last=False)


def put_last(hooks: OrderedDict, ranks: Mapping[int, Any]) -> None:
    """Move the hooks whose ids are in `ranks` to the end of `hooks`, ordered by their rank."""
    want = sorted(ranks, key=ranks.__getitem__)
    if want and list(hooks)[-len(want):] != want:
        for hid in want:
            hooks.move_to_end(hid)


def stands_behind(hooks: OrderedDict, hid: int, own: Mapping[int, Any]) -> bool:
    """True if a hook outside `own` comes before the hook `hid` in `hooks`."""
    for other in hooks:
        if other == hid:
            return False
        if other not in own:
            return True
    return False
