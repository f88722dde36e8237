"""The application on top of the library: the `pdd` CLI, the launcher and supervisor of `pdd up`,
`pdd top`, the benchmarks' shared helpers and the simulator. It imports services/ and shared/;
neither imports it."""
