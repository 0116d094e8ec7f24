{{/* What an upgrade reads from the live RayCluster (`lookup`; nothing on install or under `helm template`): each
worker group's count, and the Ray version the running head has. */}}

{{/* A worker group's replicas: on an upgrade the live RayCluster's (the Ray autoscaler and `pdserve scale --kubernetes`
move them after install, and KubeRay's CRD makes workerGroupSpecs one atomic field, so rendering the install-time
count would put it back: with the autoscaler off KubeRay then deletes pods at random), unless the values' count is
not the one the last release rendered from (`helm upgrade --set prefill.replicas=N`: the controller takes a changed
count too, so the pods must follow it); kept within this release's minReplicas..maxReplicas; on install, the
values'. `live`: the group's entry in the live object, or nothing; `rendered`: the values' count the live object
was rendered from (its pdserve.io/values-replicas annotation), or nothing (a release before it: the live count). */}}
{{- define "pdserve.workerReplicas" -}}
{{- $w := .values -}}
{{- $n := int $w.replicas -}}
{{- $unchanged := or (kindIs "invalid" .rendered) (eq (toString .rendered) (toString $w.replicas)) -}}
{{- if and .live (hasKey .live "replicas") $unchanged -}}
{{- $n = int .live.replicas -}}
{{- end -}}
{{- max (int $w.minReplicas) (min $n (int $w.maxReplicas)) -}}
{{- end -}}

{{/* Refuses an upgrade that changes the Ray version of a running RayCluster (`live`: its spec; none on install or
under `helm template`) unless KubeRay is to recreate the cluster: KubeRay never replaces a running head pod, and
Ray nodes refuse a peer of another version, so the new worker pods and the controller could never join it. */}}
{{- define "pdserve.rayVersionGuard" -}}
{{- $ray := .values.ray -}}
{{- $running := (default (dict) .live).rayVersion -}}
{{- if and $running (ne (toString $running) (toString $ray.version)) (ne $ray.upgradeStrategy "Recreate") -}}
{{- fail (printf "ray.version %s: the running RayCluster's head runs Ray %s, which KubeRay never replaces, and Ray %s cannot join it. Upgrade with --set ray.upgradeStrategy=Recreate (KubeRay then replaces every pod of the cluster: the workers restart and load their model again), then set it back to \"\" in a later upgrade; or keep ray.version %s with an image of that Ray" $ray.version $running $ray.version $running) -}}
{{- end -}}
{{- end -}}

{{/* A warning for the upgrade's notes when the running Ray head's image is not the one this release renders:
KubeRay never replaces a running head pod (unless ray.upgradeStrategy=Recreate), while the controller, a Ray Client
of the head, and the new worker pods run the new image. `pods`: the namespace's pods (`lookup`; none on install or
under `helm template`), `cluster`: the RayCluster's name, `image`: the image this release renders, `strategy`:
ray.upgradeStrategy. */}}
{{- define "pdserve.headImageNote" -}}
{{- $running := "" -}}
{{- range .pods -}}
{{- $labels := default (dict) (.metadata).labels -}}
{{- if and (eq (get $labels "ray.io/cluster") $.cluster) (eq (get $labels "ray.io/node-type") "head") -}}
{{- range (.spec).containers -}}
{{- if eq .name "ray-head" }}{{ $running = .image }}{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $running (ne $running .image) (ne .strategy "Recreate") -}}
The Ray head still runs {{ $running }}: KubeRay does not replace a running head pod, while the controller (a Ray
Client of the head) and new worker pods run {{ .image }}. Ray Client refuses a Python minor version other than the
head's, and a new worker pod (a Ray node) even another patch version; and the head unpickles what the controller
sends it (worker specs, results) with its own pdserve. If {{ .image }} changes the Python version, or pdserve classes the
controller sends to Ray incompatibly, upgrade again with --set ray.upgradeStrategy=Recreate (KubeRay replaces every
pod: the workers load their model again), then set it back to "" in a later upgrade.
{{- end -}}
{{- end -}}

{{/* Refuses an upgrade that changes the Ray token of a running RayCluster (`live`: its spec; none on install or
under `helm template`) unless KubeRay is to recreate the cluster: token auth turned on or off, or the token taken
from another Secret (`secret`: the one this release names). KubeRay never replaces a running head pod, so the head
keeps the token it started with and refuses the controller (its Ray Client) and new worker pods presenting another;
and even the same token under a new name leaves the head's env naming the old Secret, which Helm deletes once the
chart stops making it, so the head's container could not start again. */}}
{{- define "pdserve.rayTokenGuard" -}}
{{- $env := dict -}}
{{- range (dig "headGroupSpec" "template" "spec" "containers" (list) (default (dict) .live)) -}}
{{- if eq .name "ray-head" -}}
{{- range (.env | default list) }}{{ $_ := set $env .name . }}{{ end -}}
{{- end -}}
{{- end -}}
{{- $ray := .values.ray -}}
{{- $mode := ternary "token" "disabled" $ray.authToken.enabled -}}
{{- $liveMode := dig "RAY_AUTH_MODE" "value" "" $env -}}
{{- $liveSecret := dig "RAY_AUTH_TOKEN" "valueFrom" "secretKeyRef" "name" "" $env -}}
{{- $changed := "" -}}
{{- if and $liveMode (ne $liveMode $mode) -}}
{{- $changed = printf "RAY_AUTH_MODE=%s, and the running head has %s" $mode $liveMode -}}
{{- else if and (eq $mode "token") $liveSecret (ne $liveSecret .secret) -}}
{{- $changed = printf "the token in Secret %s, and the running head's env names %s" .secret $liveSecret -}}
{{- end -}}
{{- if and $changed (ne $ray.upgradeStrategy "Recreate") -}}
{{- fail (printf "ray.authToken: this upgrade gives the controller and new worker pods %s; KubeRay never replaces a running head pod, which keeps its token (and its env's Secret, which Helm deletes once the chart stops making it). Keep ray.authToken as it was, or upgrade with --set ray.upgradeStrategy=Recreate (KubeRay then replaces every pod of the cluster: the workers restart and load their model again), then set it back to \"\" in a later upgrade" $changed) -}}
{{- end -}}
{{- end -}}
