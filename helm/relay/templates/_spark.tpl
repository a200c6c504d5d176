{{/* The pod template of every Spark job: `relay spark <job> [args]` in local mode, scratch
     space on an emptyDir at /tmp (the root filesystem stays read-only). Call with
     (dict "root" $ "job" "resync" "args" (list ...) "volumes" (list ...) "mounts" (list ...)). */}}
{{- define "relay.sparkPod" -}}
{{- $ := .root -}}
metadata:
  labels: {{- include "relay.labels" $ | nindent 4 }}
    app.kubernetes.io/component: spark-{{ .job }}
  annotations: {{- include "relay.podAnnotations" $ | nindent 4 }}
spec:
  {{- include "relay.podCommon" $ | nindent 2 }}
  restartPolicy: Never
  containers:
    - name: spark
      image: {{ include "relay.image" $.Values.sparkImage | quote }}
      imagePullPolicy: {{ $.Values.sparkImage.pullPolicy }}
      command: ["relay"]
      args: {{ concat (list "spark" .job "--no-progress") (.args | default list) | toJson }}
      env:
        {{- include "relay.storeEnv" $ | nindent 8 }}
        - {name: HOME, value: /tmp}
        - {name: SPARK_LOCAL_DIRS, value: /tmp/spark}
        - {name: JAVA_TOOL_OPTIONS, value: "-Djava.io.tmpdir=/tmp"}
      envFrom: {{- include "relay.envFrom" $ | nindent 8 }}
      securityContext: {{- include "relay.containerSecurityContext" $ | nindent 8 }}
      resources: {{- toYaml $.Values.spark.resources | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        {{- with .mounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {sizeLimit: {{ $.Values.spark.scratchSizeLimit }}}
    {{- with .volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
