"""ddiloco: Decoupled DiLoCo over a shared bucket."""
__version__ = "0.1.0"
