"""The build pipeline: pin, fetch and verify, series, apply, rewrite the wheel, write dist/, install."""
