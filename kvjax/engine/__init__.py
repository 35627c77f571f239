"""The jitted step function, its inputs, sampling and the engine loop."""
