"""What every benchmark shares: the one worker launcher and readiness check (`bench.lib.worker`) and the one results
writer (`bench.lib.results`)."""
