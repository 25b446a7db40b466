"""A typed model of the KubeRay RayService (apiVersion ray.io/v1) fields our manifest uses, kept in the repo so the
manifest is checked without a cluster or a network call.

Field names and required fields follow KubeRay's Go types (ray-operator/apis/ray/v1: RayServiceSpec,
RayClusterSpec, HeadGroupSpec, WorkerGroupSpec) and, for the pod template, the Kubernetes core/v1 fields we set.
Every level forbids unknown keys, so a misspelt field fails here instead of being dropped by the API server.
rayStartParams is map[string]string in the CRD: values must be strings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"  # Kubernetes resource.Quantity (plain forms)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ObjectMeta(_Strict):
    name: StrictStr
    namespace: StrictStr | None = None
    labels: dict[str, StrictStr] | None = None
    annotations: dict[str, StrictStr] | None = None


class EnvVar(_Strict):
    name: StrictStr
    value: StrictStr | None = None


class ContainerPort(_Strict):
    containerPort: StrictInt = Field(ge=1, le=65535)
    name: StrictStr | None = None
    protocol: Literal["TCP", "UDP", "SCTP"] | None = None


class VolumeMount(_Strict):
    name: StrictStr
    mountPath: StrictStr
    readOnly: StrictBool | None = None


class ResourceRequirements(_Strict):
    limits: dict[str, StrictStr] | None = None
    requests: dict[str, StrictStr] | None = None

    @field_validator("limits", "requests")
    @classmethod
    def _quantities(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        import re

        for key, q in (v or {}).items():
            if not re.match(QUANTITY, q):
                raise ValueError(f"{key}: {q!r} is not a resource quantity")
        return v


class Container(_Strict):
    name: StrictStr
    image: StrictStr
    resources: ResourceRequirements | None = None
    env: list[EnvVar] | None = None
    ports: list[ContainerPort] | None = None
    volumeMounts: list[VolumeMount] | None = None
    command: list[StrictStr] | None = None
    args: list[StrictStr] | None = None


class PersistentVolumeClaimSource(_Strict):
    claimName: StrictStr
    readOnly: StrictBool | None = None


class Volume(_Strict):
    name: StrictStr
    persistentVolumeClaim: PersistentVolumeClaimSource | None = None


class PodSpec(_Strict):
    containers: list[Container] = Field(min_length=1)
    volumes: list[Volume] | None = None
    nodeSelector: dict[str, StrictStr] | None = None


class PodTemplateSpec(_Strict):
    metadata: dict | None = None
    spec: PodSpec


class HeadGroupSpec(_Strict):
    template: PodTemplateSpec
    rayStartParams: dict[str, StrictStr]
    enableIngress: StrictBool | None = None
    serviceType: StrictStr | None = None


class WorkerGroupSpec(_Strict):
    groupName: StrictStr
    replicas: StrictInt | None = None
    minReplicas: StrictInt
    maxReplicas: StrictInt
    idleTimeoutSeconds: StrictInt | None = None
    rayStartParams: dict[str, StrictStr]
    template: PodTemplateSpec
    numOfHosts: StrictInt | None = None
    suspend: StrictBool | None = None


class RayClusterSpec(_Strict):
    headGroupSpec: HeadGroupSpec
    rayVersion: StrictStr | None = None
    workerGroupSpecs: list[WorkerGroupSpec] | None = None
    enableInTreeAutoscaling: StrictBool | None = None
    suspend: StrictBool | None = None


class RayServiceSpec(_Strict):
    serveConfigV2: StrictStr | None = None
    rayClusterConfig: RayClusterSpec


class RayService(_Strict):
    apiVersion: Literal["ray.io/v1"]
    kind: Literal["RayService"]
    metadata: ObjectMeta
    spec: RayServiceSpec
