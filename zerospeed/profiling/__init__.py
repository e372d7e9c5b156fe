"""Profiling: the flops profiler (`zerospeed.profiling.flops_profiler`)."""
