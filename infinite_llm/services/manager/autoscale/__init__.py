"""Elastic attention pool: the manager scales the attention-server StatefulSet with the KV pressure.

:mod:`.policy` decides (pure, tested without a cluster), :mod:`..drain` (the manager's, shared with servers
that stop on their own) keeps placement off a server being drained and tells when it is empty,
:mod:`.k8s_client` is the one module that calls the Kubernetes API,
and :mod:`.controller` ties them to the :class:`GlobalManager` (``infinite-llm serve manager
--k8s-statefulset NAME``).
"""

from infinite_llm.services.manager.autoscale.controller import Autoscaler, AutoscaleSettings
from infinite_llm.services.manager.autoscale.k8s_client import KubernetesScaler, StatefulSetScaler
from infinite_llm.services.manager.autoscale.policy import (
    Action,
    Decision,
    PoolObservation,
    ScalingConfig,
    ScalingPolicy,
    ServerLoad,
)
from infinite_llm.services.manager.drain import DrainGuard

__all__ = [
    "Action",
    "AutoscaleSettings",
    "Autoscaler",
    "Decision",
    "DrainGuard",
    "KubernetesScaler",
    "PoolObservation",
    "ScalingConfig",
    "ScalingPolicy",
    "ServerLoad",
    "StatefulSetScaler",
]
