import numpy as np
import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list/array as a device tensor without a host sync.

    A plain copy from pageable memory makes the host wait for every queued kernel, which
    would end CPU/GPU overlap; a copy from pinned memory (torch's caching host allocator,
    which keeps a buffer until its copy has run) is truly asynchronous.
    """
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    if isinstance(data, np.ndarray):
        host = torch.from_numpy(data).to(dtype).pin_memory()
    else:
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
