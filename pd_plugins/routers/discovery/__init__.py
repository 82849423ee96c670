"""Worker discovery: the router learns its workers from an orchestrator instead of flags.

kubernetes.py: pods picked by a label selector (pods.py: what a pod is to the router;
kube_config.py: which API and namespace; selector.py: the selector string).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_plugins.routers.config import ConfigError, DiscoverySpec


@dataclass(frozen=True)
class KubernetesPlan:
    """A discovery configuration checked when the router is built (so --check-config and startup
    fail on a bad selector or a missing kubeconfig), before any connection is made."""

    spec: DiscoverySpec
    selector: list
    target: Any  # kube_config.KubeTarget

    def describe(self) -> str:
        return (f"pods {self.spec.selector!r} in namespace {self.target.namespace} of "
                f"{self.target.server} ({self.target.source})")


def check_installed() -> None:
    try:
        import lightkube  # noqa: F401
        import lightkube.models  # noqa: F401
    except ImportError:
        raise ConfigError("discovery kind kubernetes needs the lightkube packages: "
                          "pip install 'pd-plugins[kubernetes]'") from None


def plan_kubernetes(spec: DiscoverySpec) -> KubernetesPlan:
    check_installed()
    # imported here, not at the top: a router without discovery never loads the client library
    from pd_plugins.routers.discovery.kube_config import select_kube_config
    from pd_plugins.routers.discovery.selector import parse_label_selector

    return KubernetesPlan(spec, parse_label_selector(spec.selector),
                          select_kube_config(spec.kubeconfig, spec.namespace))


def kubernetes_watcher(sink, plan: KubernetesPlan, models: dict[str, str] | None):
    """A PodWatcher (not started) that adds and removes `sink`'s workers. `models`: pd.model label
    value -> model name; None: the router's one unnamed model takes every pod."""
    import httpx2
    from lightkube import AsyncClient

    from pd_plugins.routers.discovery.kubernetes import PodWatcher

    client = AsyncClient(config=plan.target.config, namespace=plan.target.namespace,
                         timeout=httpx2.Timeout(10.0))
    return PodWatcher(sink, client, plan.target.namespace, plan.selector, models,
                      max_pods=plan.spec.max_pods, watch_timeout_s=plan.spec.watch_timeout_s,
                      retry_max_s=plan.spec.retry_max_s)


__all__ = ["KubernetesPlan", "kubernetes_watcher", "plan_kubernetes"]
