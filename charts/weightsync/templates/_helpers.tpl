{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "weightsync.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name: the prefix of every resource name. A release already named
after the chart is not repeated ("weightsync", not "weightsync-weightsync").
*/}}
{{- define "weightsync.fullname" -}}
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

{{/* `name-suffix`, kept within 63 characters. Call with (list . "suffix"). */}}
{{- define "weightsync.suffixed" -}}
{{- $root := index . 0 }}
{{- $suffix := index . 1 }}
{{- printf "%s-%s" (include "weightsync.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix }}
{{- end }}

{{- define "weightsync.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object the chart creates. */}}
{{- define "weightsync.labels" -}}
app.kubernetes.io/name: {{ include "weightsync.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "weightsync.releaseLabels" . }}
{{- end }}

{{/* The labels that say which chart and release made an object (no selector labels). */}}
{{- define "weightsync.releaseLabels" -}}
helm.sh/chart: {{ include "weightsync.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: weightsync
{{- end }}

{{/* Selects the operator's pods. Immutable once installed: never add to it. */}}
{{- define "weightsync.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightsync.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "weightsync.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "weightsync.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* `repository:tag` or `repository@digest`; the tag defaults to appVersion. Call with (list . .Values.image). */}}
{{- define "weightsync.image" -}}
{{- $root := index . 0 }}
{{- $image := index . 1 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{- define "weightsync.webhookServiceName" -}}
{{- include "weightsync.suffixed" (list . "webhook") }}
{{- end }}

{{- define "weightsync.metricsServiceName" -}}
{{- include "weightsync.suffixed" (list . "metrics") }}
{{- end }}

{{/* The Mutating/ValidatingWebhookConfiguration the operator manages (cluster-scoped). */}}
{{- define "weightsync.webhookConfigurationName" -}}
{{- default (printf "%s.weightsync.io" (include "weightsync.fullname" .)) .Values.webhook.configurationName }}
{{- end }}

{{/* The Secret with the webhook's serving certificate: cert-manager's, or the operator's own. */}}
{{- define "weightsync.webhookCertSecretName" -}}
{{- if .Values.certManager.enabled }}
{{- include "weightsync.suffixed" (list . "webhook-tls") }}
{{- else }}
{{- default (include "weightsync.suffixed" (list . "webhook-certs")) .Values.webhook.certSecretName }}
{{- end }}
{{- end }}

{{- define "weightsync.issuerName" -}}
{{- include "weightsync.suffixed" (list . "selfsigned") }}
{{- end }}

{{/* Whether the Prometheus Operator's API is served: monitors and rules are rendered only then. */}}
{{- define "weightsync.hasMonitoringAPI" -}}
{{- $api := .Values.metrics.monitoringAPI }}
{{- if or (eq $api "present") (and (eq $api "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) }}true{{ end }}
{{- end }}

{{/* The label the webhook puts on every pod it injects an agent into (value: the WeightSync). */}}
{{- define "weightsync.syncLabel" -}}
weightsync.io/sync
{{- end }}

{{/* Invalid combinations fail the render with a message instead of a broken install. */}}
{{- define "weightsync.validate" -}}
{{- if and .Values.certManager.enabled .Values.webhook.url }}
{{- fail "certManager.enabled needs Service mode: its certificate names the webhook Service, not webhook.url; unset one of them" }}
{{- end }}
{{- if and .Values.webhook.url (gt (int .Values.operator.replicas) 1) }}
{{- fail "webhook.url names one pod: with operator.replicas above 1 use Service mode (unset webhook.url) or set operator.replicas=1" }}
{{- end }}
{{- end }}

{{/* The Lease the operator's replicas elect their leader with (release namespace). */}}
{{- define "weightsync.leaderLeaseName" -}}
{{- include "weightsync.suffixed" (list . "leader") }}
{{- end }}

{{/* The Secret with the key the agents' tokens are derived from (created by the operator). */}}
{{- define "weightsync.tokenKeySecretName" -}}
{{- include "weightsync.suffixed" (list . "token-key") }}
{{- end }}
