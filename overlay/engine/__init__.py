"""Engine-level checks: the real vLLM engine on a small GLM-5-architecture checkpoint (device runs)."""
