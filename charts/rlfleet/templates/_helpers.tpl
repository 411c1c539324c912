{{/* Chart name, overridable. */}}
{{- define "rlfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart> unless the release name already holds the chart name. */}}
{{- define "rlfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rlfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "rlfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rlfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "rlfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rlfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* One image for the operator and the workers: repository:tag, the tag defaulting to <appVersion>-<variant>. */}}
{{- define "rlfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) .Values.image.tag) }}
{{- end }}

{{/* What the operator does to jobs and their objects, in the namespaces it watches (a ClusterRole's rules, or each
namespace's Role's). */}}
{{- define "rlfleet.jobRules" -}}
# Jobs: watched; kopf keeps its progress and last-handled spec in annotations.
- apiGroups: ["rlfleet.io"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["rlfleet.io"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch"]
# ownerReferences with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: ["rlfleet.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
# What each job owns: created, then patched when the job changes (deleted by garbage collection).
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
# Each job's gRPC token Secret: created once, never patched (running workers hold the token); read to call
# the job's controller for its progress.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# Jobs queued in Kueue (the kueue.x-k8s.io/queue-name label): their Workload, created once, made inactive
# while suspended, told when the job finished or was stopped after an eviction.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
# Pods: read for the status (stuck, failed, finished); trainer pods deleted to restart from a checkpoint.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# Jobs whose controller is an executor of its own (spec.roles.controller): their controller pods' ServiceAccount, and
# their Lease, and a Role and RoleBinding that let those pods elect a leader by it. The Lease is created with the job
# and read to find the leader; update is here because a Role can grant only rights its creator holds.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "update"]
{{- end }}
