"""What a Kubernetes pod is to the router: a prefill or decode worker of one model, or nothing.

Labels say what the pod is (`pd.role`, `pd.model`); annotations say where its ports are
(`pd-plugins.io/*`). A pod becomes a worker only once Kubernetes calls it Ready, it has an IP and
it is not being deleted; the router then probes it itself before it gets traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_plugins.routers.config import WorkerSpec

ROLE_LABEL = "pd.role"
MODEL_LABEL = "pd.model"
ANNOTATION_PREFIX = "pd-plugins.io/"
DEFAULT_HTTP_PORT = 8000
ROLES = ("prefill", "decode")

@dataclass(frozen=True)
class PodWorker:
    """The worker a pod stands for; equal values mean nothing the router cares about changed."""

    role: str
    model: str | None  # the group's name; None: the only group
    spec: WorkerSpec

    @property
    def key(self) -> tuple[str, str, str | None]:
        return (self.spec.url, self.role, self.model)

    def role_change_of(self, other: PodWorker | None) -> bool:
        """The same engine (address, model) relabelled to the other role."""
        return other is not None and self.role != other.role and self.model == other.model \
            and self.spec.url == other.spec.url

    def same_as(self, other: PodWorker | None) -> bool:
        return other is not None and self.role == other.role and self.model == other.model \
            and self.spec == other.spec


class NotAWorker(ValueError):
    """The pod's labels or annotations cannot make a worker (logged once per pod)."""


def is_serving(pod) -> bool:
    """Ready in Kubernetes, has an IP, not being deleted."""
    meta, status = pod.metadata, pod.status
    if meta is None or meta.deletionTimestamp is not None or status is None or not status.podIP:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())


def _port(annotations: dict[str, str], name: str, default: int | None = None) -> int | None:
    raw = annotations.get(ANNOTATION_PREFIX + name)
    if raw is None:
        return default
    value = raw.strip()
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses
    if not (value.isascii() and value.isdigit() and len(value) <= 5 and 0 < int(value) < 65536):
        raise NotAWorker(f"annotation {ANNOTATION_PREFIX}{name}={raw!r} is not a port number")
    return int(value)


def pod_worker(pod, models: dict[str, str] | None) -> PodWorker | None:
    """The worker this pod is now, or None while it must not be one (not Ready, deleting).

    `models` maps a `pd.model` label value to its group's name; None: one unnamed group, which
    takes every pod whatever its `pd.model`. Raises NotAWorker for a pod that is ours by the
    selector but never can be a worker as labelled (an unknown role or model, a bad port)."""
    labels = pod.metadata.labels or {}
    role = labels.get(ROLE_LABEL)
    if role not in ROLES:
        raise NotAWorker(f"label {ROLE_LABEL}={role!r} is neither prefill nor decode")
    model = None
    if models is not None:
        label = labels.get(MODEL_LABEL)
        if label not in models:
            known = ", ".join(sorted(models)) or "none"
            raise NotAWorker(f"label {MODEL_LABEL}={label!r} names no configured model "
                             f"(discovery labels: {known})")
        model = models[label]
    if not is_serving(pod):
        return None
    notes = pod.metadata.annotations or {}
    ip = pod.status.podIP
    host = f"[{ip}]" if ":" in ip else ip
    kv_events_port = _port(notes, "kv-events-port")
    replay_port = _port(notes, "kv-events-replay-port")
    try:
        spec = WorkerSpec(
            url=f"http://{host}:{_port(notes, 'http-port', DEFAULT_HTTP_PORT)}",
            kv_port=_port(notes, "kv-port"),
            # vLLM push: a Deployment cannot annotate each prefill pod, so its engine id may be
            # its pod name (the downward API); only push mode reads it
            engine_id=notes.get(ANNOTATION_PREFIX + "engine-id")
            or (pod.metadata.name if role == "prefill" else None),
            bootstrap_port=_port(notes, "bootstrap-port"),
            kv_events=f"tcp://{host}:{kv_events_port}" if kv_events_port else None,
            kv_events_replay=f"tcp://{host}:{replay_port}" if replay_port else None,
            # started with kv_role kv_both: a pd.role change moves it (drained), no restart
            kv_both=notes.get(ANNOTATION_PREFIX + "kv-both", "").strip().lower() == "true")
    except ValueError as exc:  # WorkerSpec's own checks
        raise NotAWorker(str(exc)) from None
    return PodWorker(role, model, spec)


def pod_name(pod) -> str:
    meta = pod.metadata
    return f"{meta.namespace or '?'}/{meta.name}"


def pod_key(pod) -> str:
    """Identity across events: the UID (a pod recreated under the same name is a new pod)."""
    return pod.metadata.uid or pod_name(pod)
