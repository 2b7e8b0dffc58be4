"""What a run measures besides time: forward passes (a hook on the backbone), peak memory, the machine."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
from pathlib import Path

import torch


class ForwardCounter:
    """Counts calls of a backbone and the rows they carried (a batched call of ``b`` rows counts ``b``)."""

    def __init__(self, backbone: torch.nn.Module):
        self.calls = self.rows = 0
        self._handle = backbone.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        tensor = args[0] if args else kwargs.get("input_ids")
        if tensor is None:
            tensor = kwargs.get("inputs_embeds")
        self.calls += 1
        self.rows += int(tensor.shape[0]) if tensor is not None else 1

    def close(self) -> None:
        """Remove the hook."""
        self._handle.remove()


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator statistics, or sampled RSS on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = "cuda_max_memory_allocated" if device.type == "cuda" else "rss_peak_delta_sampled"
        self.peak_mb = 0.0
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = self._peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, _rss_bytes())
        self.peak_mb = max(0.0, (peak - self._base) / 2**20)


def _rss_bytes() -> int:
    """Resident set size now (Linux ``/proc``; elsewhere the process's peak RSS so far)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def machine_description(device: str, dtype: str) -> dict:
    """CPU/GPU names, core and thread counts, library versions, load average."""
    import transformers

    description = {
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "dtype": dtype,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(OSError, AttributeError):
        description["load_average_1m_at_start"] = round(os.getloadavg()[0], 2)
    return description


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
