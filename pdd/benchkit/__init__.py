"""What the benchmarks in bench/ share: the catalog of `pdd bench`, progress bars, reports, CPU use."""
