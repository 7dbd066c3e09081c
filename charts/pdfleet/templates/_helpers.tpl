{{/* Chart name, truncated to a DNS label. */}}
{{- define "pdfleet.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name of the chart's objects. */}}
{{- define "pdfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "pdfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "pdfleet.labels" -}}
helm.sh/chart: {{ include "pdfleet.chart" . }}
{{ include "pdfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels selecting the operator pod. */}}
{{- define "pdfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Namespaces watched in namespaced mode. */}}
{{- define "pdfleet.watchNamespaces" -}}
{{- if .Values.watchNamespaces }}{{ join "," .Values.watchNamespaces }}{{ else }}{{ .Release.Namespace }}{{ end }}
{{- end }}

{{/* The role bound to every gateway's ServiceAccount (pod discovery). */}}
{{- define "pdfleet.gatewayRole" -}}
{{- printf "%s-gateway" (include "pdfleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The operator's user name, as admission sees it. */}}
{{- define "pdfleet.serviceAccountUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "pdfleet.fullname" .) }}
{{- end }}

{{/* The Service in front of the operator's identity endpoint. */}}
{{- define "pdfleet.identityService" -}}
{{- printf "%s-identity" (include "pdfleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
