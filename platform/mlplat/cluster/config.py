"""The one file a user edits to deploy: ``cluster_configs/cluster.yaml`` as a typed config.

``mlplat cluster render`` turns it into KubeRay manifests (RayCluster, RayJob, RayService) and
Ray cluster launcher YAMLs; the templates hold the structure, this config the choices.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, model_validator

from mlplat.config import Config
from mlplat.serve.auth import RateLimit
from mlplat.tenants import TenantName

DNSLabel = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$", max_length=63)]  # Kubernetes names
Quantity = Annotated[str, StringConstraints(pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")]  # e.g. 32Gi
ResourceName = Annotated[str, StringConstraints(pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9_.-]+$")]  # e.g. rdma/hca_shared_devices_a

GPUType = Literal["A100", "H100", "H200", "B200", "L40S"]

# What GPU feature discovery labels such nodes with (nvidia.com/gpu.product; check yours with
# `kubectl get nodes -L nvidia.com/gpu.product`), and an AWS instance type with 8 of them.
GPU_PRODUCTS: dict[str, tuple[str, str]] = {
    "A100": ("NVIDIA-A100-SXM4-80GB", "p4de.24xlarge"),
    "H100": ("NVIDIA-H100-80GB-HBM3", "p5.48xlarge"),
    "H200": ("NVIDIA-H200", "p5e.48xlarge"),
    "B200": ("NVIDIA-B200", "p6-b200.48xlarge"),
    "L40S": ("NVIDIA-L40S", "g6e.48xlarge"),
}


class HeadNode(Config):
    cpus: int = Field(8, ge=1)
    memory: Quantity = "32Gi"


class GPUNodes(Config):
    nodes: int = Field(2, ge=0)  # RayCluster: nodes at start; RayJob: exactly these
    max_nodes: int | None = Field(None, ge=0)  # RayCluster autoscaling ceiling (default: nodes)
    gpus_per_node: int = Field(8, ge=1)
    cpus: int = Field(96, ge=1)
    memory: Quantity = "1000Gi"
    shm: Quantity = "256Gi"  # /dev/shm in RAM: NCCL buffers, dataloader workers, the object store

    @model_validator(mode="after")
    def _ceiling(self) -> GPUNodes:
        if self.max_nodes is not None and self.max_nodes < self.nodes:
            raise ValueError(f"max_nodes ({self.max_nodes}) is below nodes ({self.nodes}): raise max_nodes or lower nodes")
        return self


class RDMA(Config):
    enabled: bool = True
    # The device plugin's resource: rdma/hca_shared_devices_a (k8s-rdma-shared-dev-plugin, shared
    # HCAs) or nvidia.com/hostdev (NVIDIA Network Operator, SR-IOV VFs); `kubectl describe node` lists it.
    resource: ResourceName = "rdma/hca_shared_devices_a"
    per_node: int = Field(1, ge=1)
    hca: str = "mlx5"  # NCCL_IB_HCA: IB devices NCCL may use (prefix match)
    gid_index: int | None = 3  # NCCL_IB_GID_INDEX: 3 is RoCE v2 on most setups; null on InfiniBand
    socket_ifname: str = "eth0"  # NCCL_SOCKET_IFNAME: the pod's interface for NCCL's TCP bootstrap


class SFTJob(Config):
    config: str = "/mnt/shared/configs/sft.yaml"  # an SFT config readable in the pods (shared storage or the image)
    overrides: list[str] = Field(default_factory=list)  # extra --set KEY=VALUE; num_workers and use_gpu come from gpu_workers


class LLMService(Config):
    model: str = "/mnt/shared/models/Qwen2.5-0.5B-Instruct"  # HF directory in the pods, or models:/NAME@ALIAS
    prefill_nodes: int = Field(1, ge=1)  # one prefill replica per GPU on these nodes
    decode_nodes: int = Field(1, ge=1)  # one decode replica per GPU on these nodes
    ingress_replicas: int = Field(2, ge=1)
    engine_args: dict[str, Any] = Field(default_factory=lambda: {"device": "cuda", "dtype": "bfloat16", "kv_cache_memory_gb": 40})
    api_keys_secret: DNSLabel = "mlplat-api-keys"  # Secret with key api_keys: "tenant:key,tenant:key"
    rate_limits: dict[TenantName, RateLimit] = Field(default_factory=dict)
    default_rate_limit: RateLimit | None = RateLimit(requests_per_s=20, burst=40)


# A server every node reaches; a file or sqlite store lives on one node only (the driver's), so the
# steps of a multi-node job would track into stores nobody reads.
ServerURI = Annotated[str, StringConstraints(pattern=r"^(https?://[^/\s:]+(:[0-9]{1,5})?(/\S*)?|databricks(://\S*)?)$")]
RedisAddress = Annotated[str, StringConstraints(pattern=r"^(rediss?://)?[A-Za-z0-9.-]+:[0-9]{1,5}$")]  # host:port


class TrackingServer(Config):
    """MLflow's tracking server on the head when ``mlflow_tracking_uri`` is not set: in the RayCluster's head pod
    (a sidecar; the RayJob and RayService track to it) and on the launchers' head, its store on the shared volume."""

    port: int = Field(5000, ge=1, le=65535)
    # One writer (the server) keeps sqlite on a shared volume safe; point at PostgreSQL for heavy use.
    backend_store_uri: str = "sqlite:////mnt/shared/mlflow/mlflow.db"
    artifacts_destination: str = "/mnt/shared/mlflow/artifacts"  # served by the server: clients need no access to it
    workers: int = Field(2, ge=1)  # server processes (mlflow server --workers)
    cpus: int = Field(1, ge=1)
    memory: Quantity = "2Gi"


