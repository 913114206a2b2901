{{/* Names and labels. */}}
{{- define "exspec.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "exspec.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "exspec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "exspec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "exspec.labels" -}}
{{ include "exspec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
Shutdown timing, all derived from two knobs so they cannot disagree:
  t = 0              preStop creates the drain file: the model refuses new requests and its
                     drain deadline (drainTimeout = longestStreamSeconds) starts;
  t = preStop        the kubelet sends SIGTERM: Triton refuses new requests and waits for open
                     streams, up to exitTimeout;
  t = drainTimeout   the model ends what is still running with an UNAVAILABLE error;
  t = preStop + exitTimeout   Triton exits at the latest (exitTimeout leaves 15 s after the
                     drain deadline for the last responses and finalize);
  grace = preStop + exitTimeout + 5 s, after which the kubelet would SIGKILL.
*/}}
{{- define "exspec.drainTimeout" -}}
{{- .Values.longestStreamSeconds | int -}}
{{- end -}}

{{- define "exspec.exitTimeout" -}}
{{- add (max 0 (sub (int .Values.longestStreamSeconds) (int .Values.drain.preStopSeconds))) 15 -}}
{{- end -}}

{{- define "exspec.terminationGrace" -}}
{{- add (int .Values.drain.preStopSeconds) (include "exspec.exitTimeout" . | int) 5 -}}
{{- end -}}

{{/* GPUs a pod asks for: none on the CPU. */}}
{{- define "exspec.gpuLimit" -}}
{{- if eq .Values.model.placement "cpu" -}}0{{- else -}}{{ .Values.model.gpus | int }}{{- end -}}
{{- end -}}

{{/* model.json: the engine values, plus the placement's device settings. */}}
{{- define "exspec.modelJson" -}}
{{- $engine := deepCopy .Values.model.engine -}}
{{- if eq .Values.model.placement "multi-gpu" -}}
{{- $_ := set $engine "device" "cuda:0" -}}
{{- if .Values.model.deviceMap -}}
{{- $_ := set $engine "device_map" .Values.model.deviceMap -}}
{{- end -}}
{{- end -}}
{{- toPrettyJson $engine -}}
{{- end -}}

{{/* Fast up (double, or +2 pods, every 30 s), slow down (one pod per 5 minutes, after a
stable window): a new pod needs minutes to load, and an idle one costs only money. */}}
{{- define "exspec.scalingBehavior" -}}
scaleUp:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleUpStabilizationSeconds }}
  selectPolicy: Max
  policies:
    - {type: Percent, value: 100, periodSeconds: 30}
    - {type: Pods, value: 2, periodSeconds: 30}
scaleDown:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleDownStabilizationSeconds }}
  selectPolicy: Min
  policies:
    - {type: Pods, value: 1, periodSeconds: 300}
{{- end -}}

{{/* Admin key: Triton's API groups other than health, metadata and inference, and the Secret
that holds the key (the operator's, or the one the chart generates). */}}
{{- define "exspec.restrictedApis" -}}
shared-memory,model-config,model-repository,statistics,trace,logging
{{- end -}}

{{- define "exspec.adminSecretName" -}}
{{- .Values.adminApi.existingSecret | default (printf "%s-admin-key" (include "exspec.fullname" .)) -}}
{{- end -}}
