"""The check of a job's data that `rlfleet validate` and `rlfleet run` make before any worker starts: a file the job
cannot train on is refused naming its line and field, not by a traceback from the controller once the run is up."""

from __future__ import annotations

import itertools

from rlfleet.workers.data.tasks import DataError, task_for
from rlfleet.workers.scorer.rules import reference_number
from rlfleet.workers.spec import RLJob


def check_data(job: RLJob) -> None:
    """Raise DataError where the controller would: a file that does not open, a line (or Parquet row) that is not a
    JSON object, lacks the prompt or answer field or gives a malformed chat, a heldOut that leaves nothing to train
    on (every line is read, as the controller reads them); and a user file's reference answer that is no plain number
    while the job weighs math_answer, which would score every completion of it 0."""
    data = job.spec.data
    task = task_for(data)
    if data.type != "jsonl" or not any(s.type == "math_answer" and s.weight for s in job.spec.scorers):
        return
    for example in itertools.chain(itertools.islice(task.train(), task.train_size), task.held_out()):
        if reference_number(example.answer) is None:
            where = example.id.replace("-", " ", 1)
            raise DataError(f"{data.uri or data.path} {where}: field {data.answer_field!r} is {example.answer[:80]!r}, "
                            "not a plain number, so math_answer would score every completion of it 0: grade LaTeX "
                            "answers with {type: math_verify}, or give math_answer weight 0")
