"""Device, process groups, parallel layout, seeds, and Megatron-Core on CPU."""

from megatron_agent.platform.cpu_support import enable_cpu_support
from megatron_agent.platform.device import Platform, detect_platform
from megatron_agent.platform.distributed import (
    DistributedContext,
    control_group,
    free_port,
    from_leader,
    gather_from_data_parallel,
    init_distributed,
    scatter_to_data_parallel,
    set_seed,
    shutdown_distributed,
)
from megatron_agent.platform.parallel import (
    ParallelConfig,
    ParallelLayoutError,
    destroy_model_parallel,
    initialize_model_parallel,
)

__all__ = [
    "DistributedContext",
    "ParallelConfig",
    "ParallelLayoutError",
    "Platform",
    "control_group",
    "destroy_model_parallel",
    "detect_platform",
    "enable_cpu_support",
    "free_port",
    "from_leader",
    "gather_from_data_parallel",
    "init_distributed",
    "initialize_model_parallel",
    "scatter_to_data_parallel",
    "set_seed",
    "shutdown_distributed",
]
