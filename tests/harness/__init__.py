"""The shared test harness: real processes, servers, stores and fixtures the suites use."""
