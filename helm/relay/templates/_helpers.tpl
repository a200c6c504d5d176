{{- define "relay.fullname" -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}

{{- define "relay.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* Environment shared by every relay container. */}}
{{- define "relay.env" -}}
- name: RELAY_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.database.existingSecret | default (printf "%s-secrets" (include "relay.fullname" .)) }}
      key: {{ .Values.database.secretKey }}
- name: RELAY_REDIS_URL
  value: {{ .Values.redis.url | quote }}
- name: RELAY_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.adminToken.existingSecret | default (printf "%s-secrets" (include "relay.fullname" .)) }}
      key: {{ .Values.adminToken.secretKey }}
      optional: true
{{- range $k, $v := .Values.config }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{- define "relay.probes" -}}
readinessProbe:
  httpGet: {path: /_health, port: http}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet: {path: /_health, port: http}
  initialDelaySeconds: 20
  periodSeconds: 15
  failureThreshold: 4
{{- end -}}
