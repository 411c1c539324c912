"""What a controller pod is (`spec.roles.controller`). Torch-free: part of the RLJob schema.

Without this section the controller runs inside trainer rank 0, as LlamaRL's single controller does, and lives and
dies with it. With it, the controller is an executor of its own: `replicas` processes (pods) of which one leads
(controller/leadership.py) and drives the loop, calling the trainer's gRPC service, while the others stand by and
take over when the leader is lost. The trainer no longer stops with the controller, nor the controller with it.
"""

from __future__ import annotations

from pydantic import Field

from rlfleet.workers.roles import Role


class ControllerRole(Role):
    replicas: int = Field(2, ge=1, le=5)
    """Controller processes: one leads, the others stand by (2: a leader and a standby)."""
