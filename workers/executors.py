"""Every executor kind RLFleet runs, in one table: the planner, `rlfleet run`, `rlfleet worker`, the metrics, the
storage mounts and the operator read it. A new kind is a package (its config beside it, its `main(ctx)`), its section
in spec.Roles, and one entry here (with, for one that works on every batch, its controller-side stage).

Torch-free, plain data: the schema, the operator and the CLI's --help import it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """The module whose main(WorkerContext) runs one worker of it."""
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
    stage: str | None = None
    """"module:Class" of its controller/stages.py Stage, which every batch of a job that runs it goes through
    between generation and training (in this table's order, after guidance unless it scores); None: no stage."""


KINDS = (
    ExecutorKind("scorer", "scorer", "rlfleet.workers.scorer.main", SERVING, "score",
                 stage="rlfleet.workers.scorer.stage:RuleScoring"),
    ExecutorKind("reward", "reward_model", "rlfleet.workers.reward_model.main", SERVING, "reward", computes=True,
                 stage="rlfleet.workers.reward_model.stage:RewardModelScoring"),
    ExecutorKind("generator", "generator", "rlfleet.workers.generator.main", RECEIVING, "gen", reads_model=True,
                 computes=True),
    ExecutorKind("reference", "reference", "rlfleet.workers.reference.main", RECEIVING, "ref", reads_model=True,
                 computes=True, stage="rlfleet.workers.reference.stage:ReferencePolicy"),
    ExecutorKind("critic", "critic", "rlfleet.workers.critic.main", ("checkpointing",) + SERVING, "critic",
                 reads_model=True, computes=True, keeps_state=True, ranked=True,
                 stage="rlfleet.workers.critic.stage:CriticLink"),
    ExecutorKind("trainer", "trainer", "rlfleet.workers.trainer.main",
                 ("checkpointing", "waiting_for_weights", "waiting_for_rollouts", "waiting_for_rank0", "bookkeeping",
                  "waiting_for_eval"), "train", reads_model=True, computes=True, keeps_state=True, ranked=True),
)
"""In the order `rlfleet run` starts them: the trainer, which hosts the controller and waits for every other, last."""
BY_ROLE = {kind.role: kind for kind in KINDS}
ROLES = tuple(BY_ROLE)
