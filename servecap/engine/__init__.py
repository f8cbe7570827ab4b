"""The serving engine. The scheduler and block pool here import no torch, so the simulator runs them too."""
