"""The generator replicas a running job has now, as its runtime writes them down.

The runtime rewrites the endpoints file when generators are added or removed: the operator's ConfigMap, which
the kubelet refreshes in the trainer pod (within about a minute), or `rlfleet scale` locally. A replica keeps
its index and address for the life of the job (its pool's block and its StatefulSet ordinal, and its DNS name;
locally, its ports), so an index is only ever filled or emptied ("" in the list), never given to another replica.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlfleet.workers.plan import Endpoints

log = logging.getLogger(__name__)


class GeneratorMembers:
    def __init__(self, path: str, endpoints: Endpoints):
        self.path = path
        self.endpoints = endpoints
        self._text: str | None = None

    def changed(self) -> Endpoints | None:
        """The endpoints, when the file lists other generators than last time; else None (also without a file)."""
        if not self.path:
            return None
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except OSError:
            return None  # not written yet
        if text == self._text:
            return None
        self._text = text
        try:
            found = Endpoints.from_json(text)
        except (ValueError, TypeError) as error:
            log.warning("%s cannot be read (%s); keeping generators %s", self.path, error,
                        self.endpoints.of("generator"))
            return None
        if _generators(found) == _generators(self.endpoints):
            return None
        self.endpoints = found
        return found


def _generators(endpoints: Endpoints) -> tuple[list[str], list[str]]:
    return endpoints.of("generator"), endpoints.sync_of("generator")