class GcsFaultTolerance(Config):
    """The head's GCS keeps its tables in an external Redis, so a restarted head finds its jobs, actors and Serve apps."""

    redis_address: RedisAddress  # host:port of a highly available Redis the KubeRay head reaches, e.g. redis.redis.svc:6379
    password_secret: DNSLabel | None = "mlplat-redis"  # Secret with key `password` (KubeRay); null: Redis without a password
    # The Redis `ray up` heads reach (e.g. ElastiCache); default: redis_address unless it is a Kubernetes Service name
    # (the launcher configs then have no GCS fault tolerance).
    launcher_redis_address: RedisAddress | None = None
    launcher_password_file: str = "~/.ray/redis_password"  # copied to the launcher's head by file_mounts (when password_secret is set)


class AWSLauncher(Config):
    region: str = "us-west-2"
    head_instance_type: str = "m6i.2xlarge"
    gpu_instance_type: str | None = None  # default: an 8-GPU instance of gpu_type
    ssh_user: str = "ubuntu"


class ClusterConfig(Config):
    name: DNSLabel = "mlplat"
    tenant: TenantName = "default"  # owner of everything rendered: labels, Kueue queue, default namespace
    namespace: DNSLabel | None = None  # Kubernetes namespace (default: the tenant's name)
    queue: DNSLabel | None = None  # Kueue LocalQueue in that namespace (default: the tenant's name)
    image: str = Field(min_length=1)  # an image with mlplat installed (cluster_configs/Dockerfile)
    ray_version: str = "2.60.0"  # the Ray in the image
    gpu_type: GPUType = "H100"
    gpu_node_selector: dict[str, str] | None = None  # default: {nvidia.com/gpu.product: <GPU_PRODUCTS[gpu_type]>}
    head: HeadNode = HeadNode()
    gpu_workers: GPUNodes = GPUNodes()
    rdma: RDMA = RDMA()
    shared_pvc: DNSLabel | None = "mlplat-shared"  # ReadWriteMany claim mounted at /mnt/shared (models, data, checkpoints)
    ray_token_secret: DNSLabel = "mlplat-ray-token"  # Secret with key auth_token (Ray token authentication)
    mlflow_tracking_uri: ServerURI | None = None  # an MLflow server every pod reaches; null: mlflow_server on the RayCluster's head
    mlflow_server: TrackingServer = TrackingServer()
    gcs_fault_tolerance: GcsFaultTolerance | None = None  # null: a head failure loses the cluster's state
    sft: SFTJob = SFTJob()
    llm: LLMService = LLMService()
    aws: AWSLauncher = AWSLauncher()

    @model_validator(mode="after")
    def _tracking_store(self) -> ClusterConfig:
        server = self.mlflow_server
        on_shared = "/mnt/shared/" in server.backend_store_uri + server.artifacts_destination
        if self.mlflow_tracking_uri is None and self.shared_pvc is None and on_shared:
            raise ValueError("mlflow_server keeps its store on /mnt/shared but shared_pvc is null: set shared_pvc, "
                             "point mlflow_server.backend_store_uri/artifacts_destination elsewhere, or set mlflow_tracking_uri")
        return self

    @property
    def k8s_namespace(self) -> str:
        return self.namespace or self.tenant

    @property
    def kueue_queue(self) -> str:
        return self.queue or self.tenant

    @property
    def gpu_selector(self) -> dict[str, str]:
        if self.gpu_node_selector is not None:
            return self.gpu_node_selector
        return {"nvidia.com/gpu.product": GPU_PRODUCTS[self.gpu_type][0]}

    @property
    def tracking_uri(self) -> str:
        """What every pod of every manifest tracks to: the given server, else the RayCluster head's."""
        return self.mlflow_tracking_uri or f"http://{self.name}-head-svc.{self.k8s_namespace}.svc:{self.mlflow_server.port}"

    @property
    def gpu_instance_type(self) -> str:
        return self.aws.gpu_instance_type or GPU_PRODUCTS[self.gpu_type][1]
