"""Plain PyTorch loops and Fabric: `auto_checkpoint` and the driver it gives the engine. No Lightning import."""
