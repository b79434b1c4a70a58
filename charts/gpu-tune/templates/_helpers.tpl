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

{{/* The startup taint's KEY[=VALUE]:EFFECT for the agent's GPU_TUNE_TAINT, or "off". */}}
{{- define "gpu-tune.taint" -}}
{{- with .Values.startupTaint -}}
{{- if .manage -}}{{ .key }}{{ with .value }}={{ . }}{{ end }}:{{ .effect }}{{- else -}}off{{- end -}}
{{- end -}}
{{- end -}}

{{/* The tolerations value, plus the startup taint (and the default one, which the agent removes
     after a change of key) when that value does not tolerate everything. A toleration of a
     taint's key without an effect, or with its effect, covers it. */}}
{{- define "gpu-tune.tolerations" -}}
{{- $all := false -}}
{{- $out := .Values.tolerations -}}
{{- range .Values.tolerations -}}
{{- if and (eq (.operator | default "Equal") "Exists") (not .key) (not .effect) }}{{ $all = true }}{{ end -}}
{{- end -}}
{{- if and .Values.startupTaint.tolerate (not $all) -}}
{{- range $taint := uniq (list (dict "key" $.Values.startupTaint.key "effect" $.Values.startupTaint.effect) (dict "key" "gpu-tune.io/not-ready" "effect" "NoSchedule")) -}}
{{- $covered := false -}}
{{- range $.Values.tolerations -}}
{{- if and (eq (.key | default "") $taint.key) (or (not .effect) (eq .effect $taint.effect)) }}{{ $covered = true }}{{ end -}}
{{- end -}}
{{- if not $covered -}}
{{- $out = append $out (dict "key" $taint.key "operator" "Exists" "effect" $taint.effect) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $out }}{{ toYaml $out }}{{ end -}}
{{- end -}}
