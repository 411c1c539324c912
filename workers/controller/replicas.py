"""Which replicas of an executor the controller may use, and the policy version each holds, under one lock.

The weight receivers (receivers.py) report joins, pushes and failures here; the generators' Dispatch composes this
state with the work it hands out, under the same lock (`wait_for`, `changing`), so that every change that can make a
waiting producer's next batch startable wakes it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Collection, Iterator, TypeVar

from rlfleet.workers.controller.rollouts import Stopped

T = TypeVar("T")


class ReplicaStates:
    def __init__(self, replicas: int, version: int, gaps: Collection[int] = ()):
        """`replicas` indexes, each a replica but the `gaps` (indexes between generator pools' blocks)."""
        self._versions = [version] * replicas
        self._members = [replica not in gaps for replica in range(replicas)]
        self._up = list(self._members)
        self._stopped = False
        self._cond = threading.Condition()  # reentrant: `wait_for`'s test may call the methods below

    def advance(self, replica: int, version: int) -> None:
        """`replica` acknowledged weights of `version`."""
        with self.changing():
            self._versions[replica] = max(self._versions[replica], version)

    def set_down(self, replica: int) -> bool:
        """Take `replica` out of the rotation; True if it was up. Wakes the waiters: the parts meant for it are anyone's
        now."""
        with self.changing():
            was_up, self._up[replica] = self._up[replica], False
            return was_up

    def set_up(self, replica: int, version: int) -> None:
        """`replica` rejoined and holds `version` (its old version no longer says anything)."""
        with self.changing():
            self._up[replica], self._versions[replica] = True, version

    def resize(self, members: Collection[int]) -> None:
        """The job's replicas of this executor have the indexes `members` now. Added ones start down (they are up once
        they joined and hold weights); the others leave the rotation and are no longer reported down (waking the
        waiters: the parts meant for them are anyone's now)."""
        with self.changing():
            grow = max(0, max(members, default=-1) + 1 - len(self._up))
            self._up += [False] * grow
            self._versions += [0] * grow
            self._members = [replica in members for replica in range(len(self._up))]
            self._up = [up and member for up, member in zip(self._up, self._members)]

    def members(self) -> list[int]:
        with self._cond:
            return [r for r, member in enumerate(self._members) if member]

    def up(self) -> list[int]:
        with self._cond:
            return [r for r, up in enumerate(self._up) if up]

    def down(self) -> list[int]:
        """Replicas of the job that are not up (to probe and rejoin)."""
        with self._cond:
            return [r for r, (member, up) in enumerate(zip(self._members, self._up)) if member and not up]

    def is_up(self, replica: int) -> bool:
        with self._cond:
            return self._up[replica]

    def version(self, replica: int) -> int:
        with self._cond:
            return self._versions[replica]

    def holds(self, replica: int, version: int) -> bool:
        """Whether `replica` is up with weights of `version` or newer."""
        with self._cond:
            return self._up[replica] and self._versions[replica] >= version

    def wait_for(self, ready: Callable[[], T | None]) -> T:
        """Until `ready()`, run under the lock after every change (of the replicas, or an owner's `changing`), gives
        something other than None; returns it. Raises Stopped once `stop` was called."""
        with self._cond:
            while True:
                if self._stopped:
                    raise Stopped()
                found = ready()
                if found is not None:
                    return found
                self._cond.wait()

    @contextmanager
    def changing(self) -> Iterator[None]:
        """Holds the lock while the caller changes what `wait_for`'s tests read, then wakes the waiters."""
        with self._cond:
            yield
            self._cond.notify_all()

    def stop(self) -> None:
        with self.changing():
            self._stopped = True
