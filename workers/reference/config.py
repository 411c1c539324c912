"""What a reference pod is (`spec.roles.reference`). Torch-free: part of the RLJob schema.

The reference policy runs the policy's architecture forward only, on devices of its own. Its weights come from
the trainer over the same DDMA path as the generators' (never reloaded from disk by the run): the trainer pushes
them when the run starts and, for a moving reference, every `updateEverySteps` steps. What the KL does with its
log-probs is the algorithm's choice (`spec.algorithm.kl`).
"""

from __future__ import annotations

from pydantic import Field

from rlfleet.workers.roles import Role


class ReferenceRole(Role):
    update_every_steps: int = Field(0, ge=0, le=10**7)
    """0: the reference stays the policy the run started from. K: the trainer pushes its weights every K steps (a
    moving reference, K steps old at most)."""
