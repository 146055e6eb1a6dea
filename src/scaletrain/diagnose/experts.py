"""A mixture of experts' routing as diagnose reads it: the interval events' "moe" field
(telemetry/experts.py: per MoE layer the token slots each expert took), the rule that names
a collapsing router, and the busiest experts the report's heat map is read against.

Collapse. Each token takes top_k of E experts, so any g experts have a fair share of g/E of
the token slots, and g >= top_k experts can take every slot (each token choosing among
them). The rule judges the busiest quarter of the experts, at least top_k of them, and
measures how far their share has gone from fair (0) to all (1). A router is collapsing when
that is COLLAPSE_GAP or more in each of the last COLLAPSE_INTERVALS intervals, in some layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from scaletrain.diagnose.run import Finding, Run, pct

# Two thirds of the way from fair to all: for 8 experts top-2 (or 64 top-6), the busiest
# quarter takes 75% of the slots, and the other three quarters of the experts average a
# third of their fair share. Starved experts get little gradient and fall further behind,
# the loop the load-balancing loss exists to break. Young routers swing: a healthy tiny-moe
# run (docs/telemetry.md) reached 63% for its busiest quarter in one 5-step interval at step
# 25 and was back at 44% by step 30, so one interval is not enough, nor is a lower line.
COLLAPSE_GAP = 2 / 3
COLLAPSE_INTERVALS = 3  # the last ones, after the warm-up; every one of them must cross the line
STARVED = 0.1  # an expert below a tenth of its fair share is named as starved
MAX_LAYERS_SHOWN = 8


@dataclass(frozen=True)
class Busiest:
    experts: list[int]  # the busiest quarter (at least top_k), busiest first
    share: float  # of the layer's token slots
    fair: float  # len(experts) / E
    line: float  # the share at COLLAPSE_GAP of the way from fair to all

    @property
    def collapsed(self) -> bool:
        return self.share >= self.line


def moe_intervals(run: Run) -> list[dict[str, Any]]:
    """The interval events that carry a mixture of experts' load (none for a dense model)."""
    return [e for e in run.intervals if isinstance(e.get("moe"), dict) and e["moe"].get("layers")]


def top_k(moe: dict[str, Any]) -> int:
    """Experts per token: every token fills top_k slots of each layer."""
    tokens, load = moe.get("tokens"), moe["layers"][0].get("load") or []
    return max(1, round(sum(load) / tokens)) if tokens else 1


def busiest(load: list[int], k: int) -> Busiest | None:
    """None when there is nothing to judge: no slots, or a group that is every expert."""
    total, n = sum(load), len(load)
    g = max(math.ceil(n / 4), k)
    if total <= 0 or g >= n:
        return None
    order = sorted(range(n), key=lambda e: (-load[e], e))[:g]
    fair = g / n
    return Busiest(order, sum(load[e] for e in order) / total, fair, fair + COLLAPSE_GAP * (1 - fair))


def router_collapse(run: Run) -> list[Finding]:
    steady = moe_intervals(run)
    judged = (steady[1:] if len(steady) > 1 else steady)[-COLLAPSE_INTERVALS:]  # the first is warm-up
    if not judged:
        return []
    layers = min(len(e["moe"]["layers"]) for e in judged)
    found: list[tuple[int, list[Busiest], dict[str, Any]]] = []
    for i in range(layers):
        groups = [busiest(e["moe"]["layers"][i].get("load") or [], top_k(e["moe"])) for e in judged]
        if all(g is not None and g.collapsed for g in groups):
            found.append((i, [g for g in groups if g is not None], judged[-1]["moe"]["layers"][i]))
    if not found:
        return []
    settings = moe_settings(run)
    span = f"steps {judged[0]['step'] - judged[0].get('steps', 0) + 1}-{judged[-1]['step']}"
    dense = int(settings.get("dense_layers", 0))
    evidence = [_layer_line(i, groups, last, dense) for i, groups, last in found[:MAX_LAYERS_SHOWN]]
    if len(found) > MAX_LAYERS_SHOWN:
        evidence.append(f"... and {len(found) - MAX_LAYERS_SHOWN} more layers")
    top = max(found, key=lambda f: f[1][-1].share)[1][-1]
    experts = len(found[0][2]["load"])
    evidence.append(
        f"judged over the last {len(judged)} log interval{'s' if len(judged) > 1 else ''} ({span}): in each, the busiest "
        f"quarter of the experts (at least top_k) at or past the collapse line, {pct(COLLAPSE_GAP)} of the way from their "
        "fair share to every slot"
    )
    title = (
        f"router collapse in {len(found)} of {layers} MoE layer{'s' if layers > 1 else ''}: "
        f"{len(top.experts)} of {experts} experts take {pct(top.share)} of the token slots"
    )
    return [Finding("warning", "router_collapse", title, evidence, _advice(settings))]


