"""`python -m rlfleet.operator`: run the operator (the chart's Deployment starts exactly this)."""

from __future__ import annotations

import argparse
import logging


class _ObjectPrefix(logging.Filter):
    """kopf tags per-object log records with the object; say which job a line is about."""

    def filter(self, record: logging.LogRecord) -> bool:
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("name") and not getattr(record, "_rlfleet_prefixed", False):
            record.msg = f"[{ref.get('namespace', '')}/{ref['name']}] {record.msg}"
            record._rlfleet_prefixed = True
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.operator", description="The RLFleet operator.")
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: every namespace")
    parser.add_argument("--peering", default=None,
                        help="ClusterKopfPeering name: replicas elect one active operator (default: standalone)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    args = parser.parse_args(argv)

    import kopf

    import rlfleet.operator.handlers  # noqa: F401 - registers the handlers with kopf
    from rlfleet.workers.logs import setup_logging

    setup_logging("operator", 0)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_ObjectPrefix())
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
