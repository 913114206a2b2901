{{/*
Triton's OpenAI-compatible frontend as the container's server (openaiFrontend.enabled): the
image's exspec-openai entry point runs it with an in-process tritonserver on /models.
*/}}
{{- define "exspec.openai.server" -}}
command: ["exspec-openai"]
args:
  - --model-repository=/models
  - --openai-port={{ .Values.openaiFrontend.port }}
  - --host=0.0.0.0          # the pod's address: the Service reaches it there
  {{- if .Values.openaiFrontend.kserve }}
  # the frontend's KServe ports take no restriction flags: their admin APIs are open
  - --unrestricted-kserve
  - --
  - --enable-kserve-frontends
  - --kserve-http-port=8000
  - --kserve-grpc-port=8001
  {{- end }}
ports:
  - {name: openai, containerPort: {{ .Values.openaiFrontend.port }}, protocol: TCP}
  {{- if .Values.openaiFrontend.kserve }}
  - {name: http, containerPort: 8000, protocol: TCP}
  - {name: grpc, containerPort: 8001, protocol: TCP}
  {{- end }}
{{- end -}}

{{/* Probes: the frontend's /health/ready (the server and its models are ready); it has no
liveness route, so liveness is the port accepting connections. */}}
{{- define "exspec.openai.probes" -}}
startupProbe:
  httpGet: {path: /health/ready, port: openai}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ div (add (int .Values.startupSeconds) 9) 10 }}
readinessProbe:
  httpGet: {path: /health/ready, port: openai}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
livenessProbe:
  tcpSocket: {port: openai}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}
