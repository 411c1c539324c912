"""The operator's own Prometheus metrics (workers serve theirs; these say what the operator did)."""

from __future__ import annotations

from prometheus_client import Counter, start_http_server

RECONCILES = Counter("rlfleet_operator_reconciles_total", "RLJob reconciliations by result", ["result"])
OBJECT_WRITES = Counter("rlfleet_operator_object_writes_total", "Objects created or patched", ["kind", "action"])
STATUS_UPDATES = Counter("rlfleet_operator_status_updates_total", "Status refreshes by the timer", ["phase"])
TRAINER_RESTARTS = Counter("rlfleet_operator_trainer_restarts_total", "Trainer restarts from a checkpoint")
CONTROLLER_UNREACHABLE = Counter("rlfleet_operator_controller_unreachable_total",
                                 "Status refreshes where the controller did not answer")


def serve(port: int) -> None:
    start_http_server(port)
