"""The RLFleet Kubernetes operator: pure builders (RLJob -> manifests), a CRD generator, thin kopf handlers.

Imported as `rlfleet.operator`, never as `operator` (the stdlib module of that name).
"""

GROUP = "rlfleet.io"
VERSION = "v1alpha1"
PLURAL = "rljobs"
