"""The front ends, side by side over the one engine: the Lightning callback and strategies
(`lightning`), and plain PyTorch loops and Fabric (`loops`). Neither imports the other."""
