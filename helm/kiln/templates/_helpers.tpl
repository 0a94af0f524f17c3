{{/*
Names. Kubernetes names are at most 63 characters; the longest suffix added to the full name
here is "-worker-" plus a pool name, so the full name stops at 40.
*/}}
{{- define "kiln.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "kiln.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kiln.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: stable for the life of a release, so never the chart or app version (a
Deployment's selector cannot change, and an upgrade would fail).
Call with (dict "root" $ "component" "api").
*/}}
{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kiln.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The standard labels on every object. Call with (dict "root" $ "component" "api"). */}}
{{- define "kiln.labels" -}}
{{ include "kiln.selectorLabels" . }}
app.kubernetes.io/part-of: kiln
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ include "kiln.chart" .root }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one worker pool: the component plus the pool's name. */}}
{{- define "kiln.workerSelectorLabels" -}}
{{ include "kiln.selectorLabels" (dict "root" .root "component" "worker") }}
kiln.dev/worker-pool: {{ .pool.name }}
{{- end }}

{{- define "kiln.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kiln.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kiln.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kiln.cudaImage" -}}
{{- $repository := default .Values.image.repository .Values.gpuWorkers.image.repository }}
{{- printf "%s:%s" $repository (default (printf "%s-cuda" .Chart.AppVersion) .Values.gpuWorkers.image.tag) }}
{{- end }}

{{- define "kiln.redisServiceName" -}}
{{- printf "%s-redis" (include "kiln.fullname" .) }}
{{- end }}

{{- define "kiln.runtimeServiceName" -}}
{{- printf "%s-runtime" (include "kiln.fullname" .) }}
{{- end }}

{{- define "kiln.storeClaimName" -}}
{{- default (printf "%s-store" (include "kiln.fullname" .)) .Values.artifactStore.pvc.existingClaim }}
{{- end }}

{{/* Fail early on value combinations the schema cannot express. */}}
{{- define "kiln.validate" -}}
{{- if and .Values.redis.enabled (or .Values.redis.url .Values.redis.existingSecret) }}
{{- fail "redis: set either redis.enabled=true (in-chart Redis) or redis.url / redis.existingSecret (external Redis), not both" }}
{{- end }}
{{- if and (not .Values.redis.enabled) (not .Values.redis.url) (not .Values.redis.existingSecret) }}
{{- fail "redis: with redis.enabled=false, name the external Redis with redis.existingSecret (a Secret holding its URL) or redis.url" }}
{{- end }}
{{- if le (int .Values.compile.hardTimeLimit) (int .Values.compile.softTimeLimit) }}
{{- fail "compile.hardTimeLimit must be greater than compile.softTimeLimit" }}
{{- end }}
{{- end }}

{{/*
The worker pools as JSON {"pools": [...]}: every CPU pool with cpuWorkers' defaults under its
own keys, then the GPU pool when enabled. One list, so the Deployments, HPAs and PDBs of the
workers come from the same loop.
*/}}
{{- define "kiln.workerPools" -}}
{{- $pools := list }}
{{- $defaults := omit .Values.cpuWorkers "pools" }}
{{- range .Values.cpuWorkers.pools }}
{{- $pool := mergeOverwrite (deepCopy $defaults) (deepCopy .) }}
{{- $_ := set $pool "gpu" false }}
{{- $_ := set $pool "image" (include "kiln.image" $) }}
{{- $pools = append $pools $pool }}
{{- end }}
{{- if .Values.gpuWorkers.enabled }}
{{- $pool := omit (deepCopy .Values.gpuWorkers) "enabled" "arch" "image" }}
{{- $_ := set $pool "name" "gpu" }}
{{- $_ := set $pool "gpu" true }}
{{- $_ := set $pool "image" (include "kiln.cudaImage" .) }}
{{- $_ := set $pool "queues" (list (printf "cuda.%s" .Values.gpuWorkers.arch) (printf "cuda.%s.gpu" .Values.gpuWorkers.arch)) }}
{{- /* One job at a time: a job owns the GPU's context while it measures kernels. */}}
{{- $_ := set $pool "concurrency" 1 }}
{{- $pools = append $pools $pool }}
{{- end }}
{{- toJson (dict "pools" $pools) }}
{{- end }}

{{/*
KILN_REDIS_URL for the api and the workers: from the external Redis' Secret when named, else
from the ConfigMap (in-chart Redis, or an external URL without credentials).
*/}}
{{- define "kiln.redisEnv" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.existingSecret }}
- name: KILN_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- end }}
{{- end }}

{{/* S3 credentials by reference (api, workers, runtime). */}}
{{- define "kiln.storeEnv" -}}
{{- if and (eq .Values.artifactStore.type "s3") .Values.artifactStore.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.artifactStore.s3.existingSecret }}
      key: {{ .Values.artifactStore.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.artifactStore.s3.existingSecret }}
      key: {{ .Values.artifactStore.s3.secretAccessKeyKey }}
{{- end }}
{{- end }}

{{/* What every Kiln pod template shares, below its own spec keys. Call with $. */}}
{{- define "kiln.podCommon" -}}
serviceAccountName: {{ include "kiln.serviceAccountName" . }}
# No Kiln process talks to the Kubernetes API: no token in the pods.
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The checksum that restarts pods when the ConfigMap changes. */}}
{{- define "kiln.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end }}

{{- define "kiln.scrapeAnnotations" -}}
{{- if .root.Values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/*
Volumes of a Kiln pod: a writable /tmp (TMPDIR) and data dir (KILN_DATA_DIR), since the root
filesystem is read-only, and the shared store volume when the store is a PVC.
Call with (dict "root" $ "tmpSizeLimit" "2Gi").
*/}}
{{- define "kiln.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .tmpSizeLimit }}
- name: data
  emptyDir:
    sizeLimit: 1Gi
{{- if eq .root.Values.artifactStore.type "pvc" }}
- name: store
  persistentVolumeClaim:
    claimName: {{ include "kiln.storeClaimName" .root }}
{{- end }}
{{- end }}

{{- define "kiln.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: data
  mountPath: /var/lib/kiln
{{- if eq .Values.artifactStore.type "pvc" }}
- name: store
  mountPath: {{ .Values.artifactStore.pvc.mountPath }}
{{- end }}
{{- end }}

{{/* The api's environment beyond the ConfigMap: Secrets by reference and extraEnv. */}}
{{- define "kiln.apiEnv" -}}
{{- include "kiln.redisEnv" . }}
{{- include "kiln.storeEnv" . }}
{{- if .Values.api.auth.existingSecret }}
- name: KILN_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.api.auth.existingSecret }}
      key: {{ .Values.api.auth.existingSecretKey }}
{{- end }}
{{- with .Values.api.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
