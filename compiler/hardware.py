"""Device presets: peak compute, memory and link bandwidths of one accelerator.

Owns the figures the cost model reads (:class:`DeviceSpec`) and the lookup by name. All
bandwidths are per device and per direction, in bytes/s; compute is dense (no 2:4
sparsity) 16-bit tensor-core FLOP/s; memory is what ``nvidia-smi --query-gpu=memory.total``
reports, in GiB (the datasheets' "80 GB" is decimal and marketing-rounded).

Sources (vendor datasheets, figures as published):

- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity
  (989.5 dense), HBM3 3.35 TB/s, NVLink 900 GB/s (bidirectional, 450 each way), PCIe Gen5
  128 GB/s (64 each way). DGX H100 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU (50 GB/s).
  nvidia-smi: 81,559 MiB.
- H200 SXM: NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s, BF16 1,979 TFLOPS sparse
  (989.5 dense), NVLink 900 GB/s, PCIe Gen5; DGX H200: 8x ConnectX-7 400 Gb/s.
  nvidia-smi: 143,771 MiB.
- A100 80GB SXM: NVIDIA A100 datasheet: BF16 312 TFLOPS dense, HBM2e 2,039 GB/s, NVLink
  600 GB/s (300 each way), PCIe Gen4 64 GB/s (32 each way). DGX A100 datasheet: 8x
  ConnectX-6 200 Gb/s (25 GB/s per GPU). nvidia-smi: 81,920 MiB.
- H800 SXM: the export variant of H100: same compute and HBM3 (3.35 TB/s), NVLink cut to
  400 GB/s (200 each way) (NVIDIA H800 product page); DeepSeek-V3 technical report
  (arXiv:2412.19437, section 3.1): one 400 Gb/s InfiniBand NIC per H800 (50 GB/s).
- L40S: NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense, 48 GB GDDR6 at 864 GB/s, no NVLink
  (peers talk over PCIe Gen4 x16, 32 GB/s each way). Network: ASSUMED one 200 Gb/s NIC
  per two GPUs (12.5 GB/s per GPU), a common PCIe-server build. nvidia-smi: 46,068 MiB.
- cpu: one CPU worker process of the local runtime (one core). ASSUMED figures: AVX2 at
  3 GHz = 2 FMA units x 8 fp32 lanes x 2 FLOP = 96 GFLOP/s; 16 GiB of host memory per
  process; 20 GB/s of DRAM bandwidth per core; 10 GB/s between processes (shared
  memory); 1.25 GB/s between machines (10 GbE). One process hosts one engine, so nodes
  share a CPU device only when there are fewer devices than engines.

Collective latency is an ASSUMED 10 us per NCCL collective (50 us for gloo on CPU); it
only matters for the many small all-reduces of tensor-parallel decoding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from areal_flow.config_compile import CompileConfigError

GB = 1e9  # datasheets use decimal GB/s and TFLOPS
MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU worker process) as the cost model sees it.

    Attributes:
        name: preset name.
        peak_flops: dense bf16/fp16 tensor FLOP/s.
        memory_bytes: device memory, bytes.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        intra_node_bandwidth: device-to-device inside a machine (NVLink), bytes/s each way.
        inter_node_bandwidth: device-to-device across machines (NIC per device), bytes/s each way.
        host_bandwidth: device <-> host memory (PCIe), bytes/s each way (offload/reload).
        collective_latency_s: fixed cost of one collective call, seconds.
        one_engine_per_device: True when a device cannot time-share engines (CPU processes).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    host_bandwidth: float
    collective_latency_s: float = 10e-6
    one_engine_per_device: bool = False

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def to_dict(self) -> dict:
        return asdict(self)


_HOPPER = dict(peak_flops=989.5e12, intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB, host_bandwidth=64 * GB)

DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "H100": DeviceSpec("H100", memory_bytes=81_559 * MIB, hbm_bandwidth=3350 * GB, **_HOPPER),
    "H200": DeviceSpec("H200", memory_bytes=143_771 * MIB, hbm_bandwidth=4800 * GB, **_HOPPER),
    "H800": DeviceSpec(
        "H800",
        peak_flops=989.5e12,
        memory_bytes=81_559 * MIB,
        hbm_bandwidth=3350 * GB,
        intra_node_bandwidth=200 * GB,
        inter_node_bandwidth=50 * GB,
        host_bandwidth=64 * GB,
    ),
    "A100-80G": DeviceSpec(
        "A100-80G",
        peak_flops=312e12,
        memory_bytes=81_920 * MIB,
        hbm_bandwidth=2039 * GB,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        host_bandwidth=32 * GB,
    ),
    "L40S": DeviceSpec(
        "L40S",
        peak_flops=362.05e12,
        memory_bytes=46_068 * MIB,
        hbm_bandwidth=864 * GB,
        intra_node_bandwidth=32 * GB,
        inter_node_bandwidth=12.5 * GB,
        host_bandwidth=32 * GB,
    ),
    "cpu": DeviceSpec(
        "cpu",
        peak_flops=96e9,
        memory_bytes=16 * GIB,
        hbm_bandwidth=20 * GB,
        intra_node_bandwidth=10 * GB,
        inter_node_bandwidth=1.25 * GB,
        host_bandwidth=20 * GB,
        collective_latency_s=50e-6,
        one_engine_per_device=True,
    ),
}


def device_spec(name: str) -> DeviceSpec:
    """The preset called ``name`` (case-insensitive; ``A100`` means ``A100-80G``).

    Raises:
        CompileConfigError: unknown name; the message lists the presets (key ``cluster.gpu``).
    """
    table = {key.lower(): spec for key, spec in DEVICE_PRESETS.items()}
    table["a100"] = DEVICE_PRESETS["A100-80G"]
    spec = table.get(name.lower())
    if spec is None:
        raise CompileConfigError(f"cluster.gpu={name!r}: unknown device; known: {', '.join(DEVICE_PRESETS)}")
    return spec
