"""Policy names with knobs, for sweeps and ablations: ``e2:th_bal=inf,imbalance_ratio=1.1``.

A variant is a policy name (one of ``POLICY_NAMES``), optionally followed by ``:`` and
``knob=value`` pairs naming fields of ``PolicyConfig``; each value is parsed as the type of
that field's default (``inf`` is a float; booleans take true/false/1/0). The whole text is
the variant's label in result rows, so an ablation's steps stay apart in one JSON file.
Local policies take their own config's knobs the same way
(``sprpt_limited:preempt_fraction=0``, ``parse_local_variant``).

In a comma-separated ``--policies`` list a part holding ``=`` but no ``:`` continues the
previous variant's knobs, so ``round_robin,e2:th_bal=inf,imbalance_ratio=1.1,e2`` is three
variants: ``round_robin``, ``e2:th_bal=inf,imbalance_ratio=1.1`` and ``e2``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prefixmesh.loadgen.ideal import IDEAL
from prefixmesh.services.scheduler.policies import POLICY_NAMES
from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.worker.local import LOCAL_POLICY_CONFIGS, LocalPolicyConfig

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True, slots=True)
class PolicyVariant:
    """A global policy and the config it runs with."""

    # As given (the label result rows carry).
    label: str
    # The policy name ``make_policy`` takes.
    policy: str
    config: PolicyConfig


@dataclass(frozen=True, slots=True)
class LocalVariant:
    """A local policy and the config it runs with (None: the policy's defaults)."""

    label: str  # as given
    policy: str  # the name make_local_policy takes
    config: LocalPolicyConfig | None


def parse_variant(text: str) -> PolicyVariant:
    """``"e2:th_bal=inf,replicate_max_workers=1"`` -> the policy and its PolicyConfig."""
    label = text.strip()
    name, _, knobs = label.partition(":")
    name = name.strip()
    if name not in POLICY_NAMES and name != IDEAL:
        raise ValueError(f"unknown global policy {name!r} (known: {', '.join(POLICY_NAMES)}; "
                         f"the simulator also runs {IDEAL})")
    return PolicyVariant(label=label, policy=name,
                         config=_with_knobs(PolicyConfig(), knobs, label))


def parse_local_variant(text: str) -> LocalVariant:
    """``"sprpt_limited:preempt_fraction=0"`` -> the local policy and its config."""
    label = text.strip()
    name, _, knobs = label.partition(":")
    name = name.strip()
    if name not in LOCAL_POLICY_CONFIGS:
        raise ValueError(f"unknown local policy {name!r} "
                         f"(known: {', '.join(LOCAL_POLICY_CONFIGS)})")
    config = _with_knobs(LOCAL_POLICY_CONFIGS[name](), knobs, label) if knobs.strip() else None
    return LocalVariant(label=label, policy=name, config=config)


def _with_knobs(base, knobs: str, label: str):
    """``base`` (a config dataclass) with the ``knob=value`` pairs of ``knobs`` applied."""
    fields = {f.name for f in dataclasses.fields(base)}
    changes: dict[str, object] = {}
    for part in knobs.split(","):
        part = part.strip()
        if not part:
            continue
        key, eq, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not raw:
            raise ValueError(f"policy knob {part!r} in {label!r}: expected knob=value")
        if key not in fields:
            raise ValueError(f"{type(base).__name__} has no knob {key!r} (in {label!r})")
        changes[key] = _parse_value(key, raw, getattr(base, key))
    return dataclasses.replace(base, **changes) if changes else base


def split_variants(text: str) -> list[str]:
    """Split a ``--policies`` list into variant texts (knob lists may contain commas)."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and out:
            out[-1] = f"{out[-1]},{part}"
        else:
            out.append(part)
    return out


def _parse_value(key: str, raw: str, default: object) -> object:
    try:
        if isinstance(default, bool):
            low = raw.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise ValueError(f"policy knob {key}={raw!r}: expected {type(default).__name__}"
                         ) from None
    return raw
