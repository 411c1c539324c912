"""Every executor kind RLFleet runs, in one table: the planner, `rlfleet run`, `rlfleet worker`, the metrics, the
storage mounts and the operator read it. A new kind is a package (its config beside it, its `main(ctx)`), its section
in spec.Roles, and one entry here: the planner lists its replicas in plan.Endpoints under its role, and plans their
sync stores on trainer rank 0 when it receives_weights; one that works on every batch names its controller-side stage.

Torch-free, plain data: the schema, the operator and the CLI's --help import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# What a worker's executor clock charges when it waits for work (or, for the trainer, its own reasons).
SERVING = ("waiting_for_requests",)
RECEIVING = ("loading_weights", "receiving_weights", "waiting_for_requests")


@dataclass(frozen=True)
class ExecutorKind:
    role: str
    """Its id: names its Kubernetes objects (<job>-<role>, and the StatefulSet's revision label <job>-<role>-<hash>,
    at most 63 characters for a 42-character job), so at most 9 lower-case letters."""
    spec_field: str
    """Its section of spec.roles; None there means a job does not run this optional kind."""
    main: str
    """The module whose main(WorkerContext) runs one worker of it (`worker_main` imports it when a worker starts)."""
    idle_reasons: tuple[str, ...]
    """Its idle reasons by priority (docs/metrics.md)."""
    short: str
    """Its name in the console's bubble line."""
    reads_model: bool = False
    """Whether its workers load the policy model (fetched for it from model.uri)."""
    keeps_state: bool = False
    """Whether its pods write lasting state (checkpoints) to their run directory: a volume that outlives the pod."""
    computes: bool = False
    """Whether its workers run a model (on CPU, `rlfleet run` gives each cores of its own: workers/cores.py)."""
    ranked: bool = False
    """Whether its pods run ranksPerPod processes of one torch.distributed world (its spec section a RankedRole):
    each pod's process starts its ranks, and pod 0 also hosts the world's rendezvous (the dist port)."""
    receives_weights: bool = False
    """Whether the trainers push it the policy's weights (DDMA), each replica over a sync group of its own whose store
    trainer rank 0 hosts."""
    sync_port: str = ""
    """A receiving kind's name for replica r's sync store port on trainer rank 0: sync_port + r."""
    sync_port_base: int = 0
    """In a pod, replica r's sync store listens on sync_port_base + r (r < 1024, what replicas allows): a range clear
    of every other kind's and of the fixed ports (plan.py)."""
    serves_http: bool = False
    """Whether its workers also serve HTTP on their http port (the generators' OpenAI-compatible endpoint:
    generator/openai_api.py); plan.Endpoints lists those servers under its role too."""
    stage: str | None = None
    """"module:Class" of its controller/stages.py Stage, which every batch of a job that runs it goes through
    between generation and training (in this table's order, after guidance unless it scores); None: no stage."""


KINDS = (
    ExecutorKind("scorer", "scorer", "rlfleet.workers.scorer.main", SERVING, "score",
                 stage="rlfleet.workers.scorer.stage:RuleScoring"),
    ExecutorKind("reward", "reward_model", "rlfleet.workers.reward_model.main", SERVING, "reward", computes=True,
                 stage="rlfleet.workers.reward_model.stage:RewardModelScoring"),
    ExecutorKind("generator", "generator", "rlfleet.workers.generator.main", RECEIVING, "gen", reads_model=True,
                 computes=True, receives_weights=True, sync_port="sync", sync_port_base=29600, serves_http=True),
    ExecutorKind("reference", "reference", "rlfleet.workers.reference.main", RECEIVING, "ref", reads_model=True,
                 computes=True, receives_weights=True, sync_port="refsync", sync_port_base=28000,
                 stage="rlfleet.workers.reference.stage:ReferencePolicy"),
    ExecutorKind("critic", "critic", "rlfleet.workers.critic.main", ("checkpointing",) + SERVING, "critic",
                 reads_model=True, computes=True, keeps_state=True, ranked=True,
                 stage="rlfleet.workers.critic.stage:CriticLink"),
    ExecutorKind("env", "environment", "rlfleet.workers.environment.main", SERVING, "env", reads_model=True,
                 stage="rlfleet.workers.environment.stage:Episodes"),
    ExecutorKind("trainer", "trainer", "rlfleet.workers.trainer.main",
                 ("checkpointing", "waiting_for_weights", "waiting_for_rollouts", "waiting_for_rank0", "bookkeeping",
                  "waiting_for_eval"), "train", reads_model=True, computes=True, keeps_state=True, ranked=True),
    # A standby waits to lead; the leader is busy. It reads the model's tokenizer and config, never its weights.
    ExecutorKind("control", "controller", "rlfleet.workers.controller.main", ("standing_by",), "ctl",
                 reads_model=True, keeps_state=True),
)
"""In the order `rlfleet run` starts them: the trainer, which waits for every other, then the controller (its own
executor only in a job with spec.roles.controller; else the trainer hosts it), last."""
BY_ROLE = {kind.role: kind for kind in KINDS}
ROLES = tuple(BY_ROLE)


def worker_main(role: str) -> Callable[[Any], None]:
    """The main(WorkerContext) that runs one worker of `role`, imported now: the table names its module, not the
    function, so that reading the table imports none of the workers' packages (torch, vLLM)."""
    return importlib.import_module(BY_ROLE[role].main).main
