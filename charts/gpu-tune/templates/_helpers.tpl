{{/* Object names: the release name, with "-gpu-tune" appended unless it already says gpu-tune. */}}
{{- define "gpu-tune.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-tune.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of every object: the kustomize tree's app.kubernetes.io/name plus Helm's own. */}}
{{- define "gpu-tune.labels" -}}
{{ include "gpu-tune.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "gpu-tune.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* enforce and revert write the host: writable /proc and /sys, privileged, the enforce overlays' shape. */}}
{{- define "gpu-tune.enforcing" -}}
{{- if has .Values.mode (list "enforce" "revert") }}true{{ end -}}
{{- end -}}

{{/* Where the agent runs: GPU nodes (NFD or GPU Operator label), narrowed by profile-request. */}}
{{- define "gpu-tune.affinity" -}}
{{- if .Values.affinity -}}
{{ toYaml .Values.affinity }}
{{- else -}}
nodeAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    nodeSelectorTerms:
    {{- range .Values.nodeSelection.gpuNodeLabels }}
      - matchExpressions:
          - key: {{ . }}
            operator: In
            values: ["true"]
          {{- if $.Values.nodeSelection.byProfileRequest }}
          - key: gpu-tune.io/profile-request
          {{- if include "gpu-tune.enforcing" $ }}
            operator: In
            values: [{{ $.Values.profile | quote }}]
          {{- else }}
            operator: NotIn
            values: {{ toJson $.Values.nodeSelection.enforcingProfiles }}
          {{- end }}
          {{- end }}
    {{- end }}
{{- end -}}
{{- end -}}

{{/* The tolerations value, plus the startup taint when that value does not tolerate everything. */}}
{{- define "gpu-tune.tolerations" -}}
{{- $all := false -}}
{{- $startup := false -}}
{{- range .Values.tolerations -}}
{{- if and (eq (.operator | default "Equal") "Exists") (not .key) (not .effect) }}{{ $all = true }}{{ end -}}
{{- if eq (.key | default "") "gpu-tune.io/not-ready" }}{{ $startup = true }}{{ end -}}
{{- end -}}
{{- $out := .Values.tolerations -}}
{{- if and .Values.startupTaint.tolerate (not $all) (not $startup) -}}
{{- $out = append $out (dict "key" "gpu-tune.io/not-ready" "operator" "Exists" "effect" "NoSchedule") -}}
{{- end -}}
{{- if $out }}{{ toYaml $out }}{{ end -}}
{{- end -}}
