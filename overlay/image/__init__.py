"""The Docker image: its plan and build arguments, the container engines, the base's CPU stand-in, the smoke."""