def _layer_line(i: int, groups: list[Busiest], last: dict[str, Any], dense: int) -> str:
    g, load = groups[-1], last["load"]
    mean = sum(load) / len(load)
    starved = [e for e, x in enumerate(load) if x < STARVED * mean]
    shares = [x.share for x in groups]
    line = (
        f"MoE layer {i} (block {dense + i}): experts {', '.join(map(str, g.experts))} took {pct(g.share)} of its token "
        f"slots in the last interval ({pct(min(shares))}-{pct(max(shares))} over the judged ones; fair share {pct(g.fair)}, "
        f"collapse line {pct(g.line)}); max/mean load {last.get('imbalance')}"
    )
    if starved:
        line += (
            f"; starved (under a tenth of their share): expert{'s' if len(starved) > 1 else ''} {', '.join(map(str, starved))}"
        )
    if last.get("aux") is not None:
        line += f"; auxiliary loss {last['aux']:.3g} per forward"
    if last.get("dropped"):
        line += f"; {pct(last['dropped'] / sum(load))} of slots dropped at the capacity"
    return line


def moe_settings(run: Run) -> dict[str, float]:
    """The router's settings from the run's config.yaml (the preset's where unset); {} when unreadable."""
    from scaletrain.models.presets import AUX_LOSS_WEIGHT, PRESETS, Z_LOSS_WEIGHT, aux_loss_weight

    cfg = run.config
    if cfg is None:
        return {}
    moe, preset = cfg.model.moe, PRESETS.get(cfg.model.preset, {})
    pick = lambda key, default: (  # noqa: E731
        getattr(moe, key) if moe is not None and getattr(moe, key) is not None else preset.get(key, default)
    )
    return {
        "aux_loss_weight": aux_loss_weight(moe.balance, moe.aux_loss_weight) if moe is not None else AUX_LOSS_WEIGHT,
        "z_loss_weight": moe.z_loss_weight if moe is not None else Z_LOSS_WEIGHT,
        "capacity_factor": float(pick("capacity_factor", 0.0) or 0.0),
        "dense_layers": int(pick("dense_layers", 0) or 0),
        **({"bias_update_rate": moe.bias_update_rate} if moe is not None and moe.balance == "bias" else {}),
    }


def _advice(s: dict[str, float]) -> str:
    now = lambda key: f"now {s[key]:g}; " if key in s else ""  # noqa: E731
    cf = s.get("capacity_factor")
    capacity = (
        f"lower model.moe.capacity_factor (now {cf:g}) toward 1.0"
        if cf
        else f"set model.moe.capacity_factor=1.25 ({'now dropless; ' if cf is not None else ''}an expert then takes at "
        "most 1.25x its fair share of a micro-batch's slots, the rest are dropped, so the busy ones cannot take them all)"
    )
    balancer = (
        f"raise model.moe.bias_update_rate ({now('bias_update_rate')}2-5x): the bias is what moves slots back to the "
        "starved experts"
        if "bias_update_rate" in s
        else f"raise model.moe.aux_loss_weight ({now('aux_loss_weight')}2-5x): the load-balancing term is what moves "
        "slots back to the starved experts"
    )
    return (
        f"{balancer}; {capacity}; raise model.moe.z_loss_weight ({now('z_loss_weight')}e.g. 10x) if the "
        "router's logits grow (a saturated softmax gives the starved experts almost no gradient to win tokens back); "
        "a collapse early in training also follows too high a train.lr for the router: a lower one or a longer train.warmup_steps"
    )
