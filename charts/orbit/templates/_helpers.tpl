{{/* Labels every Orbit object carries. */}}
{{- define "orbit.labels" -}}
app.kubernetes.io/name: orbit
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The operator pod's selector labels. */}}
{{- define "orbit.selectorLabels" -}}
app.kubernetes.io/name: orbit
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "orbit.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default .Release.Name }}
{{- end }}

{{/* An image reference: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "orbit.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .chart.AppVersion) }}
{{- end }}

{{/* What the operator may do to jobs, their pods and ConfigMaps, and Events (exactly what it
     calls: tests/kube/test_rbac.py compares these rules with the calls its tests record). */}}
{{- define "orbit.jobRules" -}}
- apiGroups: [orbit.dev]
  resources: [rltrainingjobs]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [orbit.dev]
  resources: [rltrainingjobs/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- /* the per-job API key (made once, read to poll /status) and the values of the Secrets a job names, which the
       operator masks in what it writes; it never lists Secrets */}}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create]
{{- end }}
{{- if .Values.kueue.enabled }}
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end }}
{{- end }}
