"""Methods added to every vLLM worker (`worker_extension_cls`): join the sync group, receive, load.

They run inside vLLM's worker process, next to the model, so shards go from the wire straight into
the model's own weight loaders: no disk, no engine restart.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rlfleet.workers.sync.receiving import AdapterReceiver, receiver_for

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class SyncExtension:
    def rlfleet_join(self, join: dict[str, Any]) -> None:
        config = self.model_runner.model_config
        self._rlfleet_receiver = receiver_for(join, self.rank, config.get_vocab_size(), self.model_runner.device,
                                              config.model, config.dtype)
        if isinstance(self._rlfleet_receiver, AdapterReceiver):
            # Adapter pushes load only the adapted layers; vLLM warns about every other layer on every load
            # (they keep their weights, which is what is meant).
            logging.getLogger(RELOAD_LOGGER).setLevel(logging.ERROR)

    def rlfleet_receive(self) -> float:
        start = time.perf_counter()
        self._rlfleet_receiver.receive()
        return time.perf_counter() - start

    def rlfleet_load(self) -> float:
        start = time.perf_counter()
        # reload_weights goes through each parameter's weight_loader, which narrows the HF-shaped tensor
        # to this rank's region (and fuses q/k/v, gate/up); the receiver holds only that region, behind
        # HF-shaped LoaderViews (sync/receiving.py). On CPU the linear weights are repacked after loading,
        # so copying into parameters in place would not work (ENVIRONMENT.md).
        self.model_runner.reload_weights(weights_iterator=self._rlfleet_receiver.weights())
        return time.perf_counter() - start
