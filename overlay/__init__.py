"""vllm-overlay: build a patched, versioned vLLM wheel from the official wheel and a patch series."""

__version__ = "0.1.0"
