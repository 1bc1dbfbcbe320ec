"""The median CUDA-event time of a callable, shared by the peer scripts (peers.py,
peer_gdn.py). torch is imported on the first call: a script may put it on the path first."""


def median_ms(f, warmup=5, reps=30):
    """Median of `reps` CUDA-event timings of `f` after `warmup` calls, in ms."""
    import torch

    for _ in range(warmup):
        f()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
