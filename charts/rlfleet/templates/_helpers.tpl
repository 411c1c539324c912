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
