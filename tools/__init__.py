"""Development tools (benchmarks, checks, probes, the SASS reader): they import the library, which never imports them."""
