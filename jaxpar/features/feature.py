"""What every feature module is made of: its rows of the switch table (`Switch`), and checks that
yield one sentence for each thing a config gets wrong (`first` takes the first).

A switch is a config key that changes how a run is laid out or computed, and not what it computes.
Its row says, once: how the key appears in the layout's name (`jaxpar verify`'s "data=4 tensor=2
zero=3 fp32"), what verify's one-device reference does with it (keeps it, or takes a value), whether
`jaxpar plan --search` enumerates it, and whether it combines with local SGD. Its valid values are
declared next to its field in jaxpar.config (a Literal type).

Pure Python, like jaxpar.config: the CLI validates before jax starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the features sit low in the import graph
    from jaxpar.config import Config

KEEP = "keep"  # a row's `reference`: verify's reference keeps the layout's value

# label(value, cfg, mesh sizes) -> the layout name's part for this key, or None when it shows nothing
Label = Callable[[object, "Config", dict], str | None]
Checks = Iterator[str]  # a feature's checks: one sentence for each thing the config gets wrong


@dataclasses.dataclass(frozen=True)
class Switch:
    key: str  # the dotted config key
    label: Label
    reference: object = KEEP  # what verify's one-device reference sets it to, KEEP, or a function of the value
    searched: bool = False  # jaxpar plan --search enumerates it
    with_local_sgd: bool = True  # it may differ from its default under local SGD (parallel.sync_every > 1)


def unless(default, text: str) -> Label:
    """Shown as `text` (formatted with the value) unless the value is `default`."""
    return lambda value, cfg, sizes: None if value == default else text.format(value=value)


def axis(name: str) -> Label:
    """A mesh axis, shown as 'name=size' when it has more than one device."""
    return lambda value, cfg, sizes: f"{name}={sizes[name]}" if sizes[name] > 1 else None


def never(value, cfg, sizes) -> None:
    return None


def first(checks: Checks) -> str | None:
    """The first sentence a feature's checks yield (they stop there), or None."""
    return next(checks, None)
