"""The two ceilings of a roofline, peak FLOP/s and memory bandwidth, plus memory size, for known
hardware or given by hand."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(slots=True, frozen=True)
class Hardware:
    key: str
    name: str
    peak_flops: float       # dense BF16 matmul FLOP/s (weight-only quantised models compute in bf16)
    bandwidth: float        # memory bytes/s
    memory: int             # bytes
    source: str

    @property
    def ridge(self) -> float:
        """FLOP per byte at which a kernel stops waiting on memory and starts waiting on math."""
        return self.peak_flops / self.bandwidth


GB = 10**9
GIB = 1 << 30

# Datasheet figures. NVIDIA quotes tensor FLOP/s "with sparsity" (2:4 structured); a dense model
# gets half of that, which is the figure kept here. Memory sizes are the datasheets' decimal GB.
HARDWARE_PRESETS = (
    Hardware("h100", "H100 SXM 80GB", 989e12, 3.35e12, 80 * GB,
             "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity, 3.35 TB/s HBM3"),
    Hardware("h200", "H200 SXM 141GB", 989e12, 4.8e12, 141 * GB,
             "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity, 4.8 TB/s HBM3e"),
    Hardware("a100", "A100 SXM 80GB", 312e12, 2.039e12, 80 * GB,
             "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (624 with sparsity), "
             "2,039 GB/s HBM2e"),
    Hardware("l4", "L4 24GB", 121e12, 300 * GB, 24 * GB,
             "NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity, 300 GB/s GDDR6"),
    Hardware("rtx4090", "GeForce RTX 4090 24GB", 165.2e12, 1008 * GB, 24 * GB,
             "NVIDIA Ada Lovelace architecture whitepaper, appendix: BF16 tensor with FP32 "
             "accumulate 165.2 TFLOPS dense, 1,008 GB/s GDDR6X"),
    Hardware("this", "this machine (2-core Zen 5)", 870e9, 78 * GB, 24 * GIB,
             "shared/PERFORMANCE-NOTES.md: bf16 oneDNN matmul ~830-910 GFLOP/s, 2-thread bandwidth "
             "peaks ~78 GB/s (often half of it), 24 GiB"),
)


def hardware_names() -> list[str]:
    return [h.key for h in HARDWARE_PRESETS]


def find_hardware(key: str) -> Hardware:
    for hw in HARDWARE_PRESETS:
        if hw.key == key.lower():
            return hw
    raise ValueError(f"unknown hardware {key!r}: choose one of {', '.join(hardware_names())} "
                     "or give --flops, --bandwidth and --memory")


def edit_hardware(base: Hardware, peak_flops: float | None = None, bandwidth: float | None = None,
                  memory: int | None = None) -> Hardware:
    """A preset with some figures replaced (measured ones, or another variant's); with all three
    replaced nothing of the preset is left, and it is called custom."""
    given = [(field, label, value) for field, label, value in (
        ("peak_flops", "FLOP/s", peak_flops), ("bandwidth", "bandwidth", bandwidth),
        ("memory", "memory", memory)) if value is not None]
    if not given:
        return base
    if any(value <= 0 for _, _, value in given):
        raise ValueError("hardware figures (FLOP/s, bandwidth, memory) must be positive")
    labels = ", ".join(label for _, label, _ in given)
    if len(given) == 3:
        name, source = "custom", f"{labels} given by hand"
    else:
        name, source = f"{base.name} ({labels} given)", f"{base.source}; {labels} given"
    return replace(base, **{field: value for field, _, value in given}, name=name, source=source)
