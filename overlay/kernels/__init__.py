"""The kernel path: which CUDA targets a series rebuilds, their sources offline, the toolchain, the build order."""
