"""What the tests share: drivers, oracles, the fake CUDA runtime and helpers (no tests here)."""
