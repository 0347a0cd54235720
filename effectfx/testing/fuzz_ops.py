"""The ops only generated programs use (``effectfx.testing.program``), on the shared log (``effect_ops.LOG``).

* ``efxfuzz::ping(x, label) -> ()`` -- a custom op that returns nothing and mutates nothing and is *never*
  registered: effectfx keeps it as an effect on ``"ordered"`` because it exists only for its side effect;
* ``efxfuzz::logged(x, label) -> Tensor`` -- an effect (registered, ``"ordered"``) whose kernel is
  CompositeImplicitAutograd: it notes ``x`` through ``efxfuzz::note``, an op effectfx alone would take for
  pure (it returns a tensor, left unused), prints, and returns ``sin(x) * 2``.  Taken apart, its note and
  print would be lost or misplaced; as one node it runs exactly as eager, and its gradient is the kernel's.
"""

from __future__ import annotations

import torch

import effectfx as efx

from .effect_ops import LOG


def _fingerprint(x: torch.Tensor) -> float:
    return round(float(x.detach().double().sum()), 4)


@torch.library.custom_op("efxfuzz::ping", mutates_args=())
def ping(x: torch.Tensor, label: str) -> None:
    LOG.append(("ping", label, _fingerprint(x)))


ping.register_fake(lambda x, label: None)


@torch.library.custom_op("efxfuzz::note", mutates_args=())
def note(x: torch.Tensor, label: str) -> torch.Tensor:
    LOG.append(("note", label, _fingerprint(x)))
    return x.new_zeros(())


note.register_fake(lambda x, label: x.new_empty(()))


def _logged(x: torch.Tensor, label: str) -> torch.Tensor:
    torch.ops.efxfuzz.note(x, label)
    print(f"logged {label}:", x.detach().sum())
    return x.sin() * 2


_LIB = torch.library.Library("efxfuzz", "FRAGMENT")
_LIB.define("logged(Tensor x, str label) -> Tensor")
_LIB.impl("logged", _logged, "CompositeImplicitAutograd")
efx.register_effect("efxfuzz::logged")
