"""The Kubernetes "restricted" Pod Security Standard as a checker of pod templates, for tests.

Restricted includes baseline; both are checked. Rules as the Pod Security Standards page states them
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, Kubernetes 1.30-1.35); a pod that
passes here would be admitted to a namespace labelled `pod-security.kubernetes.io/enforce: restricted`.
"""

from __future__ import annotations

from typing import Any

CONTAINER_KINDS = ("initContainers", "containers", "ephemeralContainers")
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                "secret"}
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}
APPARMOR_TYPES = {"RuntimeDefault", "Localhost"}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def restricted_violations(template: dict[str, Any]) -> list[str]:
    """Every rule of the restricted profile the pod template ({metadata, spec}) breaks; [] when it passes."""
    pod = template["spec"]
    pod_context = pod.get("securityContext") or {}
    problems = [f"{key} is true" for key in HOST_NAMESPACES if pod.get(key)]
    problems += _volume_problems(pod.get("volumes") or [])
    problems += [f"sysctl {s['name']} is not a safe sysctl" for s in pod_context.get("sysctls") or []
                 if s["name"] not in SAFE_SYSCTLS]
    problems += [f"pod {p}" for p in _context_problems(pod_context)]
    for name, value in ((template.get("metadata") or {}).get("annotations") or {}).items():
        if name.startswith(APPARMOR_ANNOTATION) and not (value == "runtime/default" or value.startswith("localhost/")):
            problems.append(f"annotation {name}: AppArmor profile {value!r}")
    for kind in CONTAINER_KINDS:
        for container in pod.get(kind) or []:
            where = f"{kind}[{container['name']}]"
            problems += [f"{where} {p}" for p in _container_problems(container, pod_context)]
    return problems


def _volume_problems(volumes: list[dict[str, Any]]) -> list[str]:
    problems = []
    for volume in volumes:
        kinds = set(volume) - {"name"}
        if not kinds <= VOLUME_TYPES:
            problems.append(f"volume {volume['name']} is of a type restricted forbids: {sorted(kinds - VOLUME_TYPES)}")
    return problems


def _context_problems(context: dict[str, Any]) -> list[str]:
    """Rules that apply alike to a pod's and a container's securityContext."""
    problems = []
    if context.get("runAsUser") == 0:
        problems.append("runAsUser is 0")
    if (context.get("windowsOptions") or {}).get("hostProcess"):
        problems.append("is a Windows HostProcess")
    seccomp = (context.get("seccompProfile") or {}).get("type")
    if seccomp is not None and seccomp not in SECCOMP_TYPES:
        problems.append(f"seccompProfile {seccomp}")
    apparmor = (context.get("appArmorProfile") or {}).get("type")
    if apparmor is not None and apparmor not in APPARMOR_TYPES:
        problems.append(f"appArmorProfile {apparmor}")
    selinux = context.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        problems.append(f"seLinuxOptions {selinux}")
    return problems


def _container_problems(container: dict[str, Any], pod_context: dict[str, Any]) -> list[str]:
    context = container.get("securityContext") or {}
    problems = _context_problems(context)
    if context.get("privileged"):
        problems.append("is privileged")
    if context.get("allowPrivilegeEscalation") is not False:
        problems.append("does not set allowPrivilegeEscalation: false")
    # Container settings override the pod's: each container must end up non-root and seccomp-confined.
    if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
        problems.append("does not run as non-root (runAsNonRoot: true on the pod or the container)")
    seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
    if seccomp not in SECCOMP_TYPES:
        problems.append("has no seccompProfile RuntimeDefault or Localhost (on the pod or the container)")
    capabilities = context.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or []):
        problems.append("does not drop ALL capabilities")
    added = set(capabilities.get("add") or []) - ADDABLE_CAPABILITIES
    if added:
        problems.append(f"adds capabilities {sorted(added)}")
    if context.get("procMount", "Default") != "Default":
        problems.append(f"procMount {context['procMount']}")
    problems += [f"port {p.get('name', p['containerPort'])} has hostPort {p['hostPort']}"
                 for p in container.get("ports") or [] if p.get("hostPort")]
    return problems


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`Kind/name` -> pod template of every workload among objects (bare pods count as their own template)."""
    found = {}
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "Pod":
            found[name] = {"metadata": obj["metadata"], "spec": obj["spec"]}
        elif obj["kind"] == "CronJob":
            found[name] = obj["spec"]["jobTemplate"]["spec"]["template"]
        elif "template" in (obj.get("spec") or {}) and "spec" in obj["spec"]["template"]:
            found[name] = obj["spec"]["template"]
    return found
