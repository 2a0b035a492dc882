"""The memory tiers of a store, built from its configuration (`ImpressStore.tiers`)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import ImpressConfig
from ..tiers import TierManager
from ..tiers.policies import make_policy


def policy_kwargs(cfg: ImpressConfig) -> dict[str, Any]:
    """The settings of ``cfg.policy`` (the score policy's decay and weight)."""
    if cfg.policy.lower() == "score":
        return {"half_life_s": cfg.half_life_s, "unimportant_weight": cfg.unimportant_weight}
    return {}


def make_tiers(cfg: ImpressConfig, device: torch.device, clock: Any) -> TierManager:
    """The device and host tiers with ``cfg``'s budgets and policy (host copies pinned
    when CUDA is available)."""
    pin = torch.cuda.is_available()

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=pin)

    def to_host(t: torch.Tensor) -> torch.Tensor:
        host = t.to("cpu")
        return host.pin_memory() if pin and not host.is_pinned() else host

    def own(t: torch.Tensor) -> torch.Tensor:  # a dissolved slab's block: storage of its own
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device, pin_memory=pin and t.device.type == "cpu")
        return out.copy_(t)

    return TierManager(
        cfg.device_bytes, cfg.host_bytes, make_policy(cfg.policy, **policy_kwargs(cfg)), class_shares=cfg.tier_shares,
        clock=clock, to_device=to_device, to_host=to_host, disk_to_device=True, own=own,
    )
