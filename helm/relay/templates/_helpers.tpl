{{/* Names ------------------------------------------------------------------------------- */}}
{{- define "relay.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "relay.selectorLabels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "relay.labels" -}}
{{ include "relay.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "relay.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "relay.fullname" .)) -}}
{{- end -}}

{{- define "relay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "relay.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "relay.image" -}}
{{- printf "%s:%s" .repository (.tag | toString) -}}
{{- end -}}

{{/* Environment shared by every relay container: secrets by reference, the rest from the
     ConfigMap (every RELAY_* setting of relay/config.py is a key of .Values.config).
     "relay.storeEnv" (the Spark jobs) has the database and Redis but not the admin token, which
     only the ingest and fan-out serve; "relay.env" (ingest, fan-out) adds it. */}}
{{- define "relay.storeEnv" -}}
- name: RELAY_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "relay.secretName" . }}
      key: {{ .Values.secrets.keys.databaseUrl }}
- name: RELAY_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "relay.secretName" . }}
      key: {{ .Values.secrets.keys.redisUrl }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "relay.env" -}}
- name: RELAY_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "relay.secretName" . }}
      key: {{ .Values.secrets.keys.adminToken }}
{{ include "relay.storeEnv" . }}
{{- end -}}

{{/* A workload's affinity: its own `affinity` when given; otherwise, with `podAntiAffinity`
     "preferred" or "required", its pods spread over nodes (kubernetes.io/hostname). Call with
     (dict "root" $ "component" "fanout" "values" .Values.fanout). */}}
{{- define "relay.affinity" -}}
{{- $ := .root -}}
{{- $v := .values -}}
{{- if $v.affinity }}
affinity: {{- toYaml $v.affinity | nindent 2 }}
{{- else if eq ($v.podAntiAffinity | default "") "preferred" }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels: {{- include "relay.selectorLabels" $ | nindent 14 }}
              app.kubernetes.io/component: {{ .component }}
{{- else if eq ($v.podAntiAffinity | default "") "required" }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels: {{- include "relay.selectorLabels" $ | nindent 12 }}
            app.kubernetes.io/component: {{ .component }}
{{- else if $v.podAntiAffinity }}
{{- fail (printf "%s.podAntiAffinity must be preferred, required or empty (got %q)" .component $v.podAntiAffinity) }}
{{- end }}
{{- end -}}

{{- define "relay.envFrom" -}}
- configMapRef:
    name: {{ include "relay.fullname" . }}-config
{{- end -}}

{{/* Probes. startupProbe: the HTTP port opens before the service starts, so this only covers
     the interpreter starting. liveness: /_health never asks PostgreSQL or Redis, and answers 200
     in every phase (a standby waiting for the writer lease included). readiness: /_ready is 503
     while starting, in standby, or while the store / sequencer / Redis is unavailable. */}}
{{- define "relay.probes" -}}
startupProbe:
  httpGet: {path: /_health, port: http}
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
  timeoutSeconds: 3
livenessProbe:
  httpGet: {path: /_health, port: http}
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
readinessProbe:
  httpGet: {path: /_ready, port: http}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
{{- end -}}

{{- define "relay.podSecurityContext" -}}
{{ toYaml .Values.podSecurityContext }}
{{- end -}}

{{- define "relay.containerSecurityContext" -}}
{{ toYaml .Values.containerSecurityContext }}
{{- end -}}

{{/* Pod-level settings shared by every workload. */}}
{{- define "relay.podCommon" -}}
serviceAccountName: {{ include "relay.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext: {{- include "relay.podSecurityContext" . | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{- define "relay.podAnnotations" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if not .Values.secrets.existingSecret }}
checksum/secret-values: {{ printf "%s|%s|%s" .Values.secrets.databaseUrl .Values.secrets.redisUrl .Values.secrets.adminToken | sha256sum }}
{{- end }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}
