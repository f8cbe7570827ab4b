"""The serving core the engine (GPU clock) and the simulator (virtual clock) share: block pool, scheduler, step
loop, recorder and router. Torch-free; engine/ and sim/ each build their loop from it and neither imports the other."""
