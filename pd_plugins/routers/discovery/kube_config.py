"""Which Kubernetes API the router talks to, as whom, and in which namespace.

In order: a kubeconfig file named in the configuration; in a pod (KUBERNETES_SERVICE_HOST set
and a service-account token mounted), the service account; else $KUBECONFIG or ~/.kube/config.
The namespace: the configured one, else the service account's own (in a pod) or the
kubeconfig context's, else "default".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from lightkube import KubeConfig
from lightkube.config.kubeconfig import DEFAULT_KUBECONFIG, SERVICE_ACCOUNT, SingleConfig
from lightkube.core.exceptions import ConfigError as KubeConfigError

from pd_plugins.routers.config import ConfigError


@dataclass(frozen=True)
class KubeTarget:
    config: SingleConfig
    namespace: str
    source: str  # for the startup log: "in-cluster" or the kubeconfig path

    @property
    def server(self) -> str:
        return self.config.cluster.server


def in_cluster(service_account: str | Path = SERVICE_ACCOUNT) -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and \
        Path(service_account, "token").is_file()


def select_kube_config(kubeconfig: str | None = None, namespace: str | None = None, *,
                       service_account: str | Path = SERVICE_ACCOUNT) -> KubeTarget:
    try:
        if kubeconfig is not None:
            config, source = KubeConfig.from_file(kubeconfig).get(), kubeconfig
        elif in_cluster(service_account):
            if not os.environ.get("KUBERNETES_SERVICE_PORT"):
                raise ConfigError("in a pod, KUBERNETES_SERVICE_PORT is needed beside "
                                  "KUBERNETES_SERVICE_HOST")
            config, source = KubeConfig.from_service_account(service_account).get(), "in-cluster"
        else:
            path = os.environ.get("KUBECONFIG") or DEFAULT_KUBECONFIG
            if not Path(path).expanduser().is_file():
                raise ConfigError(
                    "kubernetes discovery: not in a pod (no KUBERNETES_SERVICE_HOST and service "
                    f"account token) and no kubeconfig at {path}: give --kubeconfig PATH")
            config, source = KubeConfig.from_file(path).get(), path
    except KubeConfigError as exc:
        raise ConfigError(f"kubernetes discovery: {exc}") from None
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"kubernetes discovery: unusable config ({type(exc).__name__}: {exc})") \
            from None
    return KubeTarget(config, namespace or config.namespace, source)
