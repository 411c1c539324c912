"""Methods added to every vLLM worker (`worker_extension_cls`): join the sync group, receive weights.

They run inside vLLM's worker process, next to the model, so weights go from the wire straight into
the model's own loaders: no disk, no engine restart.
"""

from __future__ import annotations

import time
from typing import Any

from rlfleet.workers.sync.weights import GroupAddress, WeightReceiver, layout_from_dict


class SyncExtension:
    def rlfleet_join(self, address: dict[str, Any], first_rank: int, layout: dict[str, Any]) -> None:
        # Each tensor-parallel worker is its own rank after the trainer's.
        rank = first_rank + self.rank
        self._rlfleet_receiver = WeightReceiver(
            GroupAddress(**address), rank, layout_from_dict(layout), self.model_runner.device
        )

    def rlfleet_receive(self) -> tuple[float, float]:
        start = time.perf_counter()
        weights = list(self._rlfleet_receiver.receive())
        received = time.perf_counter()
        # reload_weights goes through each parameter's weight_loader: on CPU the linear weights are
        # repacked after loading, so copying into parameters in place would not work (ENVIRONMENT.md).
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        return received - start, time.perf_counter() - received
