"""Keeping the series alive: status, the editing workspace, rebase, cherry-pick, patch-lint, vLLM's own tests."""
