{{/* Names */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "pdserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pdserve.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The RayCluster; KubeRay names its head Service "<name>-head-svc". */}}
{{- define "pdserve.rayClusterName" -}}{{ include "pdserve.fullname" . }}{{- end -}}
{{- define "pdserve.routerName" -}}{{ include "pdserve.fullname" . }}-router{{- end -}}
{{- define "pdserve.redisName" -}}{{ include "pdserve.fullname" . }}-redis{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* What the worker pods are made of besides the image: the values their spec is rendered from (not the replica
counts, which change no pod). KubeRay never recreates a running pod for a changed template, so a change here must
be a new build, whose workers the controller rolls onto new pods, as it does for a new image. */}}
{{- define "pdserve.workerPodsDigest" -}}
{{- $v := .Values -}}
{{- $groups := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $_ := set $groups $role (omit (index $v $role) "replicas" "minReplicas" "maxReplicas") -}}
{{- end -}}
{{- $redis := pick $v.redis "enabled" "url" "existingSecret" "passwordKey" "caSecret" "caKey" -}}
{{- /* Not the engine's values nor the bind address: they reach the workers through the controller's flags, which
it compares itself (a worker restarts in place, with no new pod to wait for). */ -}}
{{- $pods := dict "groups" $groups "model" $v.model "workers" $v.workers "drain" $v.drain "redis" $redis
  "tls" $v.tls "drainKey" $v.apiKeys.drainKey "clusterSecret" $v.clusterSecret "otel" $v.otel
  "rayAuthToken" (pick $v.ray.authToken "enabled" "existingSecret") "gpuResourceName" $v.gpuResourceName "routerPort" $v.router.port
  "pullPolicy" $v.image.pullPolicy "podSecurityContext" $v.podSecurityContext "securityContext" $v.securityContext
  "imagePullSecrets" $v.imagePullSecrets "serviceAccount" (pick $v.serviceAccount "create" "name") "tmp" $v.tmp -}}
{{- toJson $pods | sha256sum | trunc 12 -}}
{{- end -}}

{{/* The build every pdserve process reports (PDSERVE_BUILD): the image and the worker pods' digest. */}}
{{- define "pdserve.build" -}}
{{- printf "%s pods.%s" (include "pdserve.image" .) (include "pdserve.workerPodsDigest" .) -}}
{{- end -}}

{{/* The Ray custom resource the worker pods of this build advertise and `--build-resources` actors ask for: a
new build's workers land on new pods. pdserve.build.build_resource computes the same from PDSERVE_BUILD. */}}
{{- define "pdserve.buildResource" -}}
{{- printf "pdserve_build_%s" (include "pdserve.build" . | sha256sum | trunc 12) -}}
{{- end -}}

{{/* The controller's account (the one with API rights), never the RayCluster's name: with the autoscaler on,
KubeRay gives the head pod an account of that name and binds its autoscaler Role to it, so sharing the name would
hand each pod the other's rights. */}}
{{- define "pdserve.serviceAccountName" -}}
{{- $name := "" -}}
{{- if .Values.serviceAccount.create -}}
{{- $name = default (printf "%s-controller" (include "pdserve.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- $name = default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- if eq $name (include "pdserve.rayClusterName" .) -}}
{{- fail (printf "serviceAccount.name must not be %q, the RayCluster's name: KubeRay binds the Ray autoscaler's Role to an account of that name" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* Labels. Call with (dict "ctx" $ "component" "router"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
{{- end -}}

{{/* Redis: the bundled one's URL, or the external redis.url. */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.url -}}
{{- fail (printf "redis.url (%s) is set, but redis.enabled is true: the chart would run its bundled Redis and use it everywhere, ignoring redis.url. To use the external Redis, set redis.enabled=false with redis.url; else leave redis.url empty" .Values.redis.url) -}}
{{- end -}}
{{- printf "redis://%s:6379/0" (include "pdserve.redisName" .) -}}
{{- else -}}
{{- required "redis.url is required when redis.enabled is false" .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* Where the GCS keeps its tables (ray.gcsFaultTolerance): a Redis that outlives its pod, never the bundled one. */}}
{{- define "pdserve.gcsRedisAddress" -}}
{{- $address := required "ray.gcsFaultTolerance.redisAddress is required: a Redis that keeps its data across its restarts (host:port or rediss://host:port). The GCS stops when its Redis comes back empty, so the bundled Redis, which keeps nothing, would turn each of its restarts into a head restart that replaces every worker" .Values.ray.gcsFaultTolerance.redisAddress -}}
{{- $host := $address | lower | trimPrefix "rediss://" | trimPrefix "redis://" | splitList ":" | first | splitList "." | first -}}
{{- $bundled := include "pdserve.redisName" . -}}
{{- if and .Values.redis.enabled (has $host (list $bundled (printf "%s-0" $bundled) (printf "%s-headless" $bundled))) -}}
{{- fail (printf "ray.gcsFaultTolerance.redisAddress %s is the bundled Redis, which keeps nothing: the GCS stops when its Redis comes back empty, so each of its restarts would restart the head and replace every worker. Name a Redis that keeps its data" $address) -}}
{{- end -}}
{{- $address -}}
{{- end -}}

{{/* The Secret with the GCS's Redis password: its own, else the external registry Redis's (often the same Redis). */}}
{{- define "pdserve.gcsRedisSecret" -}}
{{- if .Values.ray.gcsFaultTolerance.existingSecret -}}
{{- .Values.ray.gcsFaultTolerance.existingSecret -}}
{{- else if not .Values.redis.enabled -}}
{{- .Values.redis.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.gcsRedisPasswordKey" -}}
{{- if .Values.ray.gcsFaultTolerance.existingSecret -}}{{ .Values.ray.gcsFaultTolerance.passwordKey }}{{- else -}}{{ .Values.redis.passwordKey }}{{- end -}}
{{- end -}}

{{- define "pdserve.redisSecretName" -}}
{{- if .Values.redis.existingSecret -}}{{ .Values.redis.existingSecret }}{{- else if .Values.redis.enabled -}}{{ include "pdserve.redisName" . }}{{- end -}}
{{- end -}}

{{- define "pdserve.clusterSecretName" -}}
{{- default (printf "%s-cluster" (include "pdserve.fullname" .)) .Values.clusterSecret.existingSecret -}}
{{- end -}}

{{- define "pdserve.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "pdserve.fullname" .)) .Values.ray.authToken.existingSecret -}}
{{- end -}}

{{/* A generated secret keeps its value across upgrades (lookup). `helm template`, and GitOps tools that render
with it, cannot look up (lookup answers an empty map there): each render makes a new value, so there the
existing-secret values must be set. */}}
{{- define "pdserve.keptSecret" -}}
{{- include "pdserve.keptValue" (dict "old" (lookup "v1" "Secret" .ctx.Release.Namespace .name) "key" .key) -}}
{{- end -}}

{{/* `old`: the Secret as it is live (empty: none yet). Its base64 value at `key`, else a new random one (48
letters and digits): an empty value is replaced too, since an empty cluster secret would turn internal auth off. */}}
{{- define "pdserve.keptValue" -}}
{{- $kept := index ((.old | default dict).data | default dict) .key -}}
{{- if $kept -}}
{{- $kept -}}
{{- else -}}
{{- randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- end -}}

{{/* Ray token authentication: every Ray process and every Ray client carry the same token. Off is said
explicitly: with RAY_AUTH_MODE unset, Ray 2.60 turns token auth on by itself wherever it finds a token file. */}}
{{- define "pdserve.rayAuthEnv" -}}
{{- if .Values.ray.authToken.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom: {secretKeyRef: {name: {{ include "pdserve.rayTokenSecretName" . | quote }}, key: token}}
{{- else }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- end -}}

{{/* A container that asks for no GPU: the image's CUDA base sets NVIDIA_VISIBLE_DEVICES=all, so on a node whose
default container runtime is nvidia it would see every GPU of the node, those given to other pods too. */}}
{{- define "pdserve.noGpuEnv" -}}
- name: NVIDIA_VISIBLE_DEVICES
  value: void
{{- end -}}

{{/* Environment of the pdserve processes: the model cache, addresses, secrets, OpenTelemetry. Call with
(dict "ctx" $ "ray" true "podAttributes" true): `ray` adds the Ray token (the router never talks to Ray);
`podAttributes` names the pod in OTEL_RESOURCE_ATTRIBUTES, off for the controller, which may hand its OTEL_*
variables to the worker actors it starts (they would report the controller's pod). */}}
{{- define "pdserve.env" -}}
{{- $v := .ctx.Values -}}
- name: PDSERVE_CACHE_DIR
  value: {{ $v.model.cache.mountPath | quote }}
{{ include "pdserve.tmpEnv" .ctx }}
# The build every pdserve process reports, and a controller compares to roll the workers it adopts. A router rolls
# no workers: it reports its image alone, so a change to the worker pods does not restart it.
- name: PDSERVE_BUILD
  value: {{ ternary (include "pdserve.build" .ctx) (include "pdserve.image" .ctx) .ray | quote }}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: PDSERVE_CLUSTER_SECRET
  valueFrom: {secretKeyRef: {name: {{ include "pdserve.clusterSecretName" .ctx | quote }}, key: secret}}
{{- with include "pdserve.redisSecretName" .ctx }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ . | quote }}, key: {{ $v.redis.passwordKey | quote }}}}
{{- end }}
{{- if $v.redis.caSecret }}
- name: PDSERVE_REDIS_CA_CERT
  value: {{ include "pdserve.redisCAFile" .ctx | quote }}
{{- end }}
{{- if .ray }}
{{- include "pdserve.rayAuthEnv" .ctx }}
{{- end }}
{{- with $v.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $v.otel.protocol | quote }}
{{- end }}
{{- if .podAttributes }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),service.instance.id=$(POD_NAME)"
{{- end }}
{{- range $name, $value := $v.otel.env }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- range $name, $ref := $v.otel.secretEnv }}
- name: {{ $name }}
  valueFrom: {secretKeyRef: {name: {{ $ref.name | quote }}, key: {{ $ref.key | quote }}}}
{{- end }}
{{- end -}}

{{/* /tmp of every pdserve container, whose root filesystem is read-only (securityContext.readOnlyRootFilesystem):
Ray's session files, the model fetch's downloads, compile caches (HOME points there: Triton's, matplotlib's). */}}
{{- define "pdserve.tmpVolume" -}}
- name: tmp
  emptyDir: {sizeLimit: {{ .Values.tmp.sizeLimit }}}
{{- end -}}

{{- define "pdserve.tmpMount" -}}
- {name: tmp, mountPath: /tmp}
{{- end -}}

{{- define "pdserve.tmpEnv" -}}
- name: HOME
  value: /tmp
{{- end -}}

{{/* The model cache volume and the init container that fills it. */}}
{{- define "pdserve.modelVolume" -}}
- name: model-cache
{{- if .Values.model.cache.existingClaim }}
  persistentVolumeClaim: {claimName: {{ .Values.model.cache.existingClaim | quote }}}
{{- else if .Values.model.cache.persistentVolumeClaim.create }}
  persistentVolumeClaim: {claimName: {{ include "pdserve.fullname" . }}-models}
{{- else }}
  emptyDir: {sizeLimit: {{ .Values.model.cache.emptyDir.sizeLimit }}}
{{- end }}
{{- end -}}

{{- define "pdserve.modelInit" -}}
{{- if .Values.model.fetch }}
- name: fetch-model
  image: {{ include "pdserve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["fetch", "--model", {{ .Values.model.name | quote }}]
  env:
    - name: PDSERVE_CACHE_DIR
      value: {{ .Values.model.cache.mountPath | quote }}
    {{- include "pdserve.tmpEnv" . | nindent 4 }}
    {{- include "pdserve.noGpuEnv" . | nindent 4 }}
    {{- with .Values.model.fetchEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources: {{- toYaml .Values.model.fetchResources | nindent 4 }}
  securityContext: {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: model-cache, mountPath: {{ .Values.model.cache.mountPath | quote }}}
    {{- include "pdserve.tmpMount" . | nindent 4 }}
{{- end }}
{{- end -}}

{{/* The CA a rediss:// Redis's certificate is checked against (redis.caSecret), where every pod mounts it. */}}
{{- define "pdserve.redisCAFile" -}}
/etc/pdserve/redis-ca/{{ .Values.redis.caKey }}
{{- end -}}

{{- define "pdserve.redisCAVolume" -}}
{{- $v := .Values -}}
{{- $registryTls := and (not $v.redis.enabled) (hasPrefix "rediss://" $v.redis.url) -}}
{{- $gcsTls := and $v.ray.gcsFaultTolerance.enabled (hasPrefix "rediss://" $v.ray.gcsFaultTolerance.redisAddress) -}}
{{- if $v.redis.caSecret }}
{{- if not (or $registryTls $gcsTls) }}
{{- fail "redis.caSecret is set, but no Redis is reached over TLS: the external redis.url (redis.enabled=false) or ray.gcsFaultTolerance.redisAddress must be rediss://" }}
{{- end }}
# Only the key named: a Secret without it fails the mount, visibly, rather than every Redis connection.
- name: redis-ca
  secret: {secretName: {{ $v.redis.caSecret | quote }}, items: [{key: {{ $v.redis.caKey | quote }}, path: {{ $v.redis.caKey | quote }}}]}
{{- end }}
{{- end -}}

{{- define "pdserve.redisCAMount" -}}
{{- if .Values.redis.caSecret }}
- {name: redis-ca, mountPath: /etc/pdserve/redis-ca, readOnly: true}
{{- end }}
{{- end -}}

{{/* TLS: which Secrets a pod mounts, and where (the Redis CA too, but for a client of the router). role: router,
controller, worker or client (the chart's smoke test: a worker's TLS files). */}}
{{- define "pdserve.tlsVolumes" -}}
{{- $tls := .ctx.Values.tls -}}
{{- if not $tls.enabled -}}
{{- range $name := list "publicSecret" "clientCASecret" "internalSecret" -}}
{{- if index $tls $name -}}
{{- fail (printf "tls.%s (%s) is set, but tls.enabled is false: every connection would be plaintext and the Secret unused. Set tls.enabled=true (with tls.publicSecret and tls.internalSecret), or leave tls.%s empty" $name (index $tls $name) $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if ne .role "client" }}
{{- include "pdserve.redisCAVolume" .ctx }}
{{- end }}
{{- if .ctx.Values.tls.enabled }}
- name: tls-internal
  secret: {secretName: {{ required "tls.internalSecret is required when tls.enabled" .ctx.Values.tls.internalSecret | quote }}}
{{- if eq .role "router" }}
- name: tls-public
  secret: {secretName: {{ required "tls.publicSecret is required when tls.enabled" .ctx.Values.tls.publicSecret | quote }}}
{{- else if or (eq .role "worker") (eq .role "client") }}
# A worker's preStop drain is a client of the router: it needs the CA, never the router's key.
- name: tls-public
  secret:
    secretName: {{ required "tls.publicSecret is required when tls.enabled" .ctx.Values.tls.publicSecret | quote }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end }}
{{- if and (eq .role "router") .ctx.Values.tls.clientCASecret }}
- name: tls-client-ca
  secret: {secretName: {{ .ctx.Values.tls.clientCASecret | quote }}}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.tlsMounts" -}}
{{- if ne .role "client" }}
{{- include "pdserve.redisCAMount" .ctx }}
{{- end }}
{{- if .ctx.Values.tls.enabled }}
- {name: tls-internal, mountPath: /etc/pdserve/tls/internal, readOnly: true}
{{- if ne .role "controller" }}
- {name: tls-public, mountPath: /etc/pdserve/tls/public, readOnly: true}
{{- end }}
{{- if and (eq .role "router") .ctx.Values.tls.clientCASecret }}
- {name: tls-client-ca, mountPath: /etc/pdserve/tls/client-ca, readOnly: true}
{{- end }}
{{- end }}
{{- end -}}

{{/* Internal mTLS for a pdserve process (router, controller; the workers inherit it). Peers dial pod IPs, which
the internal certificate cannot name: every internal channel checks for tls.internalServerName instead. */}}
{{- define "pdserve.internalTlsArgs" -}}
{{- if .Values.tls.enabled }}
- --internal-tls-cert
- /etc/pdserve/tls/internal/tls.crt
- --internal-tls-key
- /etc/pdserve/tls/internal/tls.key
- --internal-tls-ca
- /etc/pdserve/tls/internal/ca.crt
- --internal-tls-server-name
- {{ .Values.tls.internalServerName | quote }}
{{- end }}
{{- end -}}

{{/* The name the router's public certificate carries: what its clients check, whatever address they dial. */}}
{{- define "pdserve.publicServerName" -}}
{{- default (include "pdserve.routerName" .) .Values.tls.serverName -}}
{{- end -}}

{{/* A client of the router's public port (a worker's preStop drain, `helm test`): its CA and the certificate's
name, and, when the router asks for a client certificate, the pod's internal one, which the router also accepts
(it trusts the cluster CA beside tls.clientCASecret's). */}}
{{- define "pdserve.publicClientTlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-ca
- /etc/pdserve/tls/public/ca.crt
- --tls-server-name
- {{ include "pdserve.publicServerName" . | quote }}
{{- if .Values.tls.clientCASecret }}
- --tls-cert
- /etc/pdserve/tls/internal/tls.crt
- --tls-key
- /etc/pdserve/tls/internal/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{/* A gRPC health probe on a port: the kubelet's own gRPC probe over plaintext; with TLS (which the kubelet
cannot speak) the same Health/Check from pdserve's probe module with the pod's certificates.
Call with (dict "ctx" $ "port" 50061 "public" false). */}}
{{- define "pdserve.grpcProbe" -}}
{{- if .ctx.Values.tls.enabled }}
exec:
  command:
    - python
    - -m
    - pdserve.rpc.health_probe
    - --addr
    - 127.0.0.1:{{ .port }}
{{- if .public }}
    - --tls-ca
    - /etc/pdserve/tls/public/ca.crt
    - --server-name
    - {{ include "pdserve.publicServerName" .ctx | quote }}
{{- if .ctx.Values.tls.clientCASecret }}
    - --tls-cert
    - /etc/pdserve/tls/internal/tls.crt
    - --tls-key
    - /etc/pdserve/tls/internal/tls.key
{{- end }}
{{- else }}
    - --tls-ca
    - /etc/pdserve/tls/internal/ca.crt
    - --tls-cert
    - /etc/pdserve/tls/internal/tls.crt
    - --tls-key
    - /etc/pdserve/tls/internal/tls.key
    - --server-name
    - {{ .ctx.Values.tls.internalServerName | quote }}
{{- end }}
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end -}}

{{/* NetworkPolicy peers: this release's pods of the given components. */}}
{{- define "pdserve.peers" -}}
- podSelector:
    matchExpressions:
      - {key: app.kubernetes.io/instance, operator: In, values: [{{ .ctx.Release.Name | quote }}]}
      - {key: app.kubernetes.io/component, operator: In, values: [{{ join ", " .components }}]}
{{- end -}}
