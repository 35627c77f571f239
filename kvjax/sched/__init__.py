"""Host-side cache manager and scheduler. Pure Python + numpy: this package never imports jax."""
