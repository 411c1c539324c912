"""The committed gRPC stubs equal what scripts/gen_proto.py generates from the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "proto" / "rlfleet" / "v1"


def _gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_equal_fresh_ones(tmp_path):
    sources = _gen_proto().generate(tmp_path)
    assert {s.stem for s in sources} == {p.stem for p in COMMITTED.glob("*.proto")}
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    # Each source gives a message module, its type stub and a gRPC module.
    assert len(generated) == 3 * len(sources)
    for relative in generated:
        assert relative.parts[:2] == ("rlfleet", "v1"), relative
        committed = ROOT / "proto" / relative
        assert committed.is_file(), f"{relative} is generated but not committed"
        assert committed.read_text() == (tmp_path / relative).read_text(), (
            f"{committed} is stale: run `python scripts/gen_proto.py`")
    stubs = {p.relative_to(ROOT / "proto") for p in COMMITTED.glob("*_pb2*.py*")}
    orphans = stubs - set(generated)
    assert not orphans, f"committed stubs without a .proto source: {sorted(map(str, orphans))}"
