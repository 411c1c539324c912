"""Create-or-patch, idempotent: create when absent, else JSON-patch only what differs from the live object.

Each owned part (labels, ownerReferences, each spec field, data) is replaced whole, so a key removed from the
job (a nodeSelector entry, a GPU request) disappears too; a merge patch would leave it behind.

Only the job's own objects are patched: one at the name that another owner controls (or none: made by hand, say
a namespace's deny NetworkPolicy) is never patched nor adopted (`NotOwned`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlfleet.operator.kube import ApiError, Kube, collection_path, object_path

# The API server refuses changes to these; they are set at creation and left alone afterwards.
IMMUTABLE = {
    "StatefulSet": {"selector", "serviceName", "volumeClaimTemplates", "podManagementPolicy"},
    "Service": {"clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"},
}
SKIPPED = {"apiVersion", "kind", "metadata", "status"}
# Created once and then left alone: a job's token Secret (a new token would lock out the running workers, which
# read theirs at start; the Secret is immutable too, and the operator needs no patch right on Secrets), its
# Kueue Workload (Kueue refuses changes to the pod sets it reserved quota for), and its controllers' Lease (its
# holder and epoch are theirs to write).
CREATE_ONLY = {"Secret", "Workload", "Lease"}


def owned(obj: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    """obj with owner as its controlling owner, so deleting the owner deletes it (garbage collection)."""
    meta = owner["metadata"]
    reference = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return obj | {"metadata": obj["metadata"] | {"ownerReferences": [reference]}}


def covers(live: Any, desired: Any) -> bool:
    """True if live already holds desired (live may carry more: server defaults, others' keys)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and covers(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(covers, live, desired))
    return live == desired


def patch_ops(desired: dict[str, Any], live: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON-patch operations that bring live's owned parts to desired; [] when nothing differs."""
    ops = []
    for key in ("labels", "ownerReferences"):
        if key in desired["metadata"] and not covers(live["metadata"].get(key), desired["metadata"][key]):
            ops.append({"op": "add", "path": f"/metadata/{key}", "value": desired["metadata"][key]})
    ops += _annotation_ops(desired["metadata"].get("annotations", {}), live["metadata"].get("annotations"))
    frozen = IMMUTABLE.get(desired["kind"], set())
    for section, value in desired.items():
        if section in SKIPPED:
            continue
        if section == "spec":
            for key, part in value.items():
                if key not in frozen and not covers(live.get("spec", {}).get(key), part):
                    ops.append({"op": "add", "path": f"/spec/{key}", "value": part})
        elif not covers(live.get(section), value):
            ops.append({"op": "add", "path": f"/{section}", "value": value})
    return ops


def _annotation_ops(desired: dict[str, str], live: dict[str, str] | None) -> list[dict[str, Any]]:
    """The job's annotations, key by key: others' (kubectl's, a tool's) stay."""
    if not desired or covers(live, desired):
        return []
    if live is None:
        return [{"op": "add", "path": "/metadata/annotations", "value": desired}]
    return [{"op": "add", "path": f"/metadata/annotations/{key.replace('~', '~0').replace('/', '~1')}", "value": value}
            for key, value in desired.items() if live.get(key) != value]


class NotOwned(Exception):
    """An object at a name the job needs belongs to someone else; the message says which and whose."""


def not_ours(live: dict[str, Any], desired: dict[str, Any]) -> str | None:
    """Why `live` may not be written for desired's owner (the job), naming who controls it; None if it is the job's."""
    references = live["metadata"].get("ownerReferences") or []
    if any(ref.get("uid") == desired["metadata"]["ownerReferences"][0]["uid"] for ref in references):
        return None
    holder = next((ref for ref in references if ref.get("controller")), references[0] if references else None)
    who = f"{holder.get('kind')} {holder.get('name')} (uid {holder.get('uid')})" if holder else "no owner (made by hand)"
    return (f"{desired['kind']} {desired['metadata']['name']} exists and is controlled by {who}, not this RLJob: it "
            "is left as it is; rename the job or remove that object")


async def refuse_others(kube: Kube, objects: list[dict[str, Any]]) -> None:
    """Before writing anything: NotOwned, naming every one of `objects` (owned ones) that exists and is not ours."""
    problems = []
    for desired in objects:
        live = await kube.get(object_path(desired))
        problem = not_ours(live, desired) if live is not None else None
        if problem:
            problems.append(problem)
    if problems:
        raise NotOwned("; ".join(problems))


@dataclass(frozen=True)
class Applied:
    action: str
    """created, patched or unchanged."""
    before: dict[str, Any] | None
    """The live object before the patch (None if created)."""


async def apply(kube: Kube, desired: dict[str, Any]) -> Applied:
    """Create desired, or patch the parts of the live object that differ (NotOwned if it is not desired's owner's)."""
    path = object_path(desired)
    live = await kube.get(path)
    if live is None:
        try:
            meta = desired["metadata"]
            await kube.create(collection_path(desired["apiVersion"], desired["kind"], meta["namespace"]), desired)
            return Applied("created", None)
        except ApiError as error:
            if error.status != 409:
                raise
            # Created meanwhile (handlers run again on replays and restarts): patch it instead.
            live = await kube.get(path)
            if live is None:
                raise
    problem = not_ours(live, desired)
    if problem:
        raise NotOwned(problem)
    ops = [] if desired["kind"] in CREATE_ONLY else patch_ops(desired, live)
    if not ops:
        return Applied("unchanged", live)
    await kube.json_patch(path, ops)
    return Applied("patched", live)
