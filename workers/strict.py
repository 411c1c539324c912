"""The base of every RLJob section, apart from spec.py so that each component's own config module (beside the
component, torch-free) can use it without importing the whole schema."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# torch.manual_seed takes a 64-bit integer; 32 bits leave room for the per-batch seeds derived from it.
MAX_SEED = 2**32 - 1


class Strict(BaseModel):
    """Base of every spec section: camelCase in YAML, unknown fields refused."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True, strict=True
    )
