"""The GPU path: schedules that bind loops to blocks and threads, the split of a fused group
into device kernels, launch configurations and the checks a GPU schedule must pass."""
