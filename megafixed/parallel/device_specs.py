"""Data-sheet peaks of the GPUs we report MFU and bandwidth fractions against, by exact device name, and
the links between them: read by the planner (``plan --fake``), the benchmarks and the trainer's MFU.

Why exact names: the SXM, PCIe and NVL parts of one generation share a prefix but not a peak
(H100 PCIe 756 vs SXM 989 dense bf16 TFLOP/s), so substring matching reports a PCIe card's MFU
against the SXM peak. A device not in the table gets no peak, and its MFU is reported as unknown
(``None``) rather than guessed; ``MEGAFIXED_PEAK_TFLOPS`` supplies one by hand.

Keys are ``torch.cuda.get_device_name()`` as the driver reports it, without the ``NVIDIA `` prefix,
upper case. Figures: dense (no sparsity) bf16 tensor-core TFLOP/s and HBM bandwidth in TB/s, from
NVIDIA's H100/H200/A100/B200 data sheets (the sheets quote bf16 "with sparsity": dense is half).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from .. import env as env_vars


class DeviceSpec(NamedTuple):
    part: str  # the data sheet's name of the part
    bf16_tflops: float  # dense
    hbm_tbps: float


_H100_SXM = DeviceSpec("H100 SXM", 989.0, 3.35)
_H200_SXM = DeviceSpec("H200 SXM", 989.0, 4.8)
SPECS: dict[str, DeviceSpec] = {
    "H100 80GB HBM3": _H100_SXM,
    "H100 SXM5 80GB": _H100_SXM,
    "H100 PCIE": DeviceSpec("H100 PCIe", 756.0, 2.0),
    "H100 NVL": DeviceSpec("H100 NVL", 835.5, 3.9),
    "H200": _H200_SXM,
    "H200 NVL": DeviceSpec("H200 NVL", 835.5, 4.8),
    "A100-SXM4-40GB": DeviceSpec("A100 40GB SXM", 312.0, 1.555),
    "A100-SXM4-80GB": DeviceSpec("A100 80GB SXM", 312.0, 2.039),
    "A100-PCIE-40GB": DeviceSpec("A100 40GB PCIe", 312.0, 1.555),
    "A100 80GB PCIE": DeviceSpec("A100 80GB PCIe", 312.0, 1.935),
    "B200": DeviceSpec("B200", 2250.0, 8.0),
}


# The part each compile target's roofline is drawn for (``bench kernels --compile-only``): the SXM part
# of each architecture, the fastest memory of its generation that the data sheets list.
ARCH_PART = {80: "A100-SXM4-80GB", 90: "H100 80GB HBM3", 100: "B200"}


def arch_spec(arch: int) -> Optional[DeviceSpec]:
    """The data-sheet entry that ``sm_<arch>``'s roofline uses, or None for an arch not listed."""
    return SPECS.get(ARCH_PART[arch]) if arch in ARCH_PART else None


def normalise(device_name: str) -> str:
    name = " ".join(device_name.split()).upper()
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name


def spec_for(device_name: Optional[str]) -> Optional[DeviceSpec]:
    """The data-sheet entry of exactly this device, or None."""
    return SPECS.get(normalise(device_name)) if device_name else None


def peak_bf16_flops(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 FLOP/s of one such GPU (``MEGAFIXED_PEAK_TFLOPS`` overrides), or None if unknown."""
    by_hand = env_vars.peak_tflops()
    if by_hand is not None:
        return by_hand * 1e12
    spec = spec_for(device_name)
    return None if spec is None else spec.bf16_tflops * 1e12


def hbm_bandwidth(device_name: Optional[str]) -> Optional[float]:
    """Data-sheet memory bandwidth in bytes/s, or None if the device is not in the table."""
    spec = spec_for(device_name)
    return None if spec is None else spec.hbm_tbps * 1e12


class Link(NamedTuple):
    name: str
    gbps_per_gpu: float  # GB/s one GPU can send (one direction) over this link


# Bandwidth per GPU and direction, from the vendors' sheets: NVLink 4 (H100/H200 SXM) is 900 GB/s
# bidirectional per GPU (NVIDIA H100 data sheet), 450 each way; NVLink 3 (A100 SXM) 600 -> 300;
# NVLink 5 (B200) 1.8 TB/s -> 900. InfiniBand NDR is 400 Gb/s = 50 GB/s per port and direction
# (NVIDIA ConnectX-7 / Quantum-2), HDR 200 Gb/s = 25 GB/s; DGX H100 nodes have one port per GPU.
LINKS: dict[str, Link] = {
    "nvlink3": Link("NVLink 3", 300.0),
    "nvlink4": Link("NVLink 4", 450.0),
    "nvlink5": Link("NVLink 5", 900.0),
    "ib-ndr400": Link("InfiniBand NDR 400G", 50.0),
    "ib-hdr200": Link("InfiniBand HDR 200G", 25.0),
}
NODE_LINK = {"H100 SXM": "nvlink4", "H200 SXM": "nvlink4", "A100 40GB SXM": "nvlink3", "A100 80GB SXM": "nvlink3",
             "B200": "nvlink5"}  # each SXM part's link inside a node (PCIe/NVL parts: not listed, no bound)


def link(name: str) -> Optional[Link]:
    return LINKS.get(name.lower())
